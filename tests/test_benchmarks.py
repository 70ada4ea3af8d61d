"""loadtest/: seeded workloads, the HTTP load generator against the real server, benchmark_artifact, KV calculator."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadtest import kv_calc
from loadtest.kv_calc import KVShape, kv_bytes_per_token, kv_memory_bytes, max_concurrency, max_context
from loadtest.workloads import fit_to_context, make_workload, summarize

METRIC_KEYS = {"requests", "requests_ok", "requests_failed", "duration_s", "requests_per_s", "output_tokens",
               "output_tokens_per_s", "prompt_tokens", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
               "itl_p99_s", "tpot_mean_s", "e2e_mean_s", "e2e_p50_s", "e2e_p99_s", "peak_rss_mb", "kv_usage_peak",
               "kv_usage_mean", "server_cpu_s", "output_tokens_per_cpu_s", "concurrency", "result_cache_hits",
               "prefix_cache_hit_rate", "preemptions"}


def small_workload(artifact, n=16, seed=0):
    w = make_workload(n, seed=seed, prompt_words=(8, 48), max_tokens=(4, 16), shared_prefix_words=96)
    return fit_to_context(w, artifact)


# --- workloads -------------------------------------------------------------------------------------------------

def test_workload_is_seeded_and_has_every_kind():
    w = make_workload(32, seed=3)
    assert w == make_workload(32, seed=3)
    assert w != make_workload(32, seed=4)
    s = summarize(w)
    assert (s["mixed"], s["shared_prefix"], s["repeat"]) == (20, 8, 4)
    assert [r["id"] for r in w] == list(range(32))
    # A repeat is an exact copy of an earlier request (a result-cache hit once that one finished).
    for i, r in enumerate(w):
        if r["kind"] == "repeat":
            assert any(o["prompt"] == r["prompt"] and o["max_tokens"] == r["max_tokens"] and o["kind"] != "repeat"
                       for o in w[:i])
    shared = [r["prompt"] for r in w if r["kind"] == "shared_prefix"]
    prefix = shared[0].split("\n\nQuestion")[0]
    assert len(prefix.split()) == 384 and all(p.startswith(prefix) for p in shared) and len(set(shared)) == 8
    assert all(16 <= r["max_tokens"] <= 64 and r["temperature"] == 0.0 and r["ignore_eos"] for r in w)
    with pytest.raises(ValueError, match="shared_prefix_frac"):
        make_workload(8, shared_prefix_frac=0.9, repeat_frac=0.2)


def test_fit_to_context_keeps_the_shared_prefix(tiny_artifact):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_artifact / "tokenizer.json"))
    w = fit_to_context(make_workload(12, seed=1, shared_prefix_words=40), tiny_artifact, max_len=160)
    lens = [len(tok.encode(r["prompt"], add_special_tokens=False).ids) + r["max_tokens"] for r in w]
    assert max(lens) <= 160 and max(lens) > 120   # cut to fit, not emptied
    heads = {r["prompt"][:100] for r in w if r["kind"] == "shared_prefix"}
    assert len(heads) == 1
    # Without max_len: the artifact's own context (as the pipeline's benchmark stage calls it).
    def pipeline_like():
        return fit_to_context(make_workload(16, seed=0, prompt_words=(16, 64), max_tokens=(16, 32),
                                            shared_prefix_words=128), tiny_artifact)

    p = pipeline_like()
    assert p == pipeline_like() and len(p) == 16
    assert max(len(tok.encode(r["prompt"], add_special_tokens=False).ids) + r["max_tokens"] for r in p) <= 512


# --- KV calculator ---------------------------------------------------------------------------------------------

def test_kv_calc_matches_hand_computed_figures(tiny_artifact, tmp_path):
    # SmolLM2-135M fp32: 2 x 30 layers x 3 KV heads x 64 x 4 bytes.
    assert kv_bytes_per_token(30, 3, 64, "float32") == 46_080
    smol = kv_calc.PRESETS["smollm2-135m"]
    # serving.md: 256 MiB pool / 720 KiB blocks of 16 = 364 blocks = 5,824 tokens.
    assert max_context(smol, 256 * 2**20, 1, block_size=16) == 5_824
    assert max_concurrency(smol, 256 * 2**20, 2048, block_size=16) == 2
    # Llama-2-7B fp16 (MHA): 0.5 MiB per token; 4k context x 32 sequences = 64 GiB.
    l7 = kv_calc.PRESETS["llama-2-7b"]
    assert kv_bytes_per_token(l7.num_layers, l7.num_kv_heads, l7.head_dim, l7.dtype) == 524_288
    assert kv_memory_bytes(l7, 4096, 32) == 64 * 2**30
    assert max_concurrency(l7, 24 * 2**30, 4096) == 12
    # GQA 8 (Llama-3-8B): 4x less than MHA at the same size.
    assert kv_memory_bytes(kv_calc.PRESETS["llama-3-8b"], 4096, 32) == 16 * 2**30
    # Block rounding: 17 tokens take 2 blocks of 16.
    assert kv_memory_bytes(KVShape(1, 1, 1, 1), 17, 1, block_size=16) == 2 * 32
    # From an artifact manifest (tiny: 2 layers x 2 KV heads x 16, fp32) and from a HF config dict.
    tiny = kv_calc.shape_from_manifest(tiny_artifact)
    assert (tiny.num_layers, tiny.num_kv_heads, tiny.head_dim, tiny.dtype) == (2, 2, 16, "float32")
    assert kv_bytes_per_token(tiny.num_layers, tiny.num_kv_heads, tiny.head_dim, tiny.dtype) == 512
    hf = kv_calc.shape_from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096,
                                        "torch_dtype": "bfloat16"})
    assert (hf.num_kv_heads, hf.head_dim, hf.dtype) == (32, 128, "bfloat16")
    with pytest.raises(ValueError, match="unknown KV dtype"):
        KVShape(1, 1, 1, "float13")


def test_kv_calc_layout_gives_the_context_the_server_serves(tiny_artifact):
    """--layout models the server's split of serve.kv_memory_mb: its max context is what the engine advertises."""
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.runners.onnx_session import CPU

    shape = kv_calc.shape_from_manifest(tiny_artifact)
    for mb, share in ((1, 0.2), (1, 0.1)):  # small enough that the rows, not the manifest, set the context
        eng = Engine(tiny_artifact, ServeConfig(providers=[CPU], kv_memory_mb=mb, kv_rows_share=share,
                                                max_model_len=None), start=False)
        r = kv_calc.report(shape, 64, 1, mb * 2**20, eng.block_manager.block_size, layout="standard",
                           rows_share=share)
        assert r["row_positions"] == eng.runner.row_tokens
        assert r["max_context"] == eng.max_model_len < 512


