"""Disk room before a stage writes: the bytes it will write against the free bytes where it writes them.

A 7B's fp32 export is 28-30 GB and the registry copies every registered version into the MLflow artifact store, so
a disk that fills halfway through an hour's work is the likely failure of a large run. Each writer states what it
will write (the export and INT8 forms by formula from the model's shape, a registry upload exactly: the folder's
bytes) and ``check_room`` refuses up front, naming both figures, the place and the way out.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from compress.sizing.memory import GIB, Shape

# Room kept free beyond what a stage writes: logs, MLflow's database, the OS's own writes.
SLACK = 512 * 2**20


class DiskSpaceError(OSError):
    """A write that would not fit the disk, with the bytes needed and free, where, and what to do instead."""


def free_bytes(where: str | Path) -> int:
    """Free bytes of the filesystem that holds ``where`` (its nearest existing ancestor, for a folder not made yet)."""
    p = Path(where).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def folder_bytes(folder: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def check_room(what: str, where: str | Path, need: float, fix: str, free: int | None = None) -> float:
    """Raise DiskSpaceError when ``need`` bytes (plus SLACK) are more than the disk at ``where`` has free; returns
    ``need``."""
    have = free_bytes(where) if free is None else free
    if need + SLACK > have:
        raise DiskSpaceError(f"{what} writes about {size_text(need)} under {where} (and keeps {size_text(SLACK)} "
                             f"free beside it) and its disk has {size_text(have)} free ({fix})")
    return need


def size_text(nbytes: float) -> str:
    """Bytes as people read them: GiB from 1 GiB, MiB below (a tiny model's 3 MB is not "0.0 GiB")."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def export_bytes(shape: Shape) -> float:
    """The fp32 graph's weights (4 bytes a parameter; an untied head is in P already)."""
    return 4.0 * shape.params


def int8_bytes(shape: Shape) -> float:
    """One INT8 form: a byte a parameter plus scales and what stays in float (1.465 GB for the 1B shape's 1.236B
    parameters, 1.19 P, as written)."""
    return 1.2 * shape.params


def local_artifact_dir(uri: str) -> Path | None:
    """The local folder an MLflow artifact URI names (file: or a plain path), or None for a remote store."""
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    if uri.startswith("/") or (":" not in uri.split("/")[0]):
        return Path(uri)
    return None
