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
    assert len(entrypoints) == 4
    for ep in entrypoints:
        path, fn = ep.split(":")
        folder = str((ROOT / path).parent)
        code = (f"import sys, runpy; sys.path.insert(0, {folder!r}); ns = runpy.run_path({str(ROOT / path)!r}); "
                f"assert callable(ns[{fn!r}]); heavy = {{'torch', 'onnx', 'transformers'}} & set(sys.modules); "
                # a flow run's process imports its entrypoint: the stages' libraries wait until a task runs them
                f"assert not heavy, f'importing {ep} imported {{sorted(heavy)}}'; import compress.registry.store")
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
# The one exception: the device K/V store imports torch inside TorchKv, only when a runner keeps its K/V in GPU
# memory (the CUDA EP) or is told to rehearse that path; the server on the CPU EP never imports it.
ALLOWED_IMPORTS = {("serve/kv/device.py", "torch")}


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
                if name in forbidden and (path.relative_to(ROOT).as_posix(), name) not in ALLOWED_IMPORTS:
                    broken.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not broken, "import rules (docs/architecture.md, Layout and import rules) broken:\n" + "\n".join(broken)


# No import cycles (issue 30): a module that imports one that imports it back works only by the order in which
# they happen to load, and a circle hides which one is the lower layer. Every import counts: at any depth (lazy
# ones in functions), under `if TYPE_CHECKING:` (a circle for the reader all the same), relative ones, and
# importlib.import_module("…") with a literal name. A type both sides need lives in the lower module (or a
# Protocol there names what it needs of the higher one: serve/engine/request_handle.StepDriver, compress/quantize/
# sensitivity.QuantizerView).
CYCLE_PACKAGES = ("compress", "serve", "tasks", "flows", "loadtest")


def _module_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """{module: {imported project module: line}} from {module: (source, is_package)}; an import resolves to the
    longest module name it starts with (`from compress.export import gqa` -> compress.export.gqa,
    `from compress.evaluate import accept` -> compress.evaluate)."""
    import ast

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts:
            if ".".join(parts) in sources:
                return ".".join(parts)
            parts.pop()
        return None

    graph: dict[str, dict[str, int]] = {}
    for mod, (source, is_pkg) in sources.items():
        out: dict[str, int] = {}
        for node in ast.walk(ast.parse(source, filename=mod)):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                f = node.func
                if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in ("import_module", "__import__"):
                    names = [node.args[0].value]
            for n in names:
                target = resolve(n)
                if target and target != mod:
                    out.setdefault(target, node.lineno)
        graph[mod] = out
    return graph


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _project_sources(packages) -> dict[str, tuple[str, bool]]:
    sources = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_pkg else parts)
            sources[name] = (path.read_text(), is_pkg)
    return sources


def test_no_import_cycles():
    # The checker sees the kinds of import it is meant to see, and names the circle.
    probe = {
        "p": ("", True),
        "p.a": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n", False),
        "p.b": ("def f():\n    from . import c\n", False),
        "p.c": ("import importlib\nimportlib.import_module('p.a')\n", False),
    }
    assert _find_cycle(_module_graph(probe)) == ["p.a", "p.b", "p.c", "p.a"]
    del probe["p.c"]
    assert _find_cycle(_module_graph(probe)) is None

    graph = _module_graph(_project_sources(CYCLE_PACKAGES))
    cycle = _find_cycle(graph)
    if cycle:
        steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle (docs/architecture.md, Layout and import rules):\n  " + "\n  ".join(steps))


# compress/ by stage (docs/architecture.md, "compress/ by stage"): the shared base (the modules at the top and the rooms
# every stage stands on: loading, sizing, corpus, registry) imports no stage subpackage, and the stage subpackages
# import each other one way only: drivers <- export, evaluate <- prune, distill, quantize.
# A stage's settings module that compress/config.py imports (compress/<stage>/settings.py: its config section, which
# PipelineConfig composes) counts as shared: it imports only what the shared modules may.
SHARED_ROOMS = {"loading", "sizing", "corpus", "registry", "formats"}