def test_kv_calc_cli(capsys, tiny_artifact):
    assert kv_calc.main(["--preset", "llama-2-7b", "--context", "4096", "--concurrency", "32",
                         "--budget-gib", "24", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["total_bytes"], r["max_concurrency"], r["max_context"]) == (64 * 2**30, 12, 1536)
    assert kv_calc.main(["--manifest", str(tiny_artifact), "--context", "512", "--concurrency", "4"]) == 0
    out = capsys.readouterr().out
    assert "512 B" in out and "1,048,576 B" in out   # per token; 4 x 512 tokens x 512 B
    assert kv_calc.main(["--layers", "2"]) == 2
    assert "give a source" in capsys.readouterr().err


# --- load generator and benchmark_artifact against the real server ----------------------------------------------

def _check_sane(res, workload):
    m = res.metrics()
    assert METRIC_KEYS <= set(m)
    assert all(isinstance(v, float) for v in m.values())
    assert m["requests_ok"] == len(workload) and m["requests_failed"] == 0, [r.error for r in res.records]
    # ignore_eos + greedy: every request generates exactly max_tokens, counted from the usage chunks.
    assert m["output_tokens"] == sum(r.completion_tokens for r in res.records) == sum(w["max_tokens"] for w in workload)
    for r in res.records:
        assert 0 < r.ttft_s <= r.e2e_s and all(g >= 0 for g in r.itl_s) and r.prompt_tokens > 0
    assert 0 < m["ttft_p50_s"] <= m["ttft_p99_s"] and m["e2e_p50_s"] <= m["e2e_p99_s"]
    assert m["output_tokens_per_s"] == pytest.approx(m["output_tokens"] / m["duration_s"])
    assert m["requests_per_s"] * m["duration_s"] == pytest.approx(len(workload))
    assert m["peak_rss_mb"] > 50 and m["server_cpu_s"] > 0
    assert len(res.samples) >= 2 and 0 < m["kv_usage_peak"] <= 1
    # The workload's repeats: at least one found its original finished in the result cache,
    # and the shared-prefix requests hit the prefix cache. At most 4 clients, so this holds by the order
    # of events, not by timing: request 14 (a repeat of request 5, 13 tokens) is sent at the 11th
    # completion, and 9 completions after request 5 was sent would need requests sent after it with
    # 14 and 15 tokens to finish first. At 8 clients request 14 goes out at the 7th completion, a
    # race between request 5 and request 12 that request 12 can win.
    assert m["result_cache_hits"] >= 1 and m["prefix_cache_hit_rate"] > 0.1
    json.dumps(res.to_dict())   # JSON-ready (no NaN objects)
    fig = res.figure()
    assert len(fig.axes) == 3
    return m


def test_loadgen_against_in_process_server(tiny_artifact):
    from loadtest.loadgen import run_workload
    from serve.api.app import create_app
    from serve.api.background import BackgroundServer
    from serve.config import ServeConfig

    w = small_workload(tiny_artifact)
    app = create_app(str(tiny_artifact), ServeConfig(providers=["CPUExecutionProvider"], num_blocks=256),
                     admin_token=None)
    with BackgroundServer(app) as srv:
        res = run_workload(srv.url, w, concurrency=4, sample_interval_s=0.05, label="tiny")
        m = _check_sane(res, w)
        assert m["concurrency"] == 4.0
        # Open loop: seeded Poisson arrivals at 40 requests/s; the result cache now answers everything again.
        rate = run_workload(srv.url, w[:8], concurrency=None, request_rate=40.0, sample_interval_s=0.05)
        assert rate.metrics()["requests_ok"] == 8 and rate.request_rate == 40.0
        assert rate.metrics()["result_cache_hits"] == 8
        starts = sorted(r.start_s for r in rate.records)
        assert starts[-1] > 0.05   # spread over time, not all at once


def test_benchmark_artifact_subprocess(tiny_artifact):
    from loadtest.serve_bench import benchmark_artifact, ratios

    w = small_workload(tiny_artifact)
    res = benchmark_artifact(tiny_artifact, w, concurrency=4,  # 4, not 8: see _check_sane's result-cache check
                             serve_overrides={"providers": ["CPUExecutionProvider"], "num_blocks": 256},
                             sample_interval_s=0.05)
    m = _check_sane(res, w)
    r = ratios(m, {**m, "output_tokens_per_s": m["output_tokens_per_s"] / 2, "peak_rss_mb": 0.0})
    assert r["output_tokens_per_s_ratio"] == pytest.approx(2.0) and r["e2e_p99_s_ratio"] == 1.0
    assert math.isnan(r["peak_rss_mb_ratio"])
    assert res.meta["isolate"] and res.meta["server_pid"] != __import__("os").getpid()
    assert not math.isnan(m["output_tokens_per_cpu_s"])
    with pytest.raises(ValueError, match="unknown ServeConfig field"):
        benchmark_artifact(tiny_artifact, w, serve_overrides={"max_batch": 4})
    with pytest.raises(ValueError, match="port"):
        benchmark_artifact(tiny_artifact, w, serve_overrides={"port": 9000})


# --- baselines and the comparison CLI ----------------------------------------------------------------------------

def test_baselines_generate_exactly_max_tokens(tiny_artifact, tiny_model_dir):
    from loadtest.baselines import hf_generate, ort_static

    w = small_workload(tiny_artifact, n=5, seed=2)
    want = sum(q["max_tokens"] for q in w)
    for res in (ort_static(tiny_artifact, w, batch_size=1), ort_static(tiny_artifact, w, batch_size=2),
                hf_generate(str(tiny_model_dir), w, batch_size=3)):
        m = res.metrics()
        assert m["requests_ok"] == 5 and m["output_tokens"] == want, res.label
        assert all(0 < r.ttft_s <= r.e2e_s and len(r.itl_s) == r.max_tokens - 1 for r in res.records)
        assert m["peak_rss_mb"] > 50 and m["server_cpu_s"] > 0
    # A static batch starts its rows together; row 2 waits for the whole first batch.
    s = [r.start_s for r in res.records]
    assert s[0] == s[1] == s[2] < s[3] == s[4]
    assert res.label == "hf_static_b3"


def test_run_cli_compares_server_and_baseline(tiny_artifact, tmp_path, capsys):
    from loadtest import run

    out = tmp_path / "res"
    assert run.main(["--artifact", str(tiny_artifact), "--requests", "6", "--concurrency", "3",
                     "--systems", "ort_sequential", "server", "--max-tokens", "4", "8", "--prompt-words", "8", "24",
                     "--shared-prefix-words", "40", "--max-len", "256", "--out", str(out),
                     "--serve-set", "num_blocks=128"]) == 0
    text = capsys.readouterr().out
    assert "ratios (x) vs ort_sequential" in text and "server_c3" in text
    d = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in d["results"]] == ["ort_sequential", "server_c3"]
    tokens = {r["metrics"]["output_tokens"] for r in d["results"]}
    assert len(tokens) == 1 and d["skipped"] == {}
    assert d["results"][1]["meta"]["serve_overrides"]["num_blocks"] == 128
    assert (out / "throughput.png").stat().st_size > 10_000 and (out / "server_c3.png").is_file()


