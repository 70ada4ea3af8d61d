"""The KD loss fused with the LM head, chunk by chunk: full-vocabulary logits are never materialised whole.

The plain path (compress/distill/loss.py::kd_loss) takes [batch, seq, vocab] logits of both models: on SmolLM2 a
4 x 128 micro-batch is 100 MB of fp32 logits each, log-softmaxed, differenced and kept for the backward, which made
the loss a quarter of a CPU step. Here the student and the teacher hand over their last hidden states; per chunk of
positions (one sequence, or a slice of a long one) the head's matmul makes the chunk's logits, and the loss and its
gradient with respect to those logits are computed in the same pass, in closed form::

    d/dz [alpha * T^2 * KL(p_t || softmax(z / T))] = alpha * T * (softmax(z / T) - p_t)
    d/dz [(1 - alpha) * CE(z, y)]                  = (1 - alpha) * (softmax(z) - onehot(y))

(each divided by the positions that count). The chunk's gradient then goes straight into the hidden states' and the
head's gradients (two matmuls), so the backward has nothing left to do but scale them. With bf16 (``compute_dtype``)
the three matmuls run in bf16 and the softmaxes in fp32, as autocast would do them.

``split_head(model)`` gives (body, head weight) only where the model's logits are exactly ``head(body(x))``
(checked numerically once: a family with logit soft-capping or scaling falls back to the plain path).
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from compress.distill.loss import TopK

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 24  # logits per chunk at most: 64 MB in fp32, a few times that with the chunk's temporaries
GROUP_ELEMENTS = 1 << 26  # gradient rows per group at most: 128 MB in bf16


class KDBody(torch.nn.Module):
    """A causal LM cut before its LM head: ``forward(input_ids, hidden_states)`` gives the last hidden state (and all
    of them when asked); ``weight`` is the head. DDP wraps this module, so the ranks' gradients still meet."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.lm.get_output_embeddings().weight

    def forward(self, input_ids: torch.Tensor, hidden_states: bool = False):
        base = getattr(self.lm, self.lm.base_model_prefix)
        out = base(input_ids=input_ids, use_cache=False, output_hidden_states=hidden_states)
        return out.last_hidden_state, (out.hidden_states if hidden_states else None)


