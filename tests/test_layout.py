"""Layout rules that keep imports unambiguous wherever the code runs.

A Prefect worker puts the entrypoint's folder (flows/) first on sys.path, so a module there
named like a top-level package shadows it: `flows/compress.py` once made `import compress`
load the flow module and crashed the deploy and rollback deployments on every worker.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _packages() -> set[str]:
    return {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}


def test_no_module_shares_its_name_with_a_top_level_package():
    import importlib.metadata as md

    top = _packages()
    assert {"compress", "serve", "flows", "tasks"} <= top
    # What the project imports from site-packages can be shadowed the same way.
    third_party = {"prefect", "mlflow", "torch", "transformers", "datasets", "onnx", "onnxruntime", "numpy",
                   "httpx", "fastapi", "uvicorn", "pydantic", "yaml", "tokenizers", "gguf"}
    clashes = []
    for pkg in sorted(top):
        for mod in (ROOT / pkg).rglob("*.py"):
            name = mod.stem if mod.name != "__init__.py" else None
            if name in top | third_party:
                clashes.append(str(mod.relative_to(ROOT)))
        for sub in (ROOT / pkg).iterdir():
            if sub.is_dir() and sub.name in top | third_party:
                clashes.append(str(sub.relative_to(ROOT)))
    assert not clashes, f"rename these: a worker that puts their folder on sys.path imports them instead: {clashes}"
    assert md.version("prefect")  # the list above names real distributions of this environment


def test_every_prefect_yaml_entrypoint_imports_from_its_own_folder():
    """Import each entrypoint the way a worker does (its folder first on sys.path) in a fresh interpreter."""
    import subprocess
    import sys

    import yaml

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    entrypoints = sorted({d["entrypoint"] for d in spec["deployments"]})
    assert len(entrypoints) == 3
    for ep in entrypoints:
        path, fn = ep.split(":")
        folder = str((ROOT / path).parent)
        code = (f"import sys, runpy; sys.path.insert(0, {folder!r}); ns = runpy.run_path({str(ROOT / path)!r}); "
                f"assert callable(ns[{fn!r}]); import compress.registry")
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{ep}: {r.stderr[-2000:]}"