def test_compare_with_genai_says_why_it_cannot_run(tiny_artifact, tmp_path):
    from loadtest.batch1 import compare_with_genai, genai_metrics

    res = compare_with_genai(tiny_artifact, tmp_path / "nothing-built-here")
    assert "genai_config.json" in res["skipped"] and "builder" in res["skipped"]
    assert genai_metrics(res) == {}


def _genai_or_skip():
    from loadtest.baselines import genai_available

    why = genai_available()
    if why:
        pytest.skip(f"onnxruntime-genai is not installed here ({why[:80]}); benchmarks/history.md says how")


def test_compare_with_genai_times_ours_and_genai_on_the_same_prompts(tiny_artifact, tiny_model_dir, tmp_path):
    """Where onnxruntime-genai is installed (.cache/genai-venv): its builder's model of the tiny HF folder against
    our tiny artifact, 4 prompts x 8 tokens each, greedy."""
    _genai_or_skip()
    import subprocess

    from loadtest.baselines import GENAI_PYTHON
    from loadtest.batch1 import compare_with_genai, genai_metrics

    out = tmp_path / "genai"
    subprocess.run([str(GENAI_PYTHON), "-m", "onnxruntime_genai.models.builder", "-i", str(tiny_model_dir), "-o",
                    str(out), "-p", "fp32", "-e", "cpu"], check=True, capture_output=True, timeout=300)
    res = compare_with_genai(tiny_artifact, out, requests=4, max_tokens=8, rounds=2)
    assert "skipped" not in res, res
    assert res["engine"]["output_tokens"] == res["genai"]["output_tokens"] == 32
    assert res["engine"]["requests"] == res["genai"]["requests"] == 4
    m = genai_metrics(res)
    assert m["bench_batch1_tok_per_s_vs_genai"] == pytest.approx(m["bench_batch1_tok_per_s"] / m["genai_batch1_tok_per_s"])
    assert all(np.isfinite(v) and v > 0 for v in m.values()), m
    assert set(res["cpu"]) >= {"avx2", "avx512_vnni", "model", "cpus"}


