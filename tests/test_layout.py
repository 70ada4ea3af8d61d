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


# Which package may import which (docs/architecture.md, "Layout and import rules"). Data flows one way,
# configs -> flows -> tasks -> compress -> artifacts -> serve: the stage functions run without Prefect,
# the load-testing library without the pipeline, and the server without torch.
# benchmarks/ holds scripts that are not installed, so no installed package may import it.
FORBIDDEN_IMPORTS = {
    "compress": {"prefect", "flows", "tasks", "loadtest", "benchmarks"},
    "tasks": {"flows", "benchmarks"},
    "flows": {"benchmarks"},
    "loadtest": {"flows", "tasks", "benchmarks"},
    # serve/ stands alone: its config, the manifest reader and the registry lookup are its own modules.
    "serve": {"compress", "torch", "flows", "tasks", "benchmarks"},
}


def _imports(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, top-level name) of every absolute import in the source, at any depth (lazy imports in
    functions count), including importlib.import_module("x") and __import__("x") with a literal name."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


def test_import_rules():
    # The checker sees every kind of import it is meant to see.
    probe = ("import torch.nn\nfrom prefect import task\nfrom . import sibling\n"
             "def f():\n    from flows.cli import main\n    importlib.import_module('tasks.load')\n")
    assert [n for _, n in _imports(probe)] == ["torch", "prefect", "flows", "tasks"]

    broken = []
    for pkg, forbidden in sorted(FORBIDDEN_IMPORTS.items()):
        files = sorted((ROOT / pkg).rglob("*.py"))
        assert files, f"{pkg}/ has no modules: is the rule still about a real package?"
        for path in files:
            for line, name in _imports(path.read_text(), str(path)):
                if name in forbidden:
                    broken.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not broken, "import rules (docs/architecture.md, Layout and import rules) broken:\n" + "\n".join(broken)
