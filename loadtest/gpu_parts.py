"""The GPU window's parts (benchmarks/gpu_pack.py packs them here, benchmarks/gpu_serve.py unpacks them on the lent
machine): a CUDA provider's fatbins pruned to one GPU arch, and each part put back in place.

A fatbin container (magic ``FATBIN_MAGIC``) holds entries, each a cubin (``ELF_CUBIN``) or PTX for one SM arch; the
CUDA driver loads the cubin that matches the device, so zeroing the others in place keeps every offset and size and
lets xz take the library from 284 MB to ~52 MB.
"""

from __future__ import annotations

import lzma
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
ELF_CUBIN = 2


def keep_one_arch(data: bytearray, start: int, size: int, sm: int) -> tuple[int, int]:
    """Zero, in place, every cubin in the fatbin containers of data[start:start + size] not built for ``sm``;
    PTX entries stay. Returns (bytes zeroed, bytes kept)."""
    pos, end_sec, zeroed, kept = start, start + size, 0, 0
    while pos + 16 <= end_sec:
        magic, _, header, fat = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned
            continue
        e, end = pos + header, pos + header + fat
        while e < end:
            kind, _, eh, payload = struct.unpack_from("<HHIQ", data, e)
            arch = struct.unpack_from("<I", data, e + 28)[0]
            if kind == ELF_CUBIN and arch != sm:
                data[e + eh:e + eh + payload] = bytes(payload)
                zeroed += payload
            else:
                kept += payload
            e += eh + payload
        pos = end
    return zeroed, kept


def unpack(part: Path, site: Path, model: Path) -> list[str]:
    """Unpack one part of benchmarks/gpu_pack.py: the CUDA provider, the onnxruntime package and the wheels into
    ``site``, the model's pieces beside ``model``, joined into it once both are there. Returns what it wrote."""
    site.mkdir(parents=True, exist_ok=True)
    model.parent.mkdir(parents=True, exist_ok=True)
    done = []
    provider = part / "provider.so.xz"
    if provider.exists():
        dest = site / "onnxruntime" / "capi" / "libonnxruntime_providers_cuda.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        with lzma.open(provider) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 16 << 20)
        done.append(str(dest))
    ort = part / "onnxruntime.tar.xz"
    if ort.exists():
        with tarfile.open(ort, "r:xz") as tar:
            tar.extractall(site)
        done.append("onnxruntime package")
    wheels = sorted((part / "wheels").glob("*.whl")) if (part / "wheels").exists() else []
    if wheels:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                               "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                               *map(str, wheels)])
        done.append(f"{len(wheels)} wheels")
    for piece in sorted(part.glob("model.gguf.*")):
        with open(model.with_suffix(f".gguf.{piece.suffix[1:]}"), "wb") as out:
            shutil.copyfileobj(open(piece, "rb"), out, 16 << 20)
        done.append(piece.name)
    pieces = sorted(model.parent.glob("model.gguf.*"))
    if len(pieces) == 2 and not model.exists():
        with open(model, "wb") as out:
            for p in pieces:
                shutil.copyfileobj(open(p, "rb"), out, 16 << 20)
        done.append(f"{model} ({model.stat().st_size / 2**20:.1f} MiB)")
    return done
