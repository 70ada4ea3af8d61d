"""The one place an onnxruntime InferenceSession is made, and the decoder graph's I/O names.

Used by the server's runners (serve/runners/standard*.py), by compress/ (the offline language-model drivers in
compress/drivers/, evaluation, calibration, quantization sensitivity) and by loadtest's baselines.
Torch-free and compress-free, as everything in serve/ (docs/architecture.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def choose_providers(requested: Sequence[str]) -> list[str]:
    """Requested providers this onnxruntime build has; CPU always last as the fallback."""
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    chosen = [p for p in requested if p in available and p != CPU]
    missing = [p for p in requested if p not in available]
    if missing:
        log.info("execution providers not in this onnxruntime build, skipped: %s", ", ".join(missing))
    return [*chosen, CPU]


SPINNING = ("off", "during_runs", "always")


def session_options(threads: int | None, optimize: bool, log_severity: int | None, spinning: str):
    """onnxruntime SessionOptions for make_session's arguments (see there)."""
    import onnxruntime as ort

    if spinning not in SPINNING:
        raise ValueError(f"spinning {spinning!r}: one of {', '.join(SPINNING)}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    if threads and threads > 0:
        opts.intra_op_num_threads = threads
    if log_severity is not None:
        opts.log_severity_level = log_severity
    if spinning == "off":
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif spinning == "during_runs":
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    return opts


def make_session(model, providers: Sequence[str] = (CPU,), threads: int | None = 0, optimize: bool = True,
                 log_severity: int | None = None, spinning: str = "always"):
    """An InferenceSession on the first requested provider that actually works, else CPU.

    model: a path, the serialized bytes, or an in-memory ``onnx.ModelProto`` (anything with
    ``SerializeToString``; handing ORT the bytes once is how compress/ runs graphs it has not saved; a graph
    whose weights are on disk or over 1.5 GB goes through a temporary file instead, serve/runners/onnx_external.py).
    providers: e.g. ``(CUDA, CPU)`` for the server; the default, CPU only, is what compress/ measures on.
    threads: intra-op threads (0 or None: onnxruntime's default). optimize: ORT_ENABLE_ALL, else
    ORT_DISABLE_ALL. log_severity: the session's log level (3 = errors only), None = onnxruntime's default.
    spinning: how onnxruntime's intra-op threads wait for work (SPINNING): "always" (its default) busy-waits,
    also after a run ends; "during_runs" busy-waits between the ops of a run and sleeps once it ends, so the
    cores go to the HTTP event loop between steps (the server's default, docs/serving.md); "off" never spins.

    onnxruntime-gpu lists CUDA as available even without a GPU or CUDA libraries, then
    falls back to CPU at session creation; we check which provider the session really got.
    """
    import onnxruntime as ort

    opts = session_options(threads, optimize, log_severity, spinning)
    if hasattr(model, "SerializeToString"):
        from serve.runners.onnx_external import needs_file, session_path

        if needs_file(model):
            # Weights on disk (a lazily loaded graph) or more than protobuf can serialize (2 GB): through a
            # file written beside the data, never one string of the whole model (serve/runners/onnx_external.py).
            with session_path(model) as path:
                return make_session(str(path), providers, threads, optimize, log_severity, spinning)
        src = model.SerializeToString()
    elif isinstance(model, (bytes, bytearray)):
        src = bytes(model)
    else:
        src = str(model)
    chosen = choose_providers(providers)
    sess = None
    if chosen != [CPU]:
        prev = ort.get_default_logger_severity() if hasattr(ort, "get_default_logger_severity") else 2
        ort.set_default_logger_severity(4)  # the failed CUDA load would log errors; we log our own line
        try:
            sess = ort.InferenceSession(src, sess_options=opts, providers=chosen)
        except Exception as e:  # noqa: BLE001 - any provider failure means: fall back
            log.warning("session with %s failed (%s: %s); falling back to CPU", chosen, type(e).__name__, e)
            sess = None
        finally:
            ort.set_default_logger_severity(prev)
        if sess is not None and sess.get_providers()[0] == CPU:
            log.warning("%s requested but unusable here (no GPU or CUDA/cuDNN libraries); running on CPU",
                        ", ".join(chosen[:-1]))
    if sess is None:
        sess = ort.InferenceSession(src, sess_options=opts, providers=[CPU])
    log.info("onnxruntime session on %s (onnxruntime %s)", sess.get_providers()[0], ort.__version__)
    return sess


def artifact_session(artifact_dir: str | Path, manifest: dict, providers: Sequence[str] = (CPU,),
                     threads: int | None = 0, *, hidden: bool = False, **kw):
    """make_session on the artifact's graph file (``manifest["onnx_file"]``, default model.onnx); with ``hidden``
    the graph also outputs its last hidden state (serve/runners/hidden.py)."""
    path = Path(artifact_dir) / manifest.get("onnx_file", "model.onnx")
    if hidden:
        from serve.runners.hidden import with_hidden_output

        return make_session(with_hidden_output(path), providers, threads, **kw)
    return make_session(path, providers, threads, **kw)


def kv_io_names(manifest: dict) -> tuple[list[str], list[str]]:
    """The graph's past K/V inputs (``past_key_values.N.key/value``) and present outputs (``present.N.*``),
    in the manifest's order (layer 0 K, layer 0 V, layer 1 K, ...); raises ValueError unless both list
    K and V for every layer."""
    io = manifest.get("io") or {}
    past = [n for n in io.get("inputs", []) if n.startswith("past_key_values.")]
    present = [n for n in io.get("outputs", []) if n.startswith("present.")]
    if len(past) != 2 * int(manifest["num_layers"]) or len(present) != len(past):
        raise ValueError("manifest io names do not list past/present K and V for every layer")
    return past, present
