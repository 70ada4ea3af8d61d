"""The fast KD loop on tiny models: the fused loss against the plain one, bf16 against fp32 within a derived bound,
the families that must fall back, the token budget, its plan and its refusal."""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch

from compress.config import DistillConfig
from compress.distill import fused
from compress.distill.fused import KDBody, TeacherRows, fused_kd_loss, split_head
from compress.distill.loss import TopK, kd_loss
from compress.distill.report import DistillError
from compress.distill.train import distill
from compress.loading.tiny import build_tiny, build_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair():
    """(student, teacher): two tiny Llamas with other seeds. Read-only."""
    return build_tiny_llama(seed=1)[0], build_tiny_llama(seed=0)[0]


def _plain(student, teacher_logits, x, T, alpha):
    loss, parts = kd_loss(student(input_ids=x, use_cache=False).logits[:, :-1], teacher_logits, x[:, 1:], None, T, alpha)
    loss.backward()
    return parts, {n: p.grad.clone() for n, p in student.named_parameters()}


@pytest.mark.parametrize("teacher_form", ["hidden", "logits", "topk"])
@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_fused_loss_is_the_plain_loss_with_the_same_gradients(pair, tiny_splits, monkeypatch, teacher_form, alpha):
    # chunks of 10 positions (a 31-position sequence is cut into slices) in groups of 40: every path of the loop
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 512 * 10)
    monkeypatch.setattr(fused, "GROUP_ELEMENTS", 512 * 40)
    student, teacher = copy.deepcopy(pair[0]), pair[1]
    x = torch.as_tensor(tiny_splits.train[:4], dtype=torch.long)
    T = 2.5
    with torch.no_grad():
        t_logits = teacher(input_ids=x, use_cache=False).logits[:, :-1]
        t_hidden = KDBody(teacher)(x)[0][:, :-1]
    if teacher_form == "topk":
        top = t_logits.topk(40, dim=-1)
        t_plain, rows = TopK(top.values, top.indices), TeacherRows.of(TopK(top.values, top.indices.to(torch.int32)))
    elif teacher_form == "logits":
        t_plain, rows = t_logits, TeacherRows.of(t_logits)
    else:
        t_plain, rows = t_logits, TeacherRows(hidden=t_hidden.reshape(-1, 64), weight=teacher.lm_head.weight)
    ref_parts, ref_grads = _plain(student, t_plain, x, T, alpha)
    student.zero_grad()

    cut = split_head(student, x[:1, :8])
    assert cut is not None
    last, _ = cut(x)
    loss, parts = fused_kd_loss(last[:, :-1].reshape(-1, 64), cut.weight, rows, x[:, 1:].reshape(-1), T, alpha,
                                seq=x.shape[1] - 1)
    loss.backward()
    for k in ("kl", "kd_loss", "ce_loss", "loss"):
        assert parts[k] == pytest.approx(ref_parts[k], rel=1e-5), k
    for n, p in student.named_parameters():
        scale = ref_grads[n].abs().max().item()
        assert (p.grad - ref_grads[n]).abs().max().item() <= 1e-4 * scale + 1e-9, n


def test_compiled_chunk_is_the_eager_chunk():
    gen = torch.Generator().manual_seed(0)
    z, zt = torch.randn(62, 512, generator=gen) * 3, torch.randn(62, 512, generator=gen) * 3
    y = torch.randint(0, 512, (62,), generator=gen)
    T, alpha, scale = 2.0, 0.7, 1 / 62
    want = fused._dense_chunk_eager(z.clone(), zt.clone(), y, T, alpha, scale)
    got = fused._compiled_dense()(z, zt, y, *(torch.tensor(v) for v in (T, alpha, scale)))
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-5)
    assert got[1].item() == pytest.approx(want[1].item(), rel=1e-5)
    assert torch.allclose(got[2], want[2], atol=1e-7)
    assert (want[2][torch.arange(62), y] < 0).any()  # the one-hot term is in both


def test_families_whose_logits_are_not_the_head_keep_the_plain_loss(tiny_splits):
    x = torch.as_tensor(tiny_splits.train[:1, :8], dtype=torch.long)
    capped = build_tiny("gemma2", seed=0)[0]  # final_logit_softcapping = 30
    assert split_head(capped, x) is None
    for family in ("gemma3", "qwen3", "phi3", "gpt_neox"):
        assert isinstance(split_head(build_tiny(family, seed=0)[0], x), KDBody), family


def _kd_parts(logits_s, logits_t, y, T, alpha):
    zs, zt = logits_s.detach().clone().requires_grad_(), logits_t.detach().clone().requires_grad_()
    loss, _ = kd_loss(zs, zt, y, None, T, alpha)
    loss.backward()
    return loss.item(), zs.grad, zt.grad


