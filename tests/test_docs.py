"""The docs cannot go stale: what README.md and docs/ name (config keys, defaults, paths, links, commands) exists.

Each check collects every miss over all docs and fails with the list, so one run shows all that went stale. The
configuration reference (docs/configuration.md) is generated from the schema and must be current.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

from compress.config import PipelineConfig
from compress.config_reference import DOC as CONFIG_DOC, render
from serve.config import RENAMED_KEYS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = [n for n, f in PipelineConfig.model_fields.items()
            if isinstance(f.annotation, type) and hasattr(f.annotation, "model_fields")]
TOP_DIRS = ("compress", "serve", "flows", "tasks", "tests", "docs", "configs", "benchmarks", "loadtest", "scripts")
TOP_FILES = ("README.md", "Makefile", "prefect.yaml", "pyproject.toml")
FILE_SUFFIXES = ("onnx", "py", "md", "json", "yaml", "yml", "txt", "gguf", "safetensors", "db", "jsonl", "data", "png",
                 "npz", "pkl", "csv")
# Code spans that read like keys and are not: a transformers attribute, a host name.
NOT_KEYS = {"model.hf_quantizer", "registry.internal"}
_KEY = re.compile(rf"(?<![\w/.-])({'|'.join(SECTIONS)})\.([a-z_][a-z0-9_]*)(?![\w(]|\.\w)")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _code(text: str) -> tuple[list[str], list[str]]:
    """(fenced blocks, inline code spans) of a markdown text."""
    blocks = _FENCE.findall(text)
    prose = _FENCE.sub("", text)
    return blocks, re.findall(r"`([^`\n]+)`", prose)


def _schema() -> dict[str, object]:
    keys: dict[str, object] = {}
    for name in SECTIONS:
        for key, field in PipelineConfig.model_fields[name].annotation.model_fields.items():
            value = field.default_factory() if field.default_factory is not None else field.default
            keys[f"{name}.{key}"] = value
    for (sec, old), _new in RENAMED_KEYS.items():
        keys.setdefault(f"{sec}.{old}", "(renamed)")
    return keys


SCHEMA = _schema()


def _is_module(section: str, rest: str) -> bool:
    """`serve.replicas.deploy`, `data.py`: a module or file, not a config key."""
    return (rest in FILE_SUFFIXES or (ROOT / section / f"{rest}.py").exists() or (ROOT / section / rest).is_dir())


def _docs():
    for path in DOCS:
        yield path.relative_to(ROOT), path.read_text()


def test_the_configuration_reference_is_current():
    text = (ROOT / CONFIG_DOC).read_text()
    assert text == render(), f"{CONFIG_DOC} is stale: run `python -m compress.config_reference`"
    for key in SCHEMA:
        if SCHEMA[key] != "(renamed)":
            assert f"| `{key}` |" in text


def test_every_config_key_the_docs_name_exists():
    missing = []
    for name, text in _docs():
        blocks, spans = _code(text)
        for code in [*blocks, *spans]:
            for section, rest in _KEY.findall(code):
                key = f"{section}.{rest}"
                if not _is_module(section, rest) and key not in SCHEMA and key not in NOT_KEYS:
                    missing.append(f"{name}: {key}")
    assert not missing, "keys named in the docs that the config does not have:\n" + "\n".join(sorted(set(missing)))


# "`serve.kv_block_size` defaults to 16", "`quantize.auto_profile` (code default `[]`", "`auto_profile` (default
# `[8, 32]`)": an unqualified name counts when one section alone has it.
_DEFAULT = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)?)`\*?\s*(?:defaults to|\((?:the )?(?:code )?default:?)\s*"
                      r"(?:`([^`]+)`|([^`,;)]+?)[,;)])")


def _said(text: str, bare: bool):
    """The value a doc states; a bare one is its first word ("16. Smaller blocks...", "0 = ORT's choice")."""
    value = (re.match(r"\S+(?: ?%)?", text.strip()).group(0) if bare else text.strip()).rstrip(".:")
    if value.startswith("$"):
        return None  # "defaults to $MLFLOW_TRACKING_URI": null, read from the environment
    if value.endswith("%"):
        return round(float(value.rstrip(" %")) / 100, 6)
    return yaml.safe_load(value)


def _qualified(key: str) -> str | None:
    if "." in key:
        return key if key in SCHEMA else None
    found = [k for k in SCHEMA if k.split(".")[1] == key]
    return found[0] if len(found) == 1 else None


def test_defaults_the_docs_state_are_the_codes():
    wrong, seen = [], 0
    for name, text in _docs():
        for key, quoted, bare in _DEFAULT.findall(text):
            key, said = _qualified(key), quoted or bare
            if key is None or SCHEMA[key] == "(renamed)":
                continue
            seen += 1
            value = SCHEMA[key]
            if _said(said, not quoted) != (list(value) if isinstance(value, tuple) else value):
                wrong.append(f"{name}: `{key}` said to default to {said!r}; the code's default is {value!r}")
    assert not wrong, "\n".join(wrong)
    assert seen >= 3  # the pattern still finds the docs' statements of defaults


def _path_candidates(span: str) -> str | None:
    token = span.split()[0] if span.split() else ""
    token = re.split(r"::|#", token)[0].rstrip(":,.)")
    token = re.sub(r":\d+(-\d+)?$", "", token)
    if any(c in token for c in "<>*{}$") or not token:
        return None
    if token in TOP_FILES or token.split("/")[0] in TOP_DIRS and "/" in token:
        return token
    return None


def _exists(path: str) -> bool:
    """A file or folder, or a module's attribute (`serve/runners/gqa_split.SPLIT_MAX_WEIGHT_BYTES`, `compress/data`)."""
    module = re.sub(r"\.[A-Za-z_]\w*$", "", path) if not (ROOT / path).exists() else path
    return (ROOT / path).exists() or (ROOT / f"{module}.py").exists()