def test_sweep_serves_each_artifact_from_its_own_source_tree(tiny_artifact, tmp_path):
    """benchmarks.sweep through the openai SDK: exactly --max-tokens per request, x c1 from its own c1, and
    --source runs that artifact's server from another checkout (here a git worktree of HEAD)."""
    import shutil
    import subprocess
    from pathlib import Path

    from bench_cli import run_bench

    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                                     capture_output=True).returncode:
        pytest.skip("not a git checkout: no worktree to serve from")
    tree = tmp_path / "then"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), "HEAD"], check=True,
                   capture_output=True)
    try:
        out = tmp_path / "sweep.json"
        run = run_bench("sweep", "--artifact", f"now={tiny_artifact}", "--artifact", f"then={tiny_artifact}",
                        "--source", f"then={tree}", "--concurrency", "1", "2", "--requests-per-user", "1",
                        "--max-tokens", "4", "--set", 'providers=["CPUExecutionProvider"]', "--out", out)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], capture_output=True)
    res = json.loads(out.read_text())
    assert res["sources"] == {"then": str(tree)}
    for name in ("now", "then"):
        c1, c2 = res["rows"][name]
        assert (c1["c"], c1["requests"], c1["output_tokens"]) == (1, 8, 32)
        assert c2["output_tokens"] == 4 * c2["requests"] and c1["x_c1"] == 1.0
        assert c2["x_c1"] == pytest.approx(c2["tokens_per_s"] / c1["tokens_per_s"], abs=0.01)
    assert run_bench("sweep", "--artifact", f"now={tiny_artifact}", "--source", "nope=/tmp", "--out", out).returncode


