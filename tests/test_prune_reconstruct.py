"""Reconstruction after structured pruning (compress/prune/reconstruct.py) on a trained tiny Llama.

The re-fit must bring the cut layers' outputs closer to the teacher's on tokens it was not fitted
on (the eval blocks), and the student's eval perplexity must be no worse than the plain cut's.
"""

from __future__ import annotations

import json

import pytest
import torch

from compress.config import PruneConfig
from compress.prune import prune_model
from compress.prune.structured import decoder_layers
from compress.evaluate.torch_eval import perplexity


def _cfg(**kw) -> PruneConfig:
    base = dict(enabled=True, method="structured", mlp_ratio=0.5, head_ratio=0.5, layer_ratio=0.0,
                protected_layers=[], sensitivity=False)
    return PruneConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def teacher(trained_tiny4, one_torch_thread):
    """The trained 4-layer tiny Llama (conftest): random weights have no structure to keep."""
    return trained_tiny4


@pytest.fixture(scope="module")
def calib(tiny_splits):
    # 32 x 32 tokens: enough for the 64-wide re-fit (the 8 fixture calib blocks, 256 tokens, over-fit it).
    return tiny_splits.train[:32]


@pytest.fixture(scope="module")
def students(teacher, calib):
    """(plain cut, re-fitted on the student's inputs, re-fitted on the teacher's inputs), same plan."""
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    out = {name: prune_model(teacher, calib, _cfg(**kw)) for name, kw in {
        "cut": dict(reconstruct=False),
        "student": dict(reconstruct=True, reconstruct_inputs="student"),
        "teacher": dict(reconstruct=True, reconstruct_inputs="teacher"),
    }.items()}
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())  # teacher untouched
    return out


@torch.no_grad()
def _logit_mse(a, b, blocks) -> float:
    x = torch.as_tensor(blocks, dtype=torch.long)
    return float((a(input_ids=x).logits - b(input_ids=x).logits).pow(2).mean())


@torch.no_grad()
def _proj_io(model, blocks, name: str) -> list[torch.Tensor]:
    """Each layer's input to the projection `name` (e.g. mlp.down_proj) on blocks."""
    seen: list[torch.Tensor] = []
    hooks = [l.get_submodule(name).register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
             for l in decoder_layers(model)]
    try:
        model(input_ids=torch.as_tensor(blocks, dtype=torch.long))
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_refit_lowers_each_layers_error_on_held_out_tokens(teacher, students, tiny_splits):
    """Per layer, on eval tokens (never fitted on): ||W_T x - W' x_kept|| < ||W_T x - W_cut x_kept||."""
    plan = students["cut"][1].plan
    for proj, keep_of in (("mlp.down_proj", lambda i: plan.keep_neurons[i]),
                          ("self_attn.o_proj", lambda i: [g * plan.n_rep * plan.head_dim + k for g in plan.keep_groups[i]
                                                          for k in range(plan.n_rep * plan.head_dim)])):
        xs = _proj_io(teacher, tiny_splits.selection, proj)
        for i, x in enumerate(xs):
            keep = torch.tensor(keep_of(i))
            y = x @ decoder_layers(teacher)[i].get_submodule(proj).weight.detach().T
            err = {}
            for name in ("cut", "teacher"):
                w = decoder_layers(students[name][0])[i].get_submodule(proj).weight
                err[name] = float((y - x[:, keep] @ w.detach().T).norm() / y.norm())
            assert err["teacher"] < err["cut"], (proj, i, err)


def test_refit_keeps_the_model_closer_and_perplexity_no_worse(teacher, students, tiny_splits):
    ev = tiny_splits.selection
    mse = {k: _logit_mse(s, teacher, ev) for k, (s, _) in students.items()}
    ppl = {k: perplexity(s, ev) for k, (s, _) in students.items()}
    assert mse["student"] < 0.9 * mse["cut"] and mse["teacher"] < 0.9 * mse["cut"], mse
    assert ppl["student"] <= ppl["cut"] and ppl["teacher"] <= ppl["cut"], ppl
    # The report: every cut projection of every layer, error on the calib tokens down.
    rec = students["student"][1].reconstruction
    assert {(r["layer"], r["proj"]) for r in rec.rows} == {(i, p) for i in range(4) for p in ("o_proj", "down_proj")}
    assert all(r["rel_err_refit"] < r["rel_err_cut"] for r in rec.rows), rec.rows
    m = students["student"][1].metrics()
    assert m["prune_recon_down_proj_rel_err_refit"] < m["prune_recon_down_proj_rel_err_cut"]
    assert students["cut"][1].reconstruction is None


def test_refit_with_dropped_layers_and_a_huge_ridge(teacher, calib, tiny_splits):
    """Layers dropped: the re-fit pairs the teacher's kept layers with the student's; a huge ridge = the plain cut."""
    cut, _ = prune_model(teacher, calib, _cfg(head_ratio=0.0, layer_ratio=0.25, reconstruct=False))
    fit, rep = prune_model(teacher, calib, _cfg(head_ratio=0.0, layer_ratio=0.25))
    assert len(decoder_layers(fit)) == 3 and [r["layer"] for r in rep.reconstruction.rows] == [0, 1, 2]
    assert _logit_mse(fit, teacher, tiny_splits.selection) < _logit_mse(cut, teacher, tiny_splits.selection)
    stiff, _ = prune_model(teacher, calib, _cfg(head_ratio=0.0, reconstruct_ridge=1e9))
    plain, _ = prune_model(teacher, calib, _cfg(head_ratio=0.0, reconstruct=False))
    for a, b in zip(decoder_layers(stiff), decoder_layers(plain)):
        torch.testing.assert_close(a.mlp.down_proj.weight, b.mlp.down_proj.weight, rtol=1e-5, atol=1e-6)
    assert json.loads(json.dumps(rep.to_dict()))["reconstruction"]["inputs"] == "teacher"
