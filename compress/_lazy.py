"""Lazy entry points for compress/'s subpackages (PEP 562): a package names its stable functions in one table and
imports a module only when one of its names is first used.

So ``from compress.quantize import quantize_artifact`` works, while ``import compress.export.graph_fusion`` (onnx
only) does not drag in torch through ``compress/export/standard.py``; ``import compress.config`` imports none of them.
"""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, list[str]]):
    """(``__getattr__``, ``__dir__``, ``__all__``) for ``package`` from ``{submodule: [names it exports]}``.

    An exported name must not be a submodule's name: importing the submodule would set the package attribute of
    that name to the module and hide the function.
    """
    where = {name: f"{package}.{module}" for module, names in exports.items() for name in names}
    clash = sorted(set(where) & set(exports))
    if clash:
        raise ValueError(f"{package}: exported names equal to submodule names: {clash}")

    def __getattr__(name: str):
        target = where.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(target), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(where)
