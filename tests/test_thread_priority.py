"""The model's threads (engine step loop, onnxruntime's intra-op pool) run nicer than the HTTP event loop."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from serve.config import ServeConfig
from serve.engine import thread_priority as tp
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.runners.onnx_session import CPU

pytestmark = pytest.mark.skipif(not tp.supported(), reason="per-thread nice values are a Linux feature")


def _nice_by_tid() -> dict[int, int]:
    """Every thread of this process and its nice value (/proc/self/task/<tid>/stat, field 19)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(task.name)] = int(fields[16])
    return out


def test_threads_started_in_a_lowered_thread_inherit_its_nice_value_and_the_caller_keeps_its_own():
    base = tp.thread_nice()
    seen = {}

    def start_a_thread() -> str:
        t = threading.Thread(target=lambda: seen.update(child=tp.thread_nice()))
        t.start()
        t.join()
        seen["maker"] = tp.thread_nice()
        return "made"

    assert tp.call_in_lowered_thread(start_a_thread, 3) == "made"
    assert seen == {"maker": min(19, base + 3), "child": min(19, base + 3)}
    assert tp.thread_nice() == base


def test_an_error_in_the_lowered_thread_reaches_the_caller():
    with pytest.raises(ValueError, match="bad model"):
        tp.call_in_lowered_thread(lambda: (_ for _ in ()).throw(ValueError("bad model")), 2)


def test_the_engine_runs_its_step_loop_and_onnxruntime_pool_nicer_and_leaves_other_threads_alone(tiny_artifact):
    base = tp.thread_nice()
    before = set(_nice_by_tid())
    eng = Engine(tiny_artifact, ServeConfig(providers=[CPU], intra_op_threads=2, model_thread_nice=4,
                                            enable_prefix_caching=False, result_cache_size=0), start=True)
    try:
        eng.generate([5, 6, 7], SamplingParams(max_tokens=2))  # the step loop has run (and lowered itself)
        new = {tid: n for tid, n in _nice_by_tid().items() if tid not in before}
        step_tid = eng._thread.native_id
        assert new.get(step_tid) == min(19, base + 4)
        # intra_op_threads=2: onnxruntime starts one pool thread besides the caller; it inherited the value.
        pool = {tid: n for tid, n in new.items() if tid != step_tid}
        assert pool and all(n == min(19, base + 4) for n in pool.values()), pool
        assert tp.thread_nice() == base  # the thread that built the engine (here: the test's) is not lowered
    finally:
        eng.shutdown()


def test_model_thread_nice_zero_leaves_every_thread_at_the_callers_priority(tiny_artifact):
    base = tp.thread_nice()
    before = set(_nice_by_tid())
    eng = Engine(tiny_artifact, ServeConfig(providers=[CPU], intra_op_threads=2, model_thread_nice=0,
                                            enable_prefix_caching=False, result_cache_size=0), start=True)
    try:
        new = {tid: n for tid, n in _nice_by_tid().items() if tid not in before}
        assert new and set(new.values()) == {base}
    finally:
        eng.shutdown()


@pytest.mark.parametrize("mode, key, value", [("during_runs", "session.force_spinning_stop", "1"),
                                              ("off", "session.intra_op.allow_spinning", "0")])
def test_ort_spinning_modes_reach_the_session(tiny_artifact, mode, key, value):
    from serve.runners.onnx_session import make_session

    sess = make_session(tiny_artifact / "model.onnx", spinning=mode)
    assert sess.get_session_options().get_session_config_entry(key) == value


def test_ort_spinning_config_takes_the_modes_and_the_old_booleans_and_names_the_choices():
    from serve.runners.onnx_session import make_session

    assert ServeConfig().ort_spinning == "during_runs"
    assert (ServeConfig(ort_spinning=True).ort_spinning, ServeConfig(ort_spinning=False).ort_spinning) == ("always", "off")
    with pytest.raises(Exception, match="during_runs"):
        ServeConfig(ort_spinning="sometimes")
    with pytest.raises(ValueError, match="one of off, during_runs, always"):
        make_session(b"", spinning="sometimes")
