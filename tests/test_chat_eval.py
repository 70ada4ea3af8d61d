"""Acceptance in the form of use: the chat set (compress/evaluate/chat.py) and its checks in the gate (compress/evaluate/gate.py).

The damaged candidate is the tiny Llama with the embeddings of its chat-template tokens (<|im_start|>, <|im_end|>)
replaced: text of the documentation corpus never holds them, so the test split barely moves, while every chat
prompt does. The gate must reject it on the chat set and only there.
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from compress.evaluate import chat as chat_eval
from compress.evaluate.gate import accept, genre_table, versus_champion
from compress.config import AcceptConfig
from compress.evaluate.onnx_eval import evaluate_onnx
from compress.export.gqa import build_gqa_artifact

NEW = 16


@pytest.fixture(scope="module")
def chat_artifacts(tiny, tmp_path_factory):
    """(teacher, damaged) gqa artifacts of the tiny Llama; the damaged one has new template-token embeddings."""
    model, tok = tiny
    root = tmp_path_factory.mktemp("chat")
    build_gqa_artifact(model, tok, root / "teacher")
    bad = copy.deepcopy(model)
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    with torch.no_grad():
        w = bad.get_input_embeddings().weight
        w[ids] = torch.randn(len(ids), w.shape[1], generator=torch.Generator().manual_seed(1)) * w.std()
    build_gqa_artifact(bad, tok, root / "damaged")
    return root / "teacher", root / "damaged", ids


@pytest.fixture(scope="module")
def prompts(chat_artifacts):
    return chat_eval.render(chat_artifacts[0], chat_eval.load_sets(["builtin"]))


def test_prompts_are_rendered_as_transformers_renders_them(chat_artifacts, tiny, prompts):
    teacher, _, ids = chat_artifacts
    tok = tiny[1]
    assert len(prompts) == 48
    first = chat_eval.load_sets(["builtin"])[0]["messages"]
    text = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False)  # transformers' own rendering
    assert prompts[0].prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert prompts[0].prompt_ids[0] == ids[0] and prompts[0].reference_ids is None


def test_teacher_against_itself_is_one(chat_artifacts, prompts, tmp_path):
    teacher = chat_artifacts[0]
    t = chat_eval.teacher_targets(teacher, prompts, NEW, tmp_path, progress=False)
    r = chat_eval.evaluate_chat(teacher, teacher, prompts, t, divergence_tokens=8, max_new_tokens=NEW, progress=False)
    assert r["chat_items"] == 48 and r["chat_tokens"] == sum(len(a) for a in t.answers)
    # the teacher's NLL of its answers comes from its decode steps, the candidate's from one prefill of each answer:
    # the same model through two kernels' float32 rounding (~1e-8 here; the gate's limits are 5e-2 away)
    assert r["chat_perplexity_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert r["chat_top1_agreement"] == 1.0
    assert r["chat_judged_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert r["chat_late_divergence_share"] == 1.0
    assert set(r["by_kind"]) == {"question", "instruction", "small_talk", "reasoning", "code", "advice"}


def test_teacher_answers_are_cached_per_teacher(chat_artifacts, prompts, tmp_path):
    teacher, damaged, _ = chat_artifacts
    first = chat_eval.teacher_targets(teacher, prompts, NEW, tmp_path, progress=False)
    again = chat_eval.teacher_targets(teacher, prompts, NEW, tmp_path, progress=False)
    assert not first.cached and again.cached
    assert again.answers == first.answers and again.target_nll == first.target_nll
    assert len(list(tmp_path.glob("*.json"))) == 1
    # Another teacher (other weights, so other file digests) is never answered from the first one's cache.
    other = chat_eval.teacher_targets(damaged, prompts, NEW, tmp_path, progress=False)
    assert not other.cached and other.answers != first.answers
    assert len(list(tmp_path.glob("*.json"))) == 2
    # So is a longer answer budget.
    assert not chat_eval.teacher_targets(teacher, prompts, NEW + 1, tmp_path, progress=False).cached


def test_damaged_candidate_passes_the_documentation_split_and_fails_the_chat_set(chat_artifacts, prompts, tiny_splits,
                                                                                 tmp_path):
    teacher, damaged, ids = chat_artifacts
    assert not np.isin(tiny_splits.test, ids).any()  # the corpus never holds the template's tokens
    base = evaluate_onnx(teacher, tiny_splits.test, latency=False)
    cand = evaluate_onnx(damaged, tiny_splits.test, reference_artifact=teacher, latency=False)
    cfg = AcceptConfig(max_perplexity_ratio=1.01, min_top1_agreement=0.9)
    docs_only = accept(cand, base, cfg, "fidelity")
    assert docs_only.accepted, docs_only.reasons  # what the gate saw before the chat set: it passes

    t = chat_eval.teacher_targets(teacher, prompts, NEW, tmp_path, progress=False)
    chat = chat_eval.evaluate_chat(damaged, teacher, prompts, t, divergence_tokens=8, max_new_tokens=NEW,
                                   progress=False)
    assert chat["chat_perplexity_ratio"] > 1.1 and chat["chat_top1_agreement"] < 0.85
    v = accept({**cand, **{k: v for k, v in chat.items() if k != "by_kind"}}, base, cfg, "fidelity")
    assert not v.accepted
    failed = {c["name"] for c in v.checks if not c["passed"]}
    assert failed and all(name.startswith("chat_") for name in failed)
    assert any(r.startswith("chat: perplexity") and "max_chat_perplexity_ratio 1.05" in r for r in v.reasons)
    genres = {g["genre"]: g["passed"] for g in genre_table(v.checks)}
    assert genres["test"] and not genres["chat"]
    assert v.metrics["gate_worst_perplexity_ratio"] == pytest.approx(chat["chat_perplexity_ratio"])


def test_reference_answers_are_scored_as_written(chat_artifacts, tmp_path):
    teacher = chat_artifacts[0]
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello there"}]}) + "\n")
    (p,) = chat_eval.render(teacher, chat_eval.load_sets([str(path)]))
    assert p.reference_ids and p.reference_ids[-2] == 2  # ... <|im_end|> \n, as the template writes the turn
    t = chat_eval.teacher_targets(teacher, [p], NEW, None, progress=False)
    assert t.targets == [p.reference_ids] and t.answers[0] != p.reference_ids


def test_teacher_figures_from_its_generation_equal_scoring_its_answers(chat_artifacts, prompts):
    """The teacher's NLL of its own answers comes from the logits the engine picked them from; scoring the answers
    again (one prefill each, as before) gives the same NLL, and the argmax there is the answer."""
    from compress.drivers import load_lm

    teacher = chat_artifacts[0]
    t = chat_eval.teacher_targets(teacher, prompts, NEW, None, progress=False)
    lm = load_lm(teacher, verify=False)
    for i in range(0, len(prompts), 6):
        nll, am = chat_eval.score_answer(lm, prompts[i].prompt_ids, t.answers[i])
        assert t.answer_nll[i] == pytest.approx(nll, rel=1e-5) and t.target_argmax[i] == am.tolist() == t.answers[i]
    assert set(t.seconds) == {"teacher_answers", "teacher"} and t.seconds["teacher"] > 0


def test_a_spent_budget_stops_the_chat_set_with_what_it_was_doing(chat_artifacts, prompts):
    from compress.evaluate.budget import Budget, BudgetExceeded

    budget = Budget(1e-6, "accept.max_minutes")  # spent by the time the engine is made
    with budget.part("test"):
        pass
    with pytest.raises(BudgetExceeded) as e:
        chat_eval.teacher_targets(chat_artifacts[0], prompts, NEW, None, progress=False, check=budget.check)
    msg = str(e.value)
    assert msg.startswith("accept.max_minutes=1e-06 spent after") and "teacher chat answers: 0 of 48" in msg
    assert "(test 0 s)" in msg and "Raise accept.max_minutes" in msg
    with pytest.raises(BudgetExceeded, match="while starting chat"):
        with budget.part("chat"):
            pass
    assert Budget(None).check("anything") is None  # no budget: never stops


@pytest.mark.parametrize("line, words", [
    ("not json", "line 1 is not JSON"),
    ('{"messages": []}', "line 1 needs \"messages\""),
    ('{"messages": [{"role": "system", "content": "x"}]}', "ends with a 'system' message"),
])
def test_bad_chat_set_names_the_line_and_the_fix(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(chat_eval.ChatEvalError, match="accept.chat_sets") as e:
        chat_eval.load_sets([str(path)])
    assert words in str(e.value)


def test_config_refuses_a_missing_chat_set():
    with pytest.raises(Exception, match="chat_sets"):
        AcceptConfig(chat_sets=["no/such/file.jsonl"])


def test_model_without_a_chat_template_is_said_not_scored(chat_artifacts, tmp_path):
    from compress.artifact import read_manifest, write_manifest

    plain = tmp_path / "plain"
    shutil.copytree(chat_artifacts[0], plain)
    m = read_manifest(plain, verify=False)
    m.pop("chat_template", None)
    write_manifest(plain, {k: v for k, v in m.items() if k not in ("files", "manifest_version")})
    assert not chat_eval.has_chat_template(plain)
    with pytest.raises(chat_eval.ChatEvalError, match="accept.chat_sets: \\[\\]"):
        chat_eval.render(plain, chat_eval.load_sets(["builtin"]))


def test_a_candidate_worse_than_the_champion_on_chat_is_named():
    champ = {"chat_perplexity_ratio": 1.004, "gate_perplexity_ratio": 1.004, "size_bytes": 158e6}
    worse = versus_champion({"chat_perplexity_ratio": 1.55, "gate_perplexity_ratio": 1.06, "size_bytes": 136e6}, champ)
    assert worse["worse_on_use"] and worse["use"]["better"] == "champion"
    assert {r["key"]: r["better"] for r in worse["rows"]} == {"chat_perplexity_ratio": "champion",
                                                              "gate_perplexity_ratio": "champion",
                                                              "size_bytes": "candidate"}
    same = versus_champion(dict(champ), champ)
    assert not same["worse_on_use"] and all(r["better"] == "same" for r in same["rows"])
    unmeasured = versus_champion({"gate_perplexity_ratio": 1.0}, {"gate_perplexity_ratio": 1.1})
    assert not unmeasured["use_measured"] and not unmeasured["worse_on_use"]


def test_eval_speed_benchmark_compares_both_paths(chat_artifacts, tmp_path):
    """benchmarks.chat_check --speed: the batched path and the one-prompt-at-a-time loop on the same prompts, the same
    answers token for token (its exit status), the figures written out."""
    from bench_cli import run_bench

    teacher, damaged, _ = chat_artifacts
    out = tmp_path / "speed.json"
    run = run_bench("chat_check", "--speed", "--teacher", teacher, "--candidate", damaged, "--prompts", "6", "--new-tokens", "8",
                    "--json", out)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["teacher_answers_same"] == r["candidate_answers_same"] == 6 and r["speedup"] > 0
    assert r["largest_figure_difference"] < 1e-4
    assert "same answers token for token: teacher 6/6, candidate 6/6" in run.stdout