def test_sweep_repeats_report_medians_and_each_rounds_ratio(tiny_artifact, tmp_path):
    """--repeats: every (system, level) runs once per round; the rows are the medians, x c1 of the medians, and each
    round's own ratio of its level to its c1."""
    import statistics

    from bench_cli import run_bench

    out = tmp_path / "sweep.json"
    run = run_bench("sweep", "--artifact", f"a={tiny_artifact}", "--artifact", f"b={tiny_artifact}", "--concurrency",
                    "1", "2", "--requests-per-user", "1", "--max-tokens", "3", "--repeats", "3",
                    "--set", 'providers=["CPUExecutionProvider"]', "--set-for", "b:max_batch_size=1", "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["repeats"] == 3 and len(res["rounds"]) == 3
    assert res["set_for"] == {"b": {"max_batch_size": 1}}  # recorded beside the figures
    for name in ("a", "b"):
        c1, c2 = res["rows"][name]
        per_round = [rnd[name] for rnd in res["rounds"]]
        assert c2["tokens_per_s"] == pytest.approx(statistics.median(r[1]["tokens_per_s"] for r in per_round), abs=0.1)
        assert c2["x_c1"] == pytest.approx(c2["tokens_per_s"] / c1["tokens_per_s"], abs=0.01)
        assert c2["x_c1_rounds"] == [r[1]["x_c1"] for r in per_round] and c1["x_c1_rounds"] == [1.0] * 3
        assert all(r[1]["output_tokens"] == 3 * r[1]["requests"] for r in per_round)
    assert run_bench("sweep", "--artifact", f"a={tiny_artifact}", "--repeats", "0", "--out", out).returncode
    # a name that is no --artifact
    assert run_bench("sweep", "--artifact", f"a={tiny_artifact}", "--set-for", "c:max_batch_size=1", "--out",
                     out).returncode


def test_sweep_streams_and_times_the_first_token_of_long_prompts(tiny_artifact, tmp_path):
    """--workload long_prompt: each request a function to explain (600 characters here, for the tiny model's context),
    streamed; the server's usage gives the prompt tokens, each level its TTFT percentiles, under the level's time."""
    from bench_cli import run_bench

    out = tmp_path / "sweep.json"
    run = run_bench("sweep", "--artifact", f"t={tiny_artifact}", "--concurrency", "1", "2", "--requests-per-user", "1",
                    "--max-tokens", "3", "--workload", "long_prompt", "--prompt-chars", "600",
                    "--set", 'providers=["CPUExecutionProvider"]', "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["workload"] == "long_prompt" and res["max_tokens"] == 3
    for row in res["rows"]["t"]:
        assert row["output_tokens"] == 3 * row["requests"]
        assert row["prompt_tokens"] >= 100 * row["requests"]  # 600 characters of code each
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] <= row["wall_s"]
        assert row["prompt_tokens_per_s"] == pytest.approx(row["prompt_tokens"] / row["wall_s"], rel=0.02)
    assert run_bench("sweep", "--artifact", f"t={tiny_artifact}", "--workload", "essay", "--out", out).returncode
