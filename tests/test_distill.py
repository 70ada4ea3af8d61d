"""Distillation on the tiny model: the loss, the schedules, KD vs CE, masks, budgets, resume."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from compress.config import DistillConfig
from compress.distill.train import distill
from compress.distill.loss import TopK, evaluate, hidden_loss, kd_loss
from compress.distill.schedules import alpha_at, lr_at, schedule_value, temperature_at
from compress.loading.tiny import build_tiny_llama


def _cfg(**kw) -> DistillConfig:
    base = dict(steps=10, lr=3e-3, batch_size=4, eval_every=5, checkpoint_every=5, early_stop_patience=0,
                t_start=4.0, t_end=1.0, t_schedule="linear", alpha_start=0.9, alpha_end=0.5, device="cpu")
    base.update(kw)
    return DistillConfig(**base)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def other_student():
    """A tiny Llama with another seed: same shapes as the teacher, different weights. Read-only."""
    return build_tiny_llama(seed=1)[0]


# ------------------------------------------------------------------------------------------- loss


def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_kd_loss_matches_hand_computed_reference():
    s = np.array([[[1.0, 2.0, 0.5, -1.0], [0.0, 0.3, 2.5, 1.0], [3.0, -2.0, 0.0, 9.0]]])
    t = np.array([[[2.0, 1.0, 0.0, -0.5], [1.5, 0.2, 2.0, 0.0], [-4.0, 7.0, 1.0, 0.0]]])
    labels = np.array([[1, 2, 3]])
    mask = np.array([[1, 1, 0]])  # the last position is padding: it must not count
    T, alpha = 2.0, 0.7
    # Explicit math on the two real positions.
    kl, ce = [], []
    for i in range(2):
        lpt, lps = _np_log_softmax(t[0, i] / T), _np_log_softmax(s[0, i] / T)
        kl.append(float((np.exp(lpt) * (lpt - lps)).sum()))
        ce.append(float(-_np_log_softmax(s[0, i])[labels[0, i]]))
    kl_ref, ce_ref = np.mean(kl), np.mean(ce)
    ref = alpha * T * T * kl_ref + (1 - alpha) * ce_ref

    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    loss, parts = kd_loss(f(s), f(t), torch.tensor(labels), torch.tensor(mask), T, alpha)
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert parts["kl"] == pytest.approx(kl_ref, rel=1e-5)
    assert parts["kd_loss"] == pytest.approx(T * T * kl_ref, rel=1e-5)
    assert parts["ce_loss"] == pytest.approx(ce_ref, rel=1e-5)
    assert parts["loss"] == pytest.approx(ref, rel=1e-5)
    # Padding is ignored whatever it holds; -100 labels leave the CE only.
    s2 = s.copy()
    s2[0, 2] = [50.0, -50.0, 3.0, 1.0]
    assert kd_loss(f(s2), f(t), torch.tensor(labels), torch.tensor(mask), T, alpha)[0].item() == pytest.approx(ref, rel=1e-5)
    _, p100 = kd_loss(f(s), f(t), torch.tensor([[1, -100, 3]]), torch.tensor(mask), T, alpha)
    assert p100["ce_loss"] == pytest.approx(ce[0], rel=1e-5) and p100["kl"] == pytest.approx(kl_ref, rel=1e-5)
    # The top-k form with k = vocab is the exact KL.
    top = f(t).topk(4, dim=-1)
    _, pk = kd_loss(f(s), TopK(top.values, top.indices), torch.tensor(labels), torch.tensor(mask), T, alpha)
    assert pk["kl"] == pytest.approx(kl_ref, rel=1e-5)


def test_kd_loss_gradient_flows_to_student_only():
    s = torch.randn(2, 5, 11, requires_grad=True)
    t = torch.randn(2, 5, 11)
    loss, _ = kd_loss(s, t, torch.randint(0, 11, (2, 5)), None, 3.0, 0.5)
    loss.backward()
    assert s.grad is not None and torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------- schedules


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("constant", [4.0, 4.0, 4.0, 4.0, 4.0]),
        ("linear", [4.0, 3.25, 2.5, 1.75, 1.0]),
        ("cosine", [4.0, 1 + 1.5 * (1 + math.sqrt(0.5)), 2.5, 1 + 1.5 * (1 - math.sqrt(0.5)), 1.0]),
        ("step", [4.0, 4.0, 2.5, 2.5, 1.0]),  # every = 2: stages 0,0,1,1,2 of 0..2
    ],
)
def test_temperature_schedules_exact(kind, expected):
    cfg = _cfg(steps=5, t_schedule=kind, t_step_every=2)
    got = [temperature_at(i, 5, cfg) for i in range(5)]
    assert got == pytest.approx(expected, abs=1e-12)
    assert temperature_at(99, 5, cfg) == pytest.approx(expected[-1])  # past the end it holds


def test_step_schedule_staircase_and_alpha_and_lr():
    # 10 steps, every 3: stages 0,0,0,1,1,1,2,2,2,3 of 0..3
    assert [schedule_value("step", 4.0, 1.0, i, 10, 3) for i in range(10)] == pytest.approx(
        [4, 4, 4, 3, 3, 3, 2, 2, 2, 1])
    assert schedule_value("linear", 4.0, 1.0, 0, 1) == 4.0  # one step: the start value
    cfg = _cfg(steps=5, alpha_schedule="linear", alpha_start=1.0, alpha_end=0.0)
    assert [alpha_at(i, 5, cfg) for i in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    cfg = _cfg(steps=6, lr=1.0, warmup_steps=2, lr_schedule="linear", lr_end_ratio=0.0)
    assert [lr_at(i, 6, cfg) for i in range(6)] == pytest.approx([0.5, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])
    with pytest.raises(ValueError):
        schedule_value("exponential", 4.0, 1.0, 0, 5)


# ------------------------------------------------------------------------------------------- training


def test_evaluate_matches_torch_eval(tiny_model, other_student, tiny_splits):
    from compress.evaluate.torch_eval import kl_and_agreement, perplexity

    ev = evaluate(other_student, tiny_model, tiny_splits.selection)
    ref = kl_and_agreement(other_student, tiny_model, tiny_splits.selection)
    assert ev["perplexity"] == pytest.approx(perplexity(other_student, tiny_splits.selection), rel=1e-5)
    assert ev["teacher_perplexity"] == pytest.approx(perplexity(tiny_model, tiny_splits.selection), rel=1e-5)
    assert ev["kl"] == pytest.approx(ref["kl"], rel=1e-5)
    assert ev["top1_agreement"] == ref["top1_agreement"]


def test_kd_ends_closer_to_teacher_than_ce_alone(tiny_model, other_student, tiny_splits, tmp_path):
    cfg = _cfg(steps=40, eval_every=40, checkpoint_every=40, t_schedule="cosine")
    logs: list[tuple[int, dict]] = []
    kd = distill(copy.deepcopy(other_student), tiny_model, tiny_splits, cfg, tmp_path / "kd",
                 on_log=lambda s, m: logs.append((s, m)), progress=False)
    ce_cfg = cfg.model_copy(update={"alpha_start": 0.0, "alpha_end": 0.0})
    ce = distill(copy.deepcopy(other_student), tiny_model, tiny_splits, ce_cfg, tmp_path / "ce", progress=False)
    kd_kl, ce_kl = kd.evals[-1]["kl"], ce.evals[-1]["kl"]
    assert kd.kl_before == ce.kl_before
    assert kd_kl < kd.kl_before, (kd.kl_before, kd_kl)
    assert kd_kl < 0.6 * ce_kl, (kd_kl, ce_kl)
    # What MLflow gets: every step's schedule values and losses, and the evals at 0 and 40.
    steps = [s for s, m in logs if "T" in m]
    assert steps == list(range(1, 41))
    assert set(logs[1][1]) == {"T", "alpha", "kd_loss", "ce_loss", "hidden_loss", "loss", "lr"}
    assert logs[1][1]["hidden_loss"] == 0.0  # hidden_weight 0: logits only
    assert [s for s, m in logs if "eval_kl" in m] == [0, 40]
    assert logs[1][1]["T"] == 4.0 and logs[-2][1]["T"] == pytest.approx(1.0)
    m = kd.metrics()
    assert m["distill_steps"] == 40 and m["distill_kl_before"] > m["distill_kl_after"]
    fig = kd.figure()
    assert len(fig.axes) == 5  # loss, schedules (+ alpha twin), eval (+ KL twin)


def test_masks_stay_exactly_zero(tiny_model, other_student, tiny_splits, tmp_path):
    student = copy.deepcopy(other_student)
    gen = torch.Generator().manual_seed(0)
    named = dict(student.named_parameters(remove_duplicate=False))  # lm_head.weight is tied to the embeddings
    masks = {n: torch.rand(named[n].shape, generator=gen) > 0.5
             for n in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight")}
    before = {n: named[n].detach().clone() for n in masks}
    seen: list[bool] = []

    def check(step, metrics):
        seen.append(all(bool((named[n][~m] == 0).all()) for n, m in masks.items()))

    distill(student, tiny_model, tiny_splits, _cfg(steps=8, monitor="kl"), tmp_path, masks=masks, on_log=check, progress=False)
    assert seen and all(seen)
    for n, m in masks.items():
        p = named[n].detach()
        assert (p[~m] == 0).all(), n
        assert not torch.equal(p[m], before[n][m]), f"{n}: kept weights did not train"
    with pytest.raises(ValueError, match="no such parameter"):
        distill(copy.deepcopy(other_student), tiny_model, tiny_splits, _cfg(), tmp_path / "bad",
                masks={"model.nope.weight": torch.ones(3, dtype=torch.bool)}, progress=False)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_resume_after_a_crash_continues_where_it_stopped(tiny_model, other_student, tiny_splits, tmp_path):
    cfg = _cfg(steps=10, eval_every=5, checkpoint_every=3, alpha_schedule="cosine", lr_schedule="cosine")
    ref_log: dict[int, dict] = {}
    ref_student = copy.deepcopy(other_student)
    ref = distill(ref_student, tiny_model, tiny_splits, cfg, tmp_path / "ref",
                  on_log=lambda s, m: ref_log.setdefault(s, {}).update(m), progress=False)

    class Crash(RuntimeError):
        pass

    def crash_at_8(step, metrics):
        if step == 8:
            raise Crash

    work = tmp_path / "run"
    with pytest.raises(Crash):
        distill(copy.deepcopy(other_student), tiny_model, tiny_splits, cfg, work, on_log=crash_at_8, progress=False)
    # A fresh process: the untrained student again, the same workdir. The last checkpoint is step 6.
    log: dict[int, dict] = {}
    student = copy.deepcopy(other_student)
    rep = distill(student, tiny_model, tiny_splits, cfg, work, on_log=lambda s, m: log.setdefault(s, {}).update(m),
                  progress=False)
    assert rep.resumed_from == 6 and rep.steps == 10
    assert sorted(log) == [7, 8, 9, 10]
    for s in log:
        for k in ("T", "alpha", "lr"):
            assert log[s][k] == ref_log[s][k], (s, k)
        assert log[s]["loss"] == pytest.approx(ref_log[s]["loss"], rel=1e-6)
    assert [h["T"] for h in rep.history] == [h["T"] for h in ref.history]
    assert [e["step"] for e in rep.evals] == [0, 5, 10]
    assert [e["kl"] for e in rep.evals] == pytest.approx([e["kl"] for e in ref.evals], rel=1e-6)
    assert rep.kl_after == pytest.approx(ref.kl_after, rel=1e-6)
    got, want = _params(student), _params(ref_student)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6)
    # A finished run re-run returns its report at once and loads the best weights.
    again_student = copy.deepcopy(other_student)
    again = distill(again_student, tiny_model, tiny_splits, cfg, work, progress=False)
    assert again.steps == 10 and again.resumed_from == 10 and again.history == rep.history
    for n, p in _params(again_student).items():
        torch.testing.assert_close(p, want[n], rtol=0, atol=1e-6)
    # Another config in the same folder does not resume a trajectory that is not its own.
    other = distill(copy.deepcopy(other_student), tiny_model, tiny_splits, cfg.model_copy(update={"steps": 4}), work,
                    progress=False)
    assert other.resumed_from == 0 and other.steps == 4


def test_time_budget_and_early_stop_keep_the_best(tiny_model, other_student, tiny_splits, tmp_path, monkeypatch):
    import compress.distill.train as mod

    clock = iter(range(10**9))  # a fake clock: one second per reading, whatever the machine's load
    monkeypatch.setattr(mod.time, "perf_counter", lambda: float(next(clock)))
    timed = distill(copy.deepcopy(other_student), tiny_model, tiny_splits, _cfg(steps=1000, max_minutes=0.5),
                    tmp_path / "time", progress=False)
    monkeypatch.undo()
    assert timed.stop_reason == "time" and 0 < timed.steps < 1000
    assert timed.evals[-1]["step"] == timed.steps  # the final weights were evaluated too
    # A learning rate that wrecks the model: no eval beats step 0, so training stops and the
    # untouched student comes back.
    student = copy.deepcopy(other_student)
    rep = distill(student, tiny_model, tiny_splits, _cfg(steps=50, lr=5.0, max_grad_norm=0, eval_every=2, early_stop_patience=2),
                  tmp_path / "early", progress=False)
    assert rep.stop_reason == "early_stop" and rep.steps == 4 and rep.best_step == 0
    assert rep.perplexity_after == rep.perplexity_before
    for n, p in _params(student).items():
        assert torch.equal(p, dict(other_student.named_parameters())[n].detach()), n


def test_teacher_topk_cache_runs_the_teacher_once_per_block(tiny_model, other_student, tiny_splits, tmp_path):
    calls = {"n": 0}
    teacher = copy.deepcopy(tiny_model)
    # on the body: the fused loss runs the teacher up to its last hidden state, the plain loss through its head
    teacher.model.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    tiny_splits = dataclasses.replace(tiny_splits, train=tiny_splits.train[:16])
    epoch = len(tiny_splits.train) // 4  # steps per epoch at batch 4
    cfg = _cfg(steps=2 * epoch, eval_every=1000, checkpoint_every=1000)
    full = distill(copy.deepcopy(other_student), teacher, tiny_splits, cfg, tmp_path / "full", progress=False)
    n_full, calls["n"] = calls["n"], 0
    vocab = tiny_model.config.vocab_size
    cached = distill(copy.deepcopy(other_student), teacher, tiny_splits, cfg.model_copy(update={"teacher_topk": vocab}),
                     tmp_path / "cache", progress=False)
    # evals before and after, and the probe's two forwards (logits; last hidden state) that check the teacher's
    # logits are its head applied to its last hidden state (compress/distill/fused.py::split_head)
    other = 2 * math.ceil(len(tiny_splits.selection) / 4) + 2
    assert n_full - other == 2 * epoch
    assert calls["n"] - other == epoch  # the second epoch reuses the cache
    # k = vocab keeps everything: the same training, up to float summation order.
    assert [h["loss"] for h in cached.history] == pytest.approx([h["loss"] for h in full.history], rel=1e-4)


# ------------------------------------------------------------------------------- intermediate states


def test_hidden_loss_matches_hand_computed_reference():
    g = torch.Generator().manual_seed(0)
    t = [torch.randn(2, 3, 4, generator=g) for _ in range(4)]  # embeddings + 3 teacher layers
    s = [torch.randn(2, 3, 4, generator=g) for _ in range(3)]  # embeddings + 2 student layers (teacher's 0 and 2)
    ref = np.mean([np.mean(((s[l + 1] - t[m + 1]).numpy() ** 2).sum(-1) / (t[m + 1].numpy() ** 2).sum(-1))
                   for l, m in enumerate([0, 2])])
    assert hidden_loss(s, t, [0, 2]).item() == pytest.approx(ref, rel=1e-6)
    assert hidden_loss(t, t, [0, 1, 2]).item() == 0.0
    # scaling the teacher's stream by 10 and the error with it leaves the loss as it was
    assert hidden_loss([10 * x for x in s], [10 * x for x in t], [0, 2]).item() == pytest.approx(ref, rel=1e-5)
    with pytest.raises(ValueError, match="layer map"):
        hidden_loss(s, t, [0, 1, 2])


def _hidden_error(student, teacher, blocks, layers) -> float:
    x = torch.as_tensor(blocks, dtype=torch.long)
    with torch.no_grad():
        hs = student(input_ids=x, use_cache=False, output_hidden_states=True).hidden_states
        ht = teacher(input_ids=x, use_cache=False, output_hidden_states=True).hidden_states
    return hidden_loss(hs, ht, layers).item()


def test_hidden_state_loss_pulls_each_layer_toward_the_teacher_layer_it_was_cut_from(trained_tiny4, tiny_splits,
                                                                                   tmp_path):
    from compress.config import PruneConfig
    from compress.prune import prune_model

    cfg_p = PruneConfig(enabled=True, method="structured", mlp_ratio=0.5, layer_ratio=0.25, sensitivity=False,
                        protected_layers=[0, -1])
    pruned, rep = prune_model(trained_tiny4, tiny_splits.calib, cfg_p)
    layers = rep.teacher_layers
    assert len(layers) == 3 and pruned.config.num_hidden_layers == 3
    cfg = _cfg(steps=40, lr=1e-3, alpha_start=1.0, alpha_end=1.0, eval_every=40, checkpoint_every=40)
    with pytest.raises(ValueError, match="no layer map"):
        distill(copy.deepcopy(pruned), trained_tiny4, tiny_splits, cfg.model_copy(update={"hidden_weight": 1.0}),
                tmp_path / "nomap", progress=False)
    before = _hidden_error(pruned, trained_tiny4, tiny_splits.selection, layers)
    logits_only = copy.deepcopy(pruned)
    distill(logits_only, trained_tiny4, tiny_splits, cfg, tmp_path / "kd", progress=False)
    logs: list[dict] = []
    with_hidden = copy.deepcopy(pruned)
    rep_h = distill(with_hidden, trained_tiny4, tiny_splits, cfg.model_copy(update={"hidden_weight": 1.0}),
                    tmp_path / "hidden", progress=False, teacher_layers=layers, on_log=lambda s, m: logs.append(m))
    kd_err = _hidden_error(logits_only, trained_tiny4, tiny_splits.selection, layers)
    hidden_err = _hidden_error(with_hidden, trained_tiny4, tiny_splits.selection, layers)
    # measured: 0.272 before, 0.245 after logits alone, 0.211 with the hidden-state term
    assert hidden_err < 0.9 * kd_err < 0.9 * before, (before, kd_err, hidden_err)
    train = [m for m in logs if "hidden_loss" in m]
    assert train[0]["hidden_loss"] > train[-1]["hidden_loss"] > 0
    assert train[0]["loss"] == pytest.approx(train[0]["kd_loss"] + train[0]["hidden_loss"], rel=1e-6)
    assert rep_h.kl_after < rep_h.kl_before  # the logit KD still does its part
    # the plan's map, not the identity: mapping student layer 2 to teacher layer 2 instead of 3 is another loss
    wrong = _hidden_error(with_hidden, trained_tiny4, tiny_splits.selection, list(range(3)))
    assert wrong != pytest.approx(hidden_err, rel=1e-3)


def test_hidden_weight_refuses_the_top_k_cache():
    with pytest.raises(ValueError, match="teacher_topk: 0 or hidden_weight: 0"):
        DistillConfig(hidden_weight=1.0, teacher_topk=64)
