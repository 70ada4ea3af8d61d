"""docs/configuration.md, generated from the config schema: every key, its type, default and what it does.

Types, bounds and defaults come from the pydantic models; "what it does" is the comment block written above each
field in the sections' settings modules (compress/<stage>/settings.py) and serve/config.py (a section's docstring
introduces its table). A key without a comment is an error here, so the reference cannot leave a key out. `python -m compress.config_reference` rewrites the file;
tests/test_docs.py fails when it is not current.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from compress.config import PipelineConfig, project_root
from serve.config import RENAMED_KEYS

DOC = Path("docs/configuration.md")
_FIELD = re.compile(r"^    (\w+)\s*:")

HEADER = """# Configuration reference

Generated from the schema (`python -m compress.config_reference`; tests/test_docs.py fails when it is stale), so
every key is here with its code default. A config file names only what differs from these: `configs/default.yaml`
is the demo's. Unknown keys are errors that name the key; `--set section.key=value` overrides one on the command
line; `compressor config show --config FILE` prints the resolved config.
"""


class MissingDescription(ValueError):
    """A config field without a comment above it: the reference would list it without saying what it does."""


def field_comments(cls: type[BaseModel]) -> dict[str, str]:
    """Each field's comment block (the `#` lines directly above it), joined into one paragraph."""
    out: dict[str, str] = {}
    block: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            block.append(text.lstrip("#").strip())
            continue
        m = _FIELD.match(line)
        if m and block:
            out[m.group(1)] = " ".join(block)
        block = []
    return out


def type_text(annotation, metadata: list) -> str:
    """A field's type as a reader writes it in YAML: `auto | float32`, `float >= 0 or null`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) if not isinstance(a, str) else a for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a, []) for a in typing.get_args(annotation) if a is not type(None)]
        none = type(None) in typing.get_args(annotation)
        return " or ".join(parts) + (" or null" if none else "") + _bounds(metadata)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        return type_text(base, list(meta))
    if origin in (list, tuple, dict):
        args = [type_text(a, []) for a in typing.get_args(annotation) if a is not Ellipsis]
        name = {list: "list", tuple: "pair", dict: "mapping"}[origin]
        return f"{name} of {', '.join(dict.fromkeys(args))}" if args else name
    return getattr(annotation, "__name__", str(annotation)) + _bounds(metadata)


def _bounds(metadata: list) -> str:
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    found = []
    for m in metadata:
        for attr, sign in signs.items():
            if isinstance(m, annotated_types.BaseMetadata) and hasattr(m, attr):
                found.append(f"{sign} {getattr(m, attr)}")
        if isinstance(m, annotated_types.Len) and m.min_length:
            found.append(f"at least {m.min_length} item(s)")
    return f" ({', '.join(found)})" if found else ""


def default_text(field) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "(required)"
    if isinstance(value, BaseModel):
        return "(section)"
    text = json.dumps(value, default=str)
    return f"`{text}`" if len(text) <= 64 else f"`{text[:60]}...`"


def rows(cls: type[BaseModel], prefix: str) -> list[str]:
    comments = field_comments(cls)
    out = []
    for name, field in cls.model_fields.items():
        if _is_section(field.annotation):
            continue
        key = prefix + name
        if name not in comments:
            raise MissingDescription(f"{key} has no comment above it in {inspect.getsourcefile(cls)}; write one "
                                     f"line saying what it does (the configuration reference is made from it)")
        what = comments[name].replace("|", "\\|").replace("<", "&lt;")
        out.append(f"| `{key}` | {type_text(field.annotation, field.metadata)} | {default_text(field)} | {what} |")
    return out


def _is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def render() -> str:
    parts = [HEADER]
    table_head = ["| key | type | default | what it does |", "|---|---|---|---|"]
    parts += ["## Top level", "", *table_head, *rows(PipelineConfig, ""), ""]
    for name, field in PipelineConfig.model_fields.items():
        if not _is_section(field.annotation):
            continue
        cls = field.annotation
        parts += [f"## {name}", ""]
        intro = inspect.getdoc(cls)
        if intro and intro != inspect.getdoc(cls.__mro__[1]):
            parts += [" ".join(intro.split("\n\n")[0].split()), ""]
        parts += [*table_head, *rows(cls, f"{name}."), ""]
    parts += ["## Renamed keys", "", "The old names still work, with a warning naming the new one.", "",
              "| old | new |", "|---|---|"]
    parts += [f"| `{sec}.{old}` | `{sec}.{new}` |" for (sec, old), new in RENAMED_KEYS.items()]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write docs/configuration.md from the config schema.")
    p.add_argument("--check", action="store_true", help="exit 1 if the file is not current, writing nothing")
    args = p.parse_args(argv)
    path = project_root() / DOC
    text = render()
    if args.check:
        current = path.is_file() and path.read_text() == text
        print(f"{DOC} is {'current' if current else 'stale: run python -m compress.config_reference'}")
        return 0 if current else 1
    path.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