def split_head(model, probe: torch.Tensor) -> KDBody | None:
    """The model as body + head when its logits are ``last_hidden @ head.weight.T`` (checked on ``probe``), or None
    (no separate bias-free linear head, or a family that scales or caps its logits)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None \
            or getattr(model, getattr(model, "base_model_prefix", ""), None) is None:
        return None
    cut = KDBody(model)
    with torch.no_grad():
        ref = model(input_ids=probe, use_cache=False).logits.float()
        mine = cut(probe)[0].float() @ head.weight.float().T
    if not torch.allclose(mine, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()) + 1e-5):
        log.info("distill: %s's logits are not its head applied to its last hidden state; the plain KD loss is used",
                 type(model).__name__)
        return None
    return cut


class TeacherRows:
    """The teacher's side of the loss, served per chunk of positions: full logits, hidden states times its head
    (logits made per chunk), or its cached top-k."""

    def __init__(self, logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, topk: TopK | None = None):
        self.logits, self.hidden, self.topk = logits, hidden, topk
        self.weight = weight.to(hidden.dtype) if weight is not None and hidden is not None else weight

    @classmethod
    def of(cls, teacher: "torch.Tensor | TopK | TeacherRows") -> "TeacherRows":
        """Rows of [batch, seq, vocab] logits or top-k, flattened to [positions, ...]; TeacherRows as they are."""
        if isinstance(teacher, TeacherRows):
            return teacher
        if isinstance(teacher, TopK):
            k = teacher.values.shape[-1]
            return cls(topk=TopK(teacher.values.reshape(-1, k), teacher.indices.reshape(-1, k)))
        return cls(logits=teacher.reshape(-1, teacher.shape[-1]))

    def rows(self, a: int, b: int) -> torch.Tensor | TopK:
        """Positions [a, b): logits in the dtype they come in (the loss upcasts them), or the top-k."""
        if self.topk is not None:
            return TopK(self.topk.values[a:b], self.topk.indices[a:b].long())
        if self.logits is not None:
            return self.logits[a:b]
        return self.hidden[a:b] @ self.weight.T


def _dense_chunk(z: torch.Tensor, zt: torch.Tensor, y: torch.Tensor, T: torch.Tensor, alpha: torch.Tensor,
                 scale: torch.Tensor):
    """KL and CE sums of one chunk of positions and d(loss)/dz in z's dtype: the form torch.compile fuses into one
    loop over the vocabulary (every operation pure; the one-hot as a comparison with the column index)."""
    zf, ztf = z.float(), zt.float()
    lpt = torch.log_softmax(ztf / T, -1)
    pt = lpt.exp()
    lps = torch.log_softmax(zf / T, -1)
    kl = (pt * (lpt - lps)).sum()
    lse = torch.logsumexp(zf, -1, keepdim=True)
    ce = (lse.squeeze(-1) - zf.gather(1, y[:, None]).squeeze(-1)).sum()
    hit = (torch.arange(zf.shape[-1], device=zf.device)[None, :] == y[:, None]).to(zf.dtype)
    g = (lps.exp() - pt) * (alpha * T * scale) + ((zf - lse).exp() - hit) * ((1 - alpha) * scale)
    return kl, ce, g.to(z.dtype)


def _dense_chunk_eager(z: torch.Tensor, zt: torch.Tensor, y: torch.Tensor, T: float, alpha: float, scale: float):
    """_dense_chunk for eager mode: in place where it can be, the one-hot subtracted at the labels alone."""
    zf = z.float()
    lpt = torch.log_softmax(zt.float().div_(T), -1)
    pt = lpt.exp()
    lps = torch.log_softmax(zf / T, -1)
    kl = torch.linalg.vecdot(pt, lpt.sub_(lps)).sum()
    lse = torch.logsumexp(zf, -1, keepdim=True)
    ce = (lse.squeeze(-1) - zf.gather(1, y[:, None]).squeeze(-1)).sum()
    g = lps.exp_().sub_(pt).mul_(alpha * T * scale)
    if alpha < 1.0:
        g.add_(zf.sub_(lse).exp_(), alpha=(1 - alpha) * scale)
        g[torch.arange(len(y), device=g.device), y] -= (1 - alpha) * scale
    return kl, ce, g.to(z.dtype)


def _topk_chunk(z: torch.Tensor, top: TopK, y: torch.Tensor, T: float, alpha: float, scale: float):
    """As _dense_chunk against the teacher renormalised over its top k (compress/distill/loss.py's TopK rule)."""
    zf = z.float()
    lpt = torch.log_softmax(top.values.float() / T, -1)
    pt = lpt.exp()
    lps = torch.log_softmax(zf / T, -1)
    kl = (pt * (lpt - lps.gather(1, top.indices))).sum()
    lse = torch.logsumexp(zf, -1, keepdim=True)
    ce = (lse.squeeze(-1) - zf.gather(1, y[:, None]).squeeze(-1)).sum()
    g = lps.exp_().mul_(alpha * T * scale)
    g.scatter_add_(1, top.indices, pt * (-alpha * T * scale))
    if alpha < 1.0:
        g.add_(zf.sub_(lse).exp_(), alpha=(1 - alpha) * scale)
        g[torch.arange(len(y), device=g.device), y] -= (1 - alpha) * scale
    return kl, ce, g.to(z.dtype)


_compiled: list[Callable] = []


def _compiled_dense() -> Callable:
    if not _compiled:
        _compiled.append(torch.compile(_dense_chunk, dynamic=False))
    return _compiled[0]


def chunk_rows(seq: int, vocab: int) -> int:
    """Positions per chunk: whole sequences where they fit in CHUNK_ELEMENTS logits (so chunks keep one shape and a
    DDP rank's chunks are the single process's), else an even slice of one."""
    most = max(1, CHUNK_ELEMENTS // vocab)
    if seq <= most:
        return seq * (most // seq)
    return -(-seq // -(-seq // most))


class _LossSettings(NamedTuple):
    T: float
    alpha: float
    rows: int  # positions per chunk (chunk_rows)
    compute_dtype: torch.dtype
    compile_loss: bool


class _FusedKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, teacher: TeacherRows, labels, s: _LossSettings):
        T, alpha, rows, compute_dtype = s.T, s.alpha, s.rows, s.compute_dtype
        n, vocab = h.shape[0], weight.shape[0]
        dev = h.device
        hc, wc = h.detach().to(compute_dtype), weight.detach().to(compute_dtype)
        grad_h = torch.empty(h.shape, dtype=h.dtype, device=dev)
        grad_w = None
        if s.compile_loss:
            dense = _compiled_dense()
            consts = tuple(torch.tensor(v, dtype=torch.float32, device=dev) for v in (T, alpha, 1.0 / n))
        else:
            dense, consts = _dense_chunk_eager, (T, alpha, 1.0 / n)
        kl = ce = torch.zeros((), dtype=torch.float32, device=dev)
        # Gradient rows are gathered per group and multiplied into the hidden and head gradients together: one
        # [vocab x hidden] product per group instead of one per chunk.
        group = max(rows, GROUP_ELEMENTS // vocab // rows * rows)
        with torch.autocast(dev.type, enabled=False):
            for g0 in range(0, n, group):
                g1 = min(g0 + group, n)
                grads = torch.empty(g1 - g0, vocab, dtype=compute_dtype, device=dev)
                for a in range(g0, g1, rows):
                    b = min(a + rows, g1)
                    z, t_rows, y = hc[a:b] @ wc.T, teacher.rows(a, b), labels[a:b]
                    if isinstance(t_rows, TopK):
                        k_sum, c_sum, g = _topk_chunk(z, t_rows, y, T, alpha, 1.0 / n)
                    else:
                        k_sum, c_sum, g = dense(z, t_rows, y, *consts)
                    grads[a - g0:b - g0] = g
                    kl, ce = kl + k_sum, ce + c_sum
                grad_h[g0:g1] = grads @ wc
                part = grads.T @ hc[g0:g1]
                grad_w = part.float() if grad_w is None else grad_w.add_(part)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        kl, ce = kl / n, ce / n
        ctx.mark_non_differentiable(kl, ce)
        return alpha * T * T * kl + (1.0 - alpha) * ce, kl, ce

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_ce):
        grad_h, grad_w = ctx.saved_tensors
        if not bool(grad_loss == 1):  # a loss scaler's factor, or a caller's weight
            grad_h, grad_w = grad_h * grad_loss, grad_w * grad_loss
        return grad_h, grad_w, None, None, None


def fused_kd_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher: TeacherRows, labels: torch.Tensor, T: float,
                  alpha: float, *, seq: int, compute_dtype: torch.dtype = torch.float32,
                  compile_loss: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """kd_loss's value and parts for ``hidden`` [positions, hidden] (the student's last hidden states at the
    positions that are scored, sequence after sequence of ``seq``) and its head ``weight`` [vocab, hidden], against
    ``teacher``'s rows for the same positions and ``labels`` [positions]. Every position counts (training blocks
    carry no padding). The loss's backward gives the hidden states and the head their gradients."""
    settings = _LossSettings(T, alpha, chunk_rows(seq, weight.shape[0]), compute_dtype, compile_loss)
    loss, kl, ce = _FusedKD.apply(hidden, weight, teacher, labels, settings)
    kl_f, ce_f = kl.item(), ce.item()
    return loss, {"kl": kl_f, "kd_loss": T * T * kl_f, "ce_loss": ce_f,
                  "loss": alpha * T * T * kl_f + (1.0 - alpha) * ce_f}