def test_bf16_loss_is_the_fp32_loss_within_the_bound_its_rounding_gives(pair, tiny_splits):
    """bf16 moves each logit by some measured delta; to first order the loss then moves by at most
    sum over positions of |dL/dz|_1 * max|delta z|, for the student's and the teacher's logits. Twice that bound
    (room for the second-order terms) is the tolerance; it must also be small against the loss, or the test
    could not fail."""
    student, teacher = pair
    x = torch.as_tensor(tiny_splits.train[:4], dtype=torch.long)
    y, T, alpha = x[:, 1:], 2.0, 0.8
    with torch.no_grad():
        zs, zt = (m(input_ids=x, use_cache=False).logits[:, :-1] for m in (student, teacher))
    l32, gs, gt = _kd_parts(zs, zt, y, T, alpha)

    t16 = copy.deepcopy(teacher).to(torch.bfloat16)
    s_cut, t_cut = split_head(student, x[:1, :8]), KDBody(t16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        last_s, last_t = s_cut(x)[0][:, :-1].reshape(-1, 64), t_cut(x)[0][:, :-1].reshape(-1, 64)
    w16 = student.lm_head.weight.to(torch.bfloat16)
    zs16 = (last_s.to(torch.bfloat16) @ w16.T).float().reshape(zs.shape)
    zt16 = (last_t @ t16.lm_head.weight.T).float().reshape(zt.shape)
    d_s, d_t = (zs16 - zs).abs().amax(-1), (zt16 - zt).abs().amax(-1)
    bound = (gs.abs().sum(-1) * d_s).sum().item() + (gt.abs().sum(-1) * d_t).sum().item()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        last = s_cut(x)[0]
    loss16, _ = fused_kd_loss(last[:, :-1].reshape(-1, 64), s_cut.weight,
                              TeacherRows(hidden=last_t, weight=t16.lm_head.weight), y.reshape(-1), T, alpha,
                              seq=x.shape[1] - 1, compute_dtype=torch.bfloat16)
    assert d_s.max() > 0 and loss16.item() != l32  # bf16 did run
    assert 2 * bound < 0.05 * l32
    assert abs(loss16.item() - l32) <= 2 * bound


def _cfg(**kw) -> DistillConfig:
    base = dict(lr=3e-3, batch_size=4, eval_every=4, checkpoint_every=4, early_stop_patience=0, device="cpu",
                amp="off", t_start=2.0, t_end=1.0, compile="off")
    return DistillConfig(**{**base, **kw})


def test_compile_auto_counts_a_token_budget(pair):
    """distill.compile auto pays back its compile from COMPILE_MIN_TOKENS training tokens, whether the budget is
    given in steps or in tokens (a 1M-token run once trained uncompiled at half speed: steps kept its default)."""
    from compress.distill.distributed import Rank
    from compress.distill.train import COMPILE_MIN_TOKENS, _resolve_compile

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler for inductor")
    cut = KDBody(pair[0])
    cpu = torch.device("cpu")
    positions = 127
    small = DistillConfig(steps=10, batch_size=4, compile="auto")
    assert small.steps * small.batch_size * positions < COMPILE_MIN_TOKENS
    assert not _resolve_compile(small, cpu, cut, Rank(), positions)
    assert _resolve_compile(small.model_copy(update={"tokens": COMPILE_MIN_TOKENS}), cpu, cut, Rank(), positions)
    assert not _resolve_compile(small.model_copy(update={"tokens": COMPILE_MIN_TOKENS - 1}), cpu, cut, Rank(),
                                positions)
    assert _resolve_compile(small.model_copy(update={"compile": "on"}), cpu, cut, Rank(), positions)


def test_a_token_budget_is_planned_and_leaves_no_trace(pair, tiny_splits, tmp_path):
    student, teacher = pair
    tokens = 1000  # 4 blocks of 31 scored positions a step: 124 tokens, so 9 steps (8.06 rounded up)
    planned = copy.deepcopy(student)
    rep = distill(planned, teacher, tiny_splits, _cfg(tokens=tokens), tmp_path / "tokens", progress=False)
    assert rep.steps == math.ceil(tokens / 124) == 9
    plan = rep.plan
    assert plan["steps"] == 9 and plan["tokens"] == tokens and plan["tokens_per_step"] == 124
    assert plan["seconds_per_step"] > 0 and plan["eval_seconds"] > 0 and plan["evals"] == 3  # steps 4, 8, 9
    assert rep.metrics()["distill_planned_seconds"] == plan["estimate_seconds"] > 0
    # The probe steps ran at learning rate 0 on an optimizer put back afterwards: the same 9 steps without a token
    # budget train to the same losses and weights.
    stepped = copy.deepcopy(student)
    ref = distill(stepped, teacher, tiny_splits, _cfg(steps=9), tmp_path / "steps", progress=False)
    assert [h["loss"] for h in rep.history] == [h["loss"] for h in ref.history]
    assert all(torch.equal(a, b) for a, b in zip(planned.state_dict().values(), stepped.state_dict().values()))
    assert not ref.plan


def test_a_token_budget_the_device_cannot_keep_is_refused_with_the_figures(pair, tiny_splits, tmp_path):
    student, teacher = pair
    with pytest.raises(DistillError) as err:
        distill(copy.deepcopy(student), teacher, tiny_splits, _cfg(tokens=10**7, max_minutes=0.5), tmp_path,
                progress=False)
    msg = str(err.value)
    for part in ("distill.tokens: 10,000,000 tokens = 80646 steps", "tokens/s", "distill.max_minutes = 0.5",
                 "distill.device: cuda", "lower distill.tokens to about", "raise distill.max_minutes to"):
        assert part in msg, (part, msg)