def test_every_path_the_docs_name_exists():
    deployments = _deployments()
    missing = []
    for name, text in _docs():
        _, spans = _code(text)
        for span in spans:
            path = _path_candidates(span)
            if path and path not in deployments and not _exists(path):
                missing.append(f"{name}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(sorted(set(missing)))


def _anchors(text: str) -> set[str]:
    out, counts = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_link_between_docs_resolves():
    broken = []
    for name, text in _docs():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", _FENCE.sub("", text)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file = (ROOT / name).parent / target if target else ROOT / name
            if not file.exists():
                broken.append(f"{name}: ({target}) does not exist")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{name}: ({target}#{anchor}) has no such heading")
    assert not broken, "\n".join(broken)


def _commands(text: str) -> list[tuple[str, bool]]:
    """(line, whole) for the shell lines that run one of the project's commands: whole for a fenced block's line
    (it must run as written), not for an inline span (a mention such as `compressor serve`: its words must exist)."""
    blocks, spans = _code(text)
    lines = []
    for block in blocks:
        lines += [(line, True) for line in block.replace("\\\n", " ").splitlines()]
    lines += [(span, False) for span in spans]
    out = []
    for line, whole in lines:
        line = re.sub(r"^\$ ", "", line.strip())
        line = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S+ )+", "", line)  # FOO=1 make demo
        if re.match(r"(make |(\.venv/bin/)?compressor |(\.venv/bin/)?python3? -m |prefect deployment run )", line):
            out.append((line, whole))
    return out


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([\w .-]+):(?!=)", text, re.M) for t in line.split()}


def _check_command(line: str, whole: bool, targets: set[str], deployments: set[str]) -> str | None:
    try:
        words = shlex.split(line, comments=True)
    except ValueError as e:
        return f"does not parse as a shell line ({e})"
    ends = [i for i, w in enumerate(words) if w in ("&&", "||", "|", ";", ">", "2>&1", "&")]
    words = words[: ends[0]] if ends else words
    if words[0] == "make":
        bad = [w for w in words[1:] if "=" not in w and not w.startswith("-") and w not in targets]
        return f"make targets {bad} are not in the Makefile" if bad else None
    if words[0].endswith("compressor"):
        from flows.cli import build_parser

        return _argparse(build_parser(), words[1:], whole)
    if words[0] == "prefect":
        name = words[3] if len(words) > 3 else ""
        if name.startswith(("-", "...", "<")) and not whole:
            return None
        return None if name in deployments else f"deployment {name!r} is not in prefect.yaml"
    module = words[2]
    if "<" in module or module.split(".")[0] not in TOP_DIRS:
        return None
    if importlib.util.find_spec(module) is None:
        return f"module {module} does not exist"
    if module == "serve":
        from serve.__main__ import build_parser as serve_parser

        return _argparse(serve_parser(), words[3:], whole)
    return _options_exist(module, words[3:])


def _argparse(parser: argparse.ArgumentParser, args: list[str], whole: bool) -> str | None:
    """A whole command must parse; a mention's subcommand and --options must exist."""
    args = [re.sub(r"<[^>]*>", "X", a) for a in args]
    if not whole:
        subs = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if subs and args and not args[0].startswith("-"):
            if args[0] not in subs:
                return f"no subcommand {args[0]!r}"
            parser, args = subs[args[0]], args[1:]
        bad = [a for a in args if a.startswith("--") and a.split("=")[0] not in parser._option_string_actions]
        return f"options {bad} do not exist" if bad else None
    try:
        parsed = parser.parse_args(args)
    except SystemExit:
        return f"the CLI refuses {args}"
    bad = [s for s in getattr(parsed, "set", []) or [] if s.split("=")[0] not in SCHEMA | {"workdir": 0, "name": 0}]
    return f"--set keys {bad} do not exist" if bad else None


def _options_exist(module: str, args: list[str]) -> str | None:
    """A benchmark's --options appear as strings in its package (its parser or a shared one)."""
    package = ROOT / module.split(".")[0]
    source = "".join(p.read_text() for p in package.rglob("*.py")) if package.is_dir() else ""
    bad = [a.split("=")[0] for a in args if a.startswith("--") and f'"{a.split("=")[0]}"' not in source]
    return f"options {bad} are not in {module}'s sources" if bad else None


def test_every_command_the_docs_show_parses():
    targets = _make_targets()
    deployments = _deployments()
    bad, seen = [], 0
    for name, text in _docs():
        for line, whole in _commands(text):
            seen += 1
            why = _check_command(line, whole, targets, deployments)
            if why:
                bad.append(f"{name}: `{line}`: {why}")
    assert not bad, "commands in the docs that would fail:\n" + "\n".join(bad)
    assert seen >= 20


def _deployments() -> set[str]:
    """prefect.yaml's deployments as `prefect deployment run` names them: <flow name>/<deployment name>."""
    out = set()
    for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]:
        file, func = d["entrypoint"].split(":")
        m = re.search(rf'@flow\((?:[^)]*?)name="([^"]+)"[^)]*\)\s*\ndef {func}\b', (ROOT / file).read_text(), re.S)
        out.add(f"{m.group(1) if m else func.replace('_', '-')}/{d['name']}")
    return out


@pytest.mark.parametrize("gone", ["serve.max_waiting", "configs/large.yaml", "kv-calc"])
def test_a_stale_doc_fails(gone, tmp_path):
    """Each check does fail: a doc naming a key, a path or a command that does not exist is caught."""
    doc = tmp_path / "stale.md"
    bogus = {"serve.max_waiting": "`serve.max_waitin`", "configs/large.yaml": "`configs/larger.yaml`",
             "kv-calc": "\n\n```bash\ncompressor kv-calculator --model x\n```\n"}[gone]
    doc.write_text(f"# A doc\n\nSee {bogus}.\n")
    text = doc.read_text()
    blocks, spans = _code(text)
    if gone == "serve.max_waiting":
        assert _KEY.findall(spans[0]) == [("serve", "max_waitin")] and "serve.max_waitin" not in SCHEMA
    elif gone == "configs/large.yaml":
        assert _path_candidates(spans[0]) == "configs/larger.yaml" and not (ROOT / "configs/larger.yaml").exists()
    else:
        (line, whole), = _commands(text)
        assert whole and _check_command(line, whole, _make_targets(), set()) == "the CLI refuses ['kv-calculator', '--model', 'x']"
