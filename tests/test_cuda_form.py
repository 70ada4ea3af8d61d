"""The CUDA form (fp16 weights, activations and K/V: compress/quantize/cuda_fp16.py) and the device K/V store
(serve/kv/device.py), both run here on the CPU EP: the form's logits against the fp32 graph's, and the engine with
its pool and rows in torch tensors against the same engine with numpy arrays, token for token."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from compress.artifact import read_manifest
from compress.config import ServeConfig
from compress.quantize.cuda_fp16 import CudaFormError, to_fp16, write_fp16_artifact
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.kv.device import HostKv, TorchKv, kv_store
from serve.runners.onnx_session import CPU, CUDA

from tests.test_gqa import prompts


@pytest.fixture(scope="module")
def fp16_artifact(tiny_gqa, tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda_form") / "fp16"
    write_fp16_artifact(tiny_gqa, out)
    return out


def _greedy(art, reqs, **cfg):
    eng = Engine(art, ServeConfig(providers=[CPU], **cfg), start=False)
    handles = [eng.add_request(p, SamplingParams.greedy(n, ignore_eos=True)) for p, n in reqs]
    eng.run_until_done()
    eng.block_manager.check_invariants()
    return eng, [h.result().output_ids for h in handles]


def test_fp16_form_is_fp16_throughout(fp16_artifact):
    manifest = read_manifest(fp16_artifact)
    assert manifest["kv_dtype"] == "float16" and manifest["quantization"]["target"] == "cuda"
    m = onnx.load(str(fp16_artifact / "model.onnx"))
    floats = {t.name for t in m.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    assert floats == set()
    kinds = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.input, *m.graph.output]}
    assert kinds["past_key_values.0.key"] == kinds["present.0.value"] == onnx.TensorProto.FLOAT16
    assert kinds["logits"] == onnx.TensorProto.FLOAT  # the engine samples fp32 logits on either device


def test_fp16_form_tracks_the_fp32_graph(tiny_gqa, fp16_artifact):
    reqs = [(p, 12) for p in prompts(6, 3, 24, seed=3)]
    _, want = _greedy(tiny_gqa, reqs)
    _, got = _greedy(fp16_artifact, reqs)
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) / sum(len(w) for w in want)
    assert same >= 0.9, same


def test_device_store_equals_host_store(fp16_artifact):
    """The pool and rows as torch tensors (the CUDA path's code) give the numpy runner's tokens exactly, through
    prefix hits, evictions, preemptions and refills (a 12-block pool, 3 rows, 10 requests)."""
    shared = prompts(1, 9, 9, seed=5)[0]
    reqs = [(shared + p, 14) for p in prompts(10, 2, 16, seed=7)]
    cfg = dict(num_blocks=16, kv_block_size=4, max_batch_size=3, max_num_batched_tokens=16, prefill_chunk=0)
    host, want = _greedy(fp16_artifact, reqs, **cfg)
    dev, got = _greedy(fp16_artifact, reqs, kv_store="torch", **cfg)
    assert isinstance(host.runner.store, HostKv) and not isinstance(host.runner.store, TorchKv)
    assert isinstance(dev.runner.store, TorchKv)
    assert got == want
    assert dev.stats().preemptions > 0 and dev.runner.gathered_tokens > 0
    assert dev.block_manager.prefix_hits > 0


def test_store_choice():
    assert isinstance(kv_store("auto", CPU, np.float16), HostKv)
    assert not isinstance(kv_store("auto", CPU, np.float16), TorchKv)
    assert not isinstance(kv_store("auto", CUDA, np.float32), TorchKv)  # fp32 cache: ORT's CPU GQA reads it
    assert isinstance(kv_store("torch", CPU, np.float32), TorchKv)
    with pytest.raises(ValueError, match="kv store 'gpu'"):
        kv_store("gpu", CPU, np.float16)


def test_fp16_form_refuses_what_it_cannot_convert(tiny_artifact, tmp_path):
    with pytest.raises(CudaFormError, match="gqa"):
        write_fp16_artifact(tiny_artifact, tmp_path / "x")
    m = onnx.load(str(tiny_artifact / "model.onnx"))
    with pytest.raises(CudaFormError, match="gqa graph"):
        to_fp16(m)


def test_quantize_target_cuda_needs_the_fp32_graph():
    from compress.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="quantize.target cuda"):
        load_config("configs/tiny.yaml", ["prune.enabled=false", "distill.enabled=false", "export.weights=int8",
                                          "quantize.target=cuda"])


def test_pipeline_builds_and_gates_the_cuda_form(prefect_harness, mlflow_store, tmp_path_factory):
    """quantize.target cuda through the real flow: the quantize stage writes the fp16 form, the accept stage gates it
    on the CPU EP, and the registered candidate is the fp16 artifact."""
    from flows.pipeline import compress_flow

    work = tmp_path_factory.mktemp("work_cuda")
    out = compress_flow(config="configs/tiny.yaml", overrides=[
        "prune.enabled=false", "distill.enabled=false", "export.exporter=gqa", "quantize.target=cuda",
        "accept.relax_trials=0", "benchmark.enabled=false", "registry.model_name=tiny-cuda",
        "mlflow.experiment=tiny-cuda", f"workdir={work}"])
    assert out["verdict"]["accepted"], out["verdict"]["reasons"]
    cand = read_manifest(out["candidate_artifact"])
    assert cand["quantization"]["method"] == "fp16" and cand["kv_dtype"] == "float16"
    assert out["verdict"]["candidate"]["top1_agreement"] >= 0.9


def test_the_cuda_docs_name_keys_commands_and_paths_that_exist():
    import re
    import subprocess
    import sys
    from pathlib import Path

    from compress.config import PipelineConfig
    from serve.api.metrics import GPU_GAUGES

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs/serving.md").read_text()
    section = text[text.index("## CUDA"):text.index("## Speculative decoding")]
    names = set(re.findall(r"`([^`\s]+)`", section))
    for key in ("quantize.target", "serve.kv_store", "serve.kv_memory_mb", "serve.providers"):
        assert key in section
        part, field = key.split(".")
        assert field in type(getattr(PipelineConfig(), part)).model_fields, key
    for path in [n for n in names if "/" in n and n.endswith((".py", ".json"))]:
        assert (root / path).exists() or list(root.glob(path.replace("...", "*"))), path
    for gauge in [n for n in names if n.startswith("compressor:gpu")]:
        assert gauge.split(":")[1] in GPU_GAUGES, gauge
    for command in ("benchmarks.gpu_serve --pack", "benchmarks.gpu_serve --unpack"):
        assert f"-m {command}" in section
        r = subprocess.run([sys.executable, "-m", *command.split()[:-1], "--help"], cwd=root, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
    flags = set(re.findall(r"--[a-z][a-z-]+", section))
    help_text = subprocess.run([sys.executable, "-m", "benchmarks.gpu_serve", "--help"], cwd=root,
                               capture_output=True, text=True).stdout
    assert {f for f in flags if f not in help_text} <= {"--config", "--set", "--model"}, flags


def test_torch_store_refuses_an_int8_cache():
    with pytest.raises(ValueError, match="serve.kv_store torch holds float16 or float32"):
        kv_store("torch", CPU, np.int8)
