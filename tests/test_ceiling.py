"""benchmarks.ceiling: a graph's own MatMulNBits timed alone and priced over a sweep's workload. Checked on a tiny INT8
graph: the kernels it copies (count, multiply-adds, bytes), the bound recomputed from the kernel times it reports,
and its targets judged by that bound."""

from __future__ import annotations

import json

import pytest
from bench_cli import run_bench

from compress.export.gqa import build_gqa_artifact
from compress.loading.tiny import build_tiny


@pytest.fixture(scope="module")
def int8_graph(tmp_path_factory):
    model, tok = build_tiny("llama", 0)
    path = tmp_path_factory.mktemp("ceiling") / "int8"
    build_gqa_artifact(model, tok, path, int8=(32, 4))
    return path, model.config, tok


def write_sweep(folder, rows: dict) -> str:
    (folder / "sweep.json").write_text(json.dumps({"rows": rows}))
    return str(folder / "sweep.json")


def test_the_bound_is_the_workload_at_the_kernels_times(int8_graph, tmp_path):
    path, cfg, tok = int8_graph
    sweep = write_sweep(tmp_path, {"int8": [{"c": 1, "requests": 2, "output_tokens": 8, "tokens_per_s": 9.0},
                                            {"c": 2, "requests": 4, "output_tokens": 24, "tokens_per_s": 30.0}],
                                   "anchor": [{"c": 1, "requests": 2, "output_tokens": 8, "tokens_per_s": 4.0},
                                              {"c": 2, "requests": 4, "output_tokens": 24, "tokens_per_s": 1e6}]})
    out = tmp_path / "ceiling.json"
    run = run_bench("ceiling", "--sweep", sweep, "--artifact", f"int8={path}", "--prefill-rows", "4", "8", "--reps", "3",
                    "--target", "int8@1>=2*anchor@1", "--target", "int8@2>=1*anchor@2", "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    system = json.loads(out.read_text())["systems"]["int8"]
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    body = cfg.num_hidden_layers * (h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)
    assert system["macs_per_row"] == {"body": body, "head": h * cfg.vocab_size}
    assert system["nodes"]["head"] == 1
    # 8-bit codes, an fp32 scale per block of 32 and, where stored, a uint8 zero point per block
    total = body + h * cfg.vocab_size
    assert system["weights_read_per_step_bytes"] in (total + total // 32 * 4, total + total // 32 * 5)
    ms = {k: {int(r): v / 1e3 for r, v in t.items()} for k, t in system["kernel_ms"].items()}
    assert set(ms["body"]) == set(ms["head"]) == {1, 2, 4, 8}
    for level, requests, per_request in ((system["levels"][0], 2, 4), (system["levels"][1], 4, 6)):
        c = level["c"]
        assert len(level["prompts"]) == requests and all(level["prompts"])
        prompts = [len(tok(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False), add_special_tokens=False)["input_ids"])
                   for text in level["prompts"]]
        assert level["prompt_tokens"] == sum(prompts) > 0
        prefill = sum(prompts) * min(ms["body"][r] / r for r in (4, 8)) + requests * ms["head"][1]
        decode = requests / c * (per_request - 1) * (ms["body"][c] + ms["head"][c])
        assert level["ceiling_tokens_per_s"] == pytest.approx(requests * per_request / (prefill + decode), rel=0.01)
    first, second = json.loads(out.read_text())["targets"]
    assert first["needs_tokens_per_s"] == 8.0 and first["reachable"] is True  # a tiny graph makes far more than 8
    assert second["needs_tokens_per_s"] == 1e6 and second["reachable"] is False


def test_bad_input_names_the_fix(int8_graph, tmp_path):
    path, _, _ = int8_graph
    sweep = write_sweep(tmp_path, {"int8": [{"c": 1, "requests": 1, "output_tokens": 2, "tokens_per_s": 1.0}]})
    run = run_bench("ceiling", "--sweep", sweep, "--artifact", f"other={path}")
    assert run.returncode == 1 and "the sweep has no such system" in run.stderr
    run = run_bench("ceiling", "--sweep", sweep, "--artifact", f"int8={path}", "--reps", "1", "--target", "int8>=2")
    assert run.returncode == 1 and "write it as A@C>=K*B@D" in run.stderr
    roof = run_bench("ceiling", "--roofline", "--layers", "2", "--rows", "1", "--reps", "1", "--forms", "8:30")
    assert roof.returncode == 2 and "--forms '8:30'" in roof.stderr


def test_prefill_forms_times_each_form_and_measures_it_against_the_first(int8_graph, tiny_gqa, tiny_splits, tmp_path):
    """--prefill-forms: the reference agrees with itself exactly; the INT8 graph of the same tiny model is timed and
    measured against the fp32 one at every position, with its multiply-adds a second from the manifest's shape."""
    path, cfg, _ = int8_graph
    tiny_splits.save(tmp_path / "splits.npz")
    out = tmp_path / "prefill.json"
    run = run_bench("ceiling", "--prefill-forms", "--form", f"fp32={tiny_gqa}", "--form", f"int8={path}",
                    "--form", f"again={tiny_gqa}", "--splits", tmp_path / "splits.npz", "--tokens", "64",
                    "--prompts", "2", "--reps", "2", "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    forms = json.loads(out.read_text())["forms"]
    assert list(forms) == ["fp32", "int8", "again"]
    assert forms["again"]["top1_agreement_vs_first"] == 1.0 and forms["again"]["max_abs_logit_diff_vs_first"] == 0.0
    assert 0.5 < forms["int8"]["top1_agreement_vs_first"] <= 1.0 and forms["int8"]["max_abs_logit_diff_vs_first"] > 0
    manifest = json.loads((path / "manifest.json").read_text())
    macs = manifest["num_parameters"] - manifest["vocab_size"] * manifest["hidden_size"]
    for f in forms.values():
        assert f["gmac_per_s"] == pytest.approx(macs * 64 / f["seconds"] / 1e9, rel=0.02, abs=0.11)
    short = run_bench("ceiling", "--prefill-forms", "--form", f"fp32={tiny_gqa}", "--splits", tmp_path / "splits.npz",
                      "--tokens", "4096")
    assert short.returncode != 0 and "fewer than --tokens x --prompts" in short.stderr