def test_compress_subpackages_are_layered():
    graph = _module_graph(_project_sources(["compress"]))

    sections = {t for t in graph.get("compress.config", {}) if t.endswith(".settings")}

    def unit(mod: str) -> str:
        parts = mod.split(".")
        if mod in sections or (len(parts) > 2 and parts[1] in SHARED_ROOMS):
            return "compress"
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / "compress" / parts[1]).is_dir()) else "compress"

    subpackages = {p.name for p in (ROOT / "compress").iterdir() if (p / "__init__.py").is_file()}
    assert {"drivers", "export", "evaluate", "prune", "distill", "quantize"} <= subpackages
    shared_up = sorted(f"{m}:{line} imports {t}" for m, ts in graph.items() if unit(m) == "compress"
                       for t, line in ts.items() if unit(t) != "compress")
    assert not shared_up, "compress/'s shared top-level modules import a stage subpackage:\n" + "\n".join(shared_up)
    units: dict[str, dict[str, int]] = {}
    for m, ts in graph.items():
        for t, line in ts.items():
            if unit(m) != unit(t):
                units.setdefault(unit(m), {}).setdefault(unit(t), line)
    cycle = _find_cycle(units)
    assert cycle is None, f"compress/ subpackages import each other in a circle: {' -> '.join(cycle)}"


def test_compress_entry_points_resolve():
    """Every name a subpackage's __init__ promises (compress/_lazy.py) is there, and no __init__ imports its
    modules eagerly (importing compress.config or a subpackage stays cheap)."""
    import importlib
    import subprocess
    import sys

    code = ("import sys, compress.config, compress.drivers, compress.export, compress.evaluate, compress.prune, "
            "compress.distill, compress.quantize; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr[-2000:] or r.stdout
    for sub in ("export", "evaluate", "prune", "distill", "quantize"):
        pkg = importlib.import_module(f"compress.{sub}")
        missing = [n for n in pkg.__all__ if getattr(pkg, n, None) is None]
        assert not missing, f"compress.{sub} promises {missing}"


# serve/ in rooms (docs/architecture.md, the serve/ block): config.py and artifact.py at the top import no room; each
# room imports only itself and the rooms before it in this order; __main__ (the entry point) may import any.
SERVE_ROOMS = ("kv", "runners", "engine", "registry", "api", "replicas")


def _upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports in serve/ that break the room order (see SERVE_ROOMS)."""
    def room(mod: str) -> str:
        parts = mod.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in SERVE_ROOMS else "main" if parts[-1] == "__main__" else "top"

    rank = {r: i for i, r in enumerate(SERVE_ROOMS)}
    broken = []
    for m, targets in graph.items():
        for t, line in targets.items():
            a, b = room(m), room(t)
            if a == "main" or a == b or b == "top":
                continue
            if a == "top" or b == "main" or rank[b] > rank[a]:
                broken.append(f"{m}:{line} imports {t} ({a} -> {b})")
    return sorted(broken)


def test_serve_rooms_are_layered():
    # The rule reports a room importing a later one, and the top modules importing a room.
    probe = {"serve": ("", True), "serve.kv": ("", True), "serve.engine": ("", True),
             "serve.config": ("from serve.kv.cache import BlockManager\n", False),
             "serve.kv.cache": ("from serve.engine.engine import Engine\n", False),
             "serve.engine.engine": ("from serve.kv.cache import BlockManager\nimport serve.config\n", False)}
    assert _upward_imports(_module_graph(probe)) == [
        "serve.config:1 imports serve.kv.cache (top -> kv)", "serve.kv.cache:1 imports serve.engine.engine (kv -> engine)"]

    on_disk = {p.name for p in (ROOT / "serve").iterdir() if (p / "__init__.py").is_file()}
    assert on_disk == set(SERVE_ROOMS), f"serve/'s subpackages {sorted(on_disk)}: add a new one to SERVE_ROOMS"
    loose = sorted(p.name for p in (ROOT / "serve").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "artifact.py", "config.py"], f"a module outside a room: {loose}"
    broken = _upward_imports(_module_graph(_project_sources(["serve"])))
    assert not broken, "serve/'s rooms import upwards (order: " + " < ".join(SERVE_ROOMS) + "):\n" + "\n".join(broken)


def test_no_test_imports_a_benchmark_script():
    """Tests run benchmark entry points as their users do (tests/bench_cli.py: python -m benchmarks.<name>); what
    a test needs from one lives in the package (loadtest/, compress/, serve/)."""
    import re

    found = sorted(f"{p.name}:{i}" for p in (ROOT / "tests").glob("*.py")
                   for i, line in enumerate(p.read_text().splitlines(), 1)
                   if re.match(r"\s*(from benchmarks\b|import benchmarks\b)", line))
    assert not found, found
