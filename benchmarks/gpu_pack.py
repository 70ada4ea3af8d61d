"""Pack what a lent GPU machine lacks for benchmarks/gpu_serve.py into parts that each fit one device call.

    .venv/bin/python -m benchmarks.gpu_pack            # writes .gpu/p1, .gpu/p2, .gpu/p3 (git-ignored)

The GPU machine has CUDA 13, torch and the CPU onnxruntime, reaches no package registry, and takes at most 64 MiB
of working tree per call, the repository included. What it lacks:

- onnxruntime-gpu's CUDA provider (284 MB; 231 MB zipped). Its .nv_fatbin section holds the kernels for six GPU
  generations (sm_75 ... sm_120, 219 MB); every cubin not built for the target's arch (``--sm``, 90 for the
  H100/H200) is overwritten with zeros in place, so offsets and sizes stay as they were and the CUDA driver, which
  loads the cubin matching the device, never reads the zeros. xz then takes it to ~52 MB: part 1.
- the rest of the onnxruntime package (its Python binding, 31 MB), the wheels of the server's and the SDK's
  pure-Python needs for CPython 3.12, and the first half of SmolLM2-135M-Instruct's GGUF (98 MB): part 2.
- the GGUF's second half: part 3.

Each part is unpacked on the machine by ``python3 -m benchmarks.gpu_serve --unpack .gpu/pN`` into ``.gpu/site`` and
``.gpu/model`` (ignored, so they stay between calls while the machine is held); docs/serving.md#cuda has the
three calls.
"""

from __future__ import annotations

import argparse
import io
import shutil
import lzma
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from loadtest.gpu_parts import keep_one_arch

ORT_WHEEL = "onnxruntime-gpu==1.31.1"
PROVIDER = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
# What the server, the builder and the openai SDK import that the GPU machine's image does not have (its package
# list: python3 there is CPython 3.12 with torch, transformers, numpy, httpx, anyio, jinja2, uvloop, ...).
WHEELS = ["pydantic==2.14.4", "pydantic_core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
          "fastapi==0.150.0", "starlette==1.10.0", "uvicorn==0.55.0", "openai==3.60.0", "jiter==0.19.0",
          "distro==1.9.0", "sniffio==1.3.1", "gguf==0.19.0", "opentelemetry-api==1.45.2", "importlib_metadata==9.1.0",
          "annotated-doc==0.0.7", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5", "idna==3.20",
          "anyio==4.16.0", "h11==0.16.0"]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--no-deps",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
MIB = 2**20
CALL_LIMIT = 64 * MIB  # what one device call may carry, the repository included


def _section(path: Path, name: str) -> tuple[int, int]:
    """(file offset, size) of an ELF section, from readelf."""
    for line in subprocess.check_output(["readelf", "-S", "-W", str(path)], text=True).splitlines():
        if f" {name} " in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{path}: no {name} section")


def _xz(data: bytes) -> bytes:
    return lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)


def pack(out: Path, sm: int, gguf: Path, cache: Path) -> dict[str, int]:
    cache.mkdir(parents=True, exist_ok=True)
    wheel = next(cache.glob("onnxruntime_gpu-*.whl"), None)
    if wheel is None:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(cache), ORT_WHEEL])
        wheel = next(cache.glob("onnxruntime_gpu-*.whl"))
    parts = {n: out / f"p{n}" for n in (1, 2, 3)}
    for p in parts.values():
        p.mkdir(parents=True, exist_ok=True)
        for f in p.iterdir():
            f.unlink() if f.is_file() else None
    with zipfile.ZipFile(wheel) as z:
        provider = cache / "provider.so"
        provider.write_bytes(z.read(PROVIDER))
        packed = cache / f"provider_sm{sm}.so.xz"  # minutes of xz: made once per wheel and arch
        if not packed.exists():
            off, size = _section(provider, ".nv_fatbin")
            data = bytearray(provider.read_bytes())
            zeroed, kept = keep_one_arch(data, off, size, sm)
            print(f"CUDA provider: cubins for sm_{sm} kept ({kept / 1e6:.1f} MB), others zeroed ({zeroed / 1e6:.1f} MB)")
            packed.write_bytes(_xz(bytes(data)))
        shutil.copy2(packed, parts[1] / "provider.so.xz")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for info in z.infolist():
                name = info.filename
                skip = name == PROVIDER or "providers_tensorrt" in name or "libonnxruntime.so" in name
                if skip or info.is_dir() or not name.startswith("onnxruntime/"):
                    continue  # libonnxruntime.so is the C API's library: the Python binding does not load it
                t = tarfile.TarInfo(name)
                t.size, t.mode = info.file_size, 0o755 if name.endswith(".so") else 0o644
                tar.addfile(t, io.BytesIO(z.read(info)))
        (parts[2] / "onnxruntime.tar.xz").write_bytes(_xz(buf.getvalue()))
    wheels = parts[2] / "wheels"
    wheels.mkdir(exist_ok=True)
    subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(wheels), *WHEELS])
    blob = gguf.read_bytes()
    room = CALL_LIMIT - _repo_bytes() - _bytes(parts[2]) - 2 * MIB
    (parts[2] / "model.gguf.0").write_bytes(blob[:room])
    (parts[3] / "model.gguf.1").write_bytes(blob[room:])
    sizes = {f"p{n}": _bytes(p) for n, p in parts.items()}
    for name, b in sizes.items():
        total = b + _repo_bytes()
        print(f"{name}: {b / MIB:.1f} MiB (+ repository = {total / MIB:.1f} MiB of {CALL_LIMIT / MIB:.0f})")
        if total > CALL_LIMIT:
            raise SystemExit(f"{name} does not fit one device call")
    return sizes


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _repo_bytes() -> int:
    """What travels with every call besides the carried part: tracked and untracked-not-ignored files."""
    names = subprocess.check_output(["git", "ls-files", "-co", "--exclude-standard", "-z"], text=True).split("\0")
    return sum(Path(n).stat().st_size for n in names if n and Path(n).is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_pack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".gpu", help="where the parts go (default %(default)s, git-ignored)")
    p.add_argument("--sm", type=int, default=90, help="the GPU's SM arch whose kernels are kept (90: H100/H200)")
    p.add_argument("--gguf", default=None, help="the model's GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cache", default=".cache/gpu_pack", help="where the downloaded wheel is kept")
    a = p.parse_args(argv)
    from compress.loading.models import embedded_gguf_path

    pack(Path(a.out), a.sm, Path(a.gguf) if a.gguf else embedded_gguf_path(), Path(a.cache))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
