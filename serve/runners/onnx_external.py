"""ONNX models past protobuf's 2 GB limit: graphs whose weights stay on disk until one tensor is needed.

A 1B-parameter decoder is 4.3 GB of fp32 weights; protobuf cannot serialize a message over 2 GB, and
holding a whole model as a ``ModelProto`` (plus a copy per rewrite, plus the bytes handed to ONNX Runtime)
is what took the quantize stage of a 1B model to 17 GB. So large graphs are handled *lazily*:

* ``load_lazy(path)`` reads the graph without its external data (a few MB); each external initializer
  remembers the folder its ``location`` is relative to (our own ``external_data`` key ``BASE_KEY``, which
  is stripped before the graph goes to ONNX Runtime or to disk);
* ``tensor_array(t)`` reads one initializer, from the proto or from its file (a memory map);
* ``save_external(model, path)`` writes ``path`` + ``path.data`` tensor by tensor, copying data that is
  still on disk file to file, without mutating the model and without a second copy of it in memory;
* ``session_path(model)`` is how ``serve.runners.onnx_session.make_session`` hands such a graph to ONNX Runtime:
  a small ``.onnx`` next to the data it points at, deleted once the session is made.

Torch-free and compress-free like everything in serve/ (docs/architecture.md); compress/ uses it for the
export, calibration and quantization of large models.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

# Our own external_data key: the absolute folder a tensor's "location" is relative to. Never written to disk.
BASE_KEY = "compress.base_dir"
# Above this many bytes of tensors held in the proto, a graph is written with external data (protobuf: 2 GiB).
INLINE_LIMIT = 1_500_000_000
ALIGN = 4096  # data offsets on page boundaries, so onnxruntime can memory-map them


def _ext(t) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def is_external(t) -> bool:
    from onnx import TensorProto

    return t.data_location == TensorProto.EXTERNAL


def tensor_nbytes(t) -> int:
    """Bytes of one initializer's data, without reading it."""
    from onnx import helper

    if is_external(t):
        info = _ext(t)
        if "length" in info:
            return int(info["length"])
    n = int(np.prod(t.dims)) if len(t.dims) else 1
    return n * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def external_file(t) -> Path:
    """The file an external initializer's data lives in (needs the BASE_KEY that load_lazy records)."""
    info = _ext(t)
    if BASE_KEY not in info:
        raise ValueError(f"initializer {t.name!r} has external data but no known folder; load it with load_lazy")
    return Path(info[BASE_KEY]) / info["location"]


def tensor_array(t) -> np.ndarray:
    """One initializer as a numpy array: from the proto, or read from its external file (only this tensor)."""
    from onnx import helper, numpy_helper

    if not is_external(t):
        return numpy_helper.to_array(t)
    info = _ext(t)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else tensor_nbytes(t)
    with open(external_file(t), "rb") as f:
        f.seek(offset)
        buf = f.read(length)
    return np.frombuffer(buf, dtype=dtype).reshape(tuple(t.dims)).copy()


