"""Reconstruction after structured pruning: re-fit the projection after each cut by least squares.

Removing MLP neurons (or KV groups) deletes columns of ``down_proj`` (``o_proj``); what the
removed units wrote into the residual stream is lost. Much of it is predictable from the units
that stay (their activations are correlated), so the kept columns are re-fitted to reproduce
the teacher's projection output on calibration tokens (FLAP, arXiv:2312.11983, and SlimGPT,
arXiv:2412.18110, compensate the same way):

    W' = argmin_W ||W_T x_T - W x_S||^2 + sum_j lambda_j ||W[:, j] - W_S[:, j]||^2
       = (W_T C + W_S Lambda) (G + Lambda)^-1,   C = sum x_T x_S^T,  G = sum x_S x_S^T

with x_T the teacher's full input to the projection and x_S the student's kept inputs at the
same tokens. The ridge pulls toward the plainly cut weights (not toward zero), so a strong ridge
falls back to plain pruning; ``lambda_j = ridge * G_jj`` is per input, because a few massive
activations (SmolLM2's down_proj inputs reach |x| ~ 3000) would make one shared lambda far too
strong for every other neuron. Sums and the solve are float64.

``inputs='teacher'`` (default) takes x_S as the teacher's activations restricted to the kept units
(one pass over the layers); ``inputs='student'`` fits layer by layer on the student's own activations,
whose earlier layers are already cut and re-fitted, so each layer also tries to correct what the layers
before it lost. On SmolLM2 at 25 % the teacher's inputs did better (perplexity 23.17 against 24.82, the
plain cut 25.77; docs/pruning.md): pairing the teacher's output with perturbed inputs asks a linear map
of local activations to undo upstream errors it cannot predict, and a few thousand calib tokens over-fit
that. Only the blocks handed in are read: give it the calib split.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from compress.prune.structured import StructuredPlan, decoder_layers

log = logging.getLogger(__name__)

INPUTS = ("student", "teacher")


@dataclass
class ReconstructionReport:
    """Per (student layer, projection): relative output error on the calib tokens, cut vs re-fitted."""

    ridge: float
    inputs: str
    tokens: int = 0
    seconds: float = 0.0
    rows: list[dict] = field(default_factory=list)  # layer, proj, rel_err_cut, rel_err_refit

    def mean(self, key: str, proj: str | None = None) -> float:
        v = [r[key] for r in self.rows if proj is None or r["proj"] == proj]
        return float(np.mean(v)) if v else 0.0

    def metrics(self) -> dict[str, float]:
        m = {"prune_recon_seconds": float(self.seconds), "prune_recon_tokens": float(self.tokens)}
        for proj in dict.fromkeys(r["proj"] for r in self.rows):
            m[f"prune_recon_{proj}_rel_err_cut"] = self.mean("rel_err_cut", proj)
            m[f"prune_recon_{proj}_rel_err_refit"] = self.mean("rel_err_refit", proj)
        return m

    def to_dict(self) -> dict:
        return {"ridge": self.ridge, "inputs": self.inputs, "tokens": self.tokens, "seconds": self.seconds,
                "rows": self.rows}


class _Fit:
    """Running sums for one projection: C = sum w x_T x_S^T, G = sum w x_S x_S^T, sum w ||y||^2 (float64).

    token_weight 'relative' weighs each token by 1 / ||y||^2 (its target's squared norm, floored at a tenth
    of the batch mean), so every token's *relative* error counts alike: without it the few attention-sink
    tokens whose activations are ~100x the others' dominate the sums, and the fit reproduces them at the
    expense of every ordinary token. 'none' = plain least squares.
    """

    def __init__(self, w_teacher: torch.Tensor, keep: torch.Tensor, token_weight: str = "relative"):
        self.wt = w_teacher.double()  # [out, in_full]
        self.keep = keep
        self.token_weight = token_weight
        k = len(keep)
        self.C = torch.zeros(self.wt.shape[1], k, dtype=torch.float64)
        self.G = torch.zeros(k, k, dtype=torch.float64)
        self.yy = 0.0
        self.n = 0

    def add(self, x_t: torch.Tensor, x_s: torch.Tensor) -> None:
        x_t = x_t.reshape(-1, x_t.shape[-1]).double().cpu()
        x_s = x_s.reshape(-1, x_s.shape[-1]).double().cpu()
        y2 = (x_t @ self.wt.T).pow(2).sum(-1)
        if self.token_weight == "relative":
            w = 1.0 / y2.clamp_min(0.1 * float(y2.mean()) + 1e-30)
            x_sw = x_s * w[:, None]
        else:
            w = torch.ones_like(y2)
            x_sw = x_s
        self.C += x_t.T @ x_sw
        self.G += x_s.T @ x_sw
        self.yy += float((y2 * w).sum())
        self.n += x_t.shape[0]

    def _err(self, w: torch.Tensor) -> float:
        # ||W_T x_T - W x_S||^2 summed over tokens, from the sums alone.
        cross = float((self.wt @ self.C * w).sum())
        quad = float((w @ self.G * w).sum())
        return max(self.yy - 2 * cross + quad, 0.0)

    def solve(self, w_cut: torch.Tensor, ridge: float) -> tuple[torch.Tensor, float, float]:
        """(re-fitted weight in w_cut's dtype, rel. error of the plain cut, rel. error after the fit)."""
        ws = w_cut.double().cpu()
        d = torch.diagonal(self.G)
        # Per-input ridge, with a floor so a neuron that never fired on calib keeps its cut weight.
        lam = ridge * d + 1e-8 * float(d.mean()) + 1e-12
        a = self.G + torch.diag(lam)
        b = self.wt @ self.C + ws * lam  # [out, k]
        w_new = torch.linalg.solve(a, b.T).T  # a symmetric: (b a^-1)^T = a^-1 b^T
        norm = max(self.yy, 1e-30)
        e_cut, e_new = self._err(ws) / norm, self._err(w_new) / norm
        if not torch.isfinite(w_new).all() or e_new > e_cut:
            # Never make a layer worse on the data it was fitted to (ill-conditioned G, too few tokens).
            return w_cut, e_cut, e_cut
        return w_new.to(dtype=w_cut.dtype, device=w_cut.device), e_cut, e_new


def _capture_inputs(module: torch.nn.Module, sink: list) -> torch.utils.hooks.RemovableHandle:
    return module.register_forward_pre_hook(lambda mod, args: sink.append(args[0].detach()))


def _run_layer(layer, h: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    out = layer(h, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _layer_inputs(model, blocks: np.ndarray, batch_size: int) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """Per batch: the hidden state entering layer 0, and per layer its other args and kwargs.

    Recorded per layer because families differ by layer: Gemma and Qwen2 give sliding-window layers
    another mask, Gemma 3 its local layers other rotary embeddings.
    """
    layers = decoder_layers(model)
    dev = next(model.parameters()).device
    h0: list[torch.Tensor] = []
    per_batch: list[list[tuple]] = []
    captured: dict[int, tuple] = {}

    def pre(i):
        def fn(mod, args, kwargs):
            kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if i == 0:
                h0.append((args[0] if args else kwargs["hidden_states"]).detach())
            captured[i] = (tuple(args[1:]), kw)
        return fn

    hooks = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for s in range(0, len(blocks), batch_size):
            x = torch.as_tensor(blocks[s : s + batch_size], dtype=torch.long, device=dev)
            captured.clear()
            model(input_ids=x, use_cache=False)
            per_batch.append([captured[i] for i in range(len(layers))])
    finally:
        for h in hooks:
            h.remove()
    return h0, per_batch


def _projections(plan: StructuredPlan, teacher_idx: int, n_rep: int, hd: int) -> list[tuple[str, torch.Tensor]]:
    """(attribute path, kept input columns) of the projections a layer's cut touches, in forward order."""
    out = []
    if teacher_idx in plan.keep_groups:
        cols = [g * n_rep * hd + k for g in plan.keep_groups[teacher_idx] for k in range(n_rep * hd)]
        out.append(("self_attn.o_proj", torch.tensor(cols, dtype=torch.long)))
    if teacher_idx in plan.keep_neurons:
        out.append(("mlp.down_proj", torch.tensor(plan.keep_neurons[teacher_idx], dtype=torch.long)))
    return out


@torch.no_grad()
def _refit(t_proj, s_layer, name: str, keep: torch.Tensor, t_in: list[torch.Tensor], *, ridge: float,
           token_weight: str, student_inputs: list | None) -> tuple[float, float]:
    """Re-fit the student's projection ``name`` of ``s_layer`` (in place) to reproduce the teacher's ``t_proj``
    outputs on the teacher's inputs ``t_in``, from the kept input channels of those (``student_inputs`` None) or
    from the student's own inputs (the student layer run on each (hidden, layer args) of ``student_inputs``).
    Returns the relative output error before and after."""
    s_proj = s_layer.get_submodule(name)
    fit = _Fit(t_proj.weight.detach(), keep, token_weight)
    if student_inputs is None:
        for x_t in t_in:
            fit.add(x_t, x_t[..., keep.to(x_t.device)])
    else:
        s_in: list[torch.Tensor] = []
        hk = _capture_inputs(s_proj, s_in)
        try:
            for h, args in student_inputs:
                _run_layer(s_layer, h, *args)
        finally:
            hk.remove()
        for x_t, x_s in zip(t_in, s_in):
            fit.add(x_t, x_s)
    w, e_cut, e_new = fit.solve(s_proj.weight.detach(), ridge)
    s_proj.weight.copy_(w)
    return e_cut, e_new


@torch.no_grad()
def reconstruct(teacher, student, plan: StructuredPlan, blocks: np.ndarray, ridge: float = 0.5,
                inputs: str = "teacher", batch_size: int = 4, *, token_weight: str = "relative") -> ReconstructionReport:
    """Re-fit, in place, student's o_proj / down_proj of every layer the plan cut (teacher unchanged).

    student must be teacher cut by apply_plan(student, plan); blocks are calibration token blocks.
    """
    if inputs not in INPUTS:
        raise ValueError(f"prune.reconstruct_inputs {inputs!r}: allowed values are {list(INPUTS)}")
    if ridge < 0:
        raise ValueError(f"prune.reconstruct_ridge {ridge}: must be >= 0")
    t0 = time.perf_counter()
    blocks = np.asarray(blocks)
    report = ReconstructionReport(ridge=ridge, inputs=inputs, tokens=int(blocks.size))
    t_layers, s_layers = decoder_layers(teacher), decoder_layers(student)
    if len(t_layers) != plan.num_layers or len(s_layers) != len(plan.kept_layers):
        raise ValueError("reconstruct: the student is not the teacher cut by this plan (layer counts differ)")
    teacher.eval()
    student.eval()
    # Both models share embeddings, rotary and masks, so the teacher's layer inputs serve both
    # (a student layer gets those of the teacher layer it was cut from).
    h0, per_batch = _layer_inputs(teacher, blocks, batch_size)
    h_t, h_s = list(h0), list(h0)
    s_idx = {old: new for new, old in enumerate(plan.kept_layers)}
    for i, t_layer in enumerate(t_layers):
        projs = _projections(plan, i, plan.n_rep, plan.head_dim) if i in s_idx else []
        # Teacher: this layer's projection inputs (kept to pair them with the student's) and its output.
        t_in: dict[str, list[torch.Tensor]] = {name: [] for name, _ in projs}
        hooks = [_capture_inputs(t_layer.get_submodule(name), t_in[name]) for name, _ in projs]
        try:
            h_t_next = [_run_layer(t_layer, h, *pb[i]) for h, pb in zip(h_t, per_batch)]
        finally:
            for hk in hooks:
                hk.remove()
        if i not in s_idx:  # dropped layer: the student skips it
            h_t = h_t_next
            continue
        s_layer = s_layers[s_idx[i]]
        for name, keep in projs:
            e_cut, e_new = _refit(t_layer.get_submodule(name), s_layer, name, keep, t_in[name], ridge=ridge,
                                  token_weight=token_weight,
                                  student_inputs=[(h, pb[i]) for h, pb in zip(h_s, per_batch)]
                                  if inputs == "student" else None)
            report.rows.append({"layer": s_idx[i], "proj": name.split(".")[-1], "rel_err_cut": e_cut,
                                "rel_err_refit": e_new})
        if inputs == "student":  # teacher inputs need no student activations: one pass in all
            h_s = [_run_layer(s_layer, h, *pb[i]) for h, pb in zip(h_s, per_batch)]
        h_t = h_t_next
    report.seconds = time.perf_counter() - t0
    log.info("reconstruction: %d projections re-fitted in %.1f s, mean rel. error %.4f -> %.4f",
             len(report.rows), report.seconds, report.mean("rel_err_cut"), report.mean("rel_err_refit"))
    return report