def load_lazy(path: str | Path):
    """The graph at ``path`` without its external data; every external tensor knows its folder (BASE_KEY)."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    base = str(path.resolve().parent)
    for t in model.graph.initializer:
        if is_external(t) and BASE_KEY not in _ext(t):
            e = t.external_data.add()
            e.key, e.value = BASE_KEY, base
    return model


def inline_bytes(model) -> int:
    """Bytes of tensor data held inside the proto (not on disk)."""
    return sum(tensor_nbytes(t) for t in model.graph.initializer if not is_external(t))


def has_external(model) -> bool:
    return any(is_external(t) for t in model.graph.initializer)


def _header_copy(model):
    """A new ModelProto with everything of ``model`` but the initializers."""
    import onnx

    out = onnx.ModelProto()
    out.ir_version = model.ir_version
    out.opset_import.extend(model.opset_import)
    for f in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(out, f, getattr(model, f))
    out.metadata_props.extend(model.metadata_props)
    out.functions.extend(model.functions)
    g, src = out.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    return out


def _set_external(t, location: str, offset: int, length: int) -> None:
    from onnx import TensorProto

    t.ClearField("external_data")
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    t.data_location = TensorProto.EXTERNAL


def _copy_range(src: Path, offset: int, length: int, dst, chunk: int = 64 << 20) -> None:
    with open(src, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            b = f.read(min(chunk, left))
            if not b:
                raise OSError(f"{src}: ends before offset {offset} + {length}")
            dst.write(b)
            left -= len(b)


def save_external(model, path: str | Path, inline_limit: int = INLINE_LIMIT, force_external: bool = False) -> Path:
    """Write ``model`` to ``path``, with its weights in ``path.name + '.data'`` when they are large or on disk.

    Never mutates ``model`` and never builds a second copy of its weights: each tensor is written, then
    the next. Tensors already in the destination data file (a graph built straight into it) stay where they
    are; tensors in another file are copied file to file. A graph whose data is all in the proto and under
    ``inline_limit`` bytes is written as one file, as ``onnx.save`` would.
    """
    import onnx
    from onnx import numpy_helper

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = path.name + ".data"
    data_path = path.with_name(data_name)
    external = force_external or has_external(model) or inline_bytes(model) > inline_limit
    if not external:
        onnx.save_model(model, str(path))
        with contextlib.suppress(FileNotFoundError):
            data_path.unlink()  # a stale data file of an earlier, larger graph
        return path
    out = _header_copy(model)
    resolved = data_path.resolve()
    keep_existing = any(is_external(t) and external_file(t).resolve() == resolved for t in model.graph.initializer)
    with open(data_path, "ab" if keep_existing else "wb") as f:
        for t in model.graph.initializer:
            nt = out.graph.initializer.add()
            if is_external(t) and external_file(t).resolve() == resolved:
                nt.CopyFrom(t)
                info = _ext(t)
                _set_external(nt, data_name, int(info.get("offset", 0)), tensor_nbytes(t))
                continue
            nt.name = t.name
            nt.dims.extend(t.dims)
            nt.data_type = t.data_type
            nbytes = tensor_nbytes(t)
            if not is_external(t) and nbytes < 1024:
                nt.CopyFrom(t)  # scalars and shapes stay in the proto (as onnx.save does)
                continue
            pos = f.seek(0, os.SEEK_END)
            pad = (-pos) % ALIGN
            if pad:
                f.write(b"\0" * pad)
                pos += pad
            if is_external(t):
                info = _ext(t)
                _copy_range(external_file(t), int(info.get("offset", 0)), nbytes, f)
            else:
                f.write(t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes())
            _set_external(nt, data_name, pos, nbytes)
    onnx.save_model(out, str(path))
    return path


def _common_base(model) -> Path | None:
    bases = {external_file(t).parent for t in model.graph.initializer if is_external(t)}
    if len(bases) > 1:
        return None
    return next(iter(bases), None)


@contextlib.contextmanager
def session_path(model) -> Iterator[Path]:
    """A file ONNX Runtime can open for an in-memory graph too large to hand over as bytes.

    The small graph is written into the folder of the data it points at (ONNX Runtime resolves external
    data relative to the model file and refuses absolute or escaping locations); tensors held in memory go
    to a temporary data file beside it when they are many. Both files are removed on exit, once the session
    holds the weights.
    """
    import tempfile

    base = _common_base(model)
    tmpdir = None
    if base is None:  # all in memory, or on disk in several folders (then copied into one)
        tmpdir = tempfile.mkdtemp(prefix="ort_session_")
        base = Path(tmpdir)
    spill = inline_bytes(model) > INLINE_LIMIT
    stem = f".session-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = base / f"{stem}.onnx"
    extra = base / f"{stem}.onnx.data"
    try:
        out = _header_copy(model)
        with open(extra, "wb") as f:
            for t in model.graph.initializer:
                nt = out.graph.initializer.add()
                if is_external(t) and external_file(t).parent == base:
                    nt.CopyFrom(t)
                    info = _ext(t)
                    _set_external(nt, info["location"], int(info.get("offset", 0)), tensor_nbytes(t))
                elif is_external(t) or (spill and tensor_nbytes(t) >= 1024):
                    _append_aligned(f, t, nt, extra.name)
                else:
                    nt.CopyFrom(t)
        import onnx

        onnx.save_model(out, str(path))
        del out
        yield path
    finally:
        for p in (path, extra):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        if tmpdir:
            import shutil

            shutil.rmtree(tmpdir, ignore_errors=True)


def _append_aligned(f, t, nt, location: str) -> None:
    """``t``'s name, shape and type onto ``nt``, its bytes (from its external file or from memory) at the next
    ALIGN-ed offset of the open file ``f``, and ``nt`` pointed there as ``location``."""
    nt.name = t.name
    nt.dims.extend(t.dims)
    nt.data_type = t.data_type
    pos = f.seek(0, os.SEEK_END)
    pad = (-pos) % ALIGN
    f.write(b"\0" * pad)
    pos += pad
    if is_external(t):
        info = _ext(t)
        _copy_range(external_file(t), int(info.get("offset", 0)), tensor_nbytes(t), f)
    else:
        f.write(t.raw_data if t.HasField("raw_data") else tensor_array(t).tobytes())
    _set_external(nt, location, pos, tensor_nbytes(t))


def needs_file(model) -> bool:
    """True when ONNX Runtime cannot take ``model`` as serialized bytes: weights on disk, or too many in memory."""
    return has_external(model) or inline_bytes(model) > INLINE_LIMIT


def spill(model, folder: str | Path, min_bytes: int = 1024):
    """A copy of ``model`` whose in-memory tensors (``min_bytes`` and more) live in a new file under ``folder``.

    Returns a new, lazy ModelProto; drop the old one to free its memory (a protobuf message keeps the memory of
    cleared fields until it is freed itself, so the copy is the way to give it back). Used after SmoothQuant
    has rewritten every linear's weights in memory.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"spill-{uuid.uuid4().hex[:8]}.data"
    out = _header_copy(model)
    with open(data, "wb") as f:
        for t in model.graph.initializer:
            nt = out.graph.initializer.add()
            if is_external(t) or tensor_nbytes(t) < min_bytes:
                nt.CopyFrom(t)
                continue
            _append_aligned(f, t, nt, data.name)
            e = nt.external_data.add()
            e.key, e.value = BASE_KEY, str(folder.resolve())
    return out
