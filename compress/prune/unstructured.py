"""Unstructured pruning (magnitude or Wanda) of the decoder's linear weights, optionally in a 2:4 pattern.

Prunable: q/k/v/o and gate/up/down of every decoder layer that is not protected.
Embeddings and the LM head (tied on SmolLM) stay dense. A mask is a bool tensor
shaped like the weight, True where the weight is kept.

Allocation of the target sparsity s:
* ``per_layer``: every prunable matrix loses exactly s of its weights (smallest |w|).
* ``global``: one |w| threshold over all prunable matrices; matrices with small
  weights lose more. Exact count overall, uneven per layer.
* ``sensitivity``: per (layer, attn|mlp) unit, s shifted by up to +-0.1 against the
  rank of the unit's calib loss increase (least sensitive pruned most), then
  re-centred so the parameter-weighted mean is s again (in the spirit of OWL).
* ``2:4`` pattern: in every group of 4 consecutive input weights of a row the 2
  smallest |w| go, so every matrix is exactly 50% sparse (needs sparsity 0.5).

Score (``prune.unstructured_score``): ``magnitude`` ranks by |w| within each matrix;
``wanda`` (Sun et al. 2023, arXiv:2306.11695) ranks by |w_ij| * ||x_j||, the weight
times the RMS of its input feature over the calib tokens, within each output row.
It sees the input outliers that make a small weight matter (SmolLM2's down_proj
inputs reach |x| ~ 3000), costs one forward pass, and on SmolLM2 at 50% it keeps
perplexity far closer to the teacher (docs/pruning.md).
"""

from __future__ import annotations

import torch

from compress.prune.structured import decoder_layers, linear_names

Masks = dict[str, torch.Tensor]


def prunable_weights(model, protected: set[int] | None = None) -> dict[str, tuple[int, str, torch.Tensor]]:
    """{parameter name: (layer index, 'attn'|'mlp', weight)} for the linear weights of unprotected layers."""
    out = {}
    protected = protected or set()
    attn_names, mlp_names = linear_names(model)  # Phi-3's are fused
    for i, layer in enumerate(decoder_layers(model)):
        if i in protected:
            continue
        for group, mod, names in (("attn", layer.self_attn, attn_names), ("mlp", layer.mlp, mlp_names)):
            for n in names:
                sub = "self_attn" if group == "attn" else "mlp"
                out[f"model.layers.{i}.{sub}.{n}.weight"] = (i, group, getattr(mod, n).weight)
    return out


@torch.no_grad()
def magnitude_mask(w: torch.Tensor, sparsity: float, per_row: bool = False) -> torch.Tensor:
    """Keep-mask dropping the round(sparsity * n) smallest-|w| entries of the matrix (or of each row)."""
    if per_row:
        k = int(round(sparsity * w.shape[1]))
        keep = torch.ones_like(w, dtype=torch.bool)
        if k > 0:
            idx = torch.topk(w.detach().abs().float(), k, dim=1, largest=False, sorted=False).indices
            keep.scatter_(1, idx, False)
        return keep
    k = int(round(sparsity * w.numel()))
    keep = torch.ones(w.numel(), dtype=torch.bool, device=w.device)
    if k > 0:
        idx = torch.topk(w.detach().abs().flatten().float(), k, largest=False, sorted=False).indices
        keep[idx] = False
    return keep.view_as(w)


@torch.no_grad()
def input_norms(model, blocks, batch_size: int = 4) -> dict[str, torch.Tensor]:
    """{weight name: L2 norm over the calib tokens of each input feature} for every decoder linear."""
    import numpy as np

    weights = prunable_weights(model)
    mods = {n: model.get_submodule(n.rsplit(".", 1)[0]) for n in weights}
    sq = {n: torch.zeros(m.in_features, dtype=torch.float64, device=m.weight.device) for n, m in mods.items()}

    def hook(name):
        def fn(mod, args):
            x = args[0].detach().float()
            sq[name] += x.pow(2).reshape(-1, x.shape[-1]).sum(0).double()
        return fn

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in mods.items()]
    dev = next(model.parameters()).device
    try:
        for s in range(0, len(blocks), batch_size):
            model(input_ids=torch.as_tensor(np.asarray(blocks[s : s + batch_size]), dtype=torch.long, device=dev),
                  use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {n: v.sqrt().float() for n, v in sq.items()}


@torch.no_grad()
def nm_mask(w: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """N:M keep-mask along the input dim: in each group of m consecutive weights of a row, keep the n largest."""
    rows, cols = w.shape
    if cols % m:
        raise ValueError(f"{n}:{m} sparsity needs the input dimension to be a multiple of {m}; a matrix has {cols}")
    g = w.detach().abs().float().reshape(rows, cols // m, m)
    top = g.topk(n, dim=-1).indices
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, top, True)
    return keep.reshape(rows, cols)


@torch.no_grad()
def global_masks(weights: dict[str, torch.Tensor], sparsity: float) -> Masks:
    """One magnitude threshold over all weights; exactly round(sparsity * total) entries go."""
    total = sum(w.numel() for w in weights.values())
    k = int(round(sparsity * total))
    if k == 0:
        return {n: torch.ones_like(w, dtype=torch.bool) for n, w in weights.items()}
    flat = torch.cat([w.detach().abs().flatten().float() for w in weights.values()])
    thr = torch.kthvalue(flat, k).values
    below = int((flat < thr).sum())
    ties_to_drop = k - below  # entries equal to thr that must also go, taken in order
    del flat
    masks = {}
    for n, w in weights.items():
        a = w.detach().abs().float()
        keep = a > thr
        eq = (a == thr).flatten()
        n_eq = int(eq.sum())
        if n_eq:
            take = min(n_eq, ties_to_drop)
            ties_to_drop -= take
            eq_idx = eq.nonzero().flatten()
            keep_flat = keep.flatten()
            keep_flat[eq_idx[take:]] = True
            keep = keep_flat.view_as(a)
        masks[n] = keep
    return masks


def sensitivity_allocation(units: dict[tuple[int, str], int], deltas: dict[tuple[int, str], float],
                           sparsity: float, spread: float = 0.1) -> dict[tuple[int, str], float]:
    """Per-unit sparsity around `sparsity`: least sensitive +spread, most -spread, param-weighted mean kept."""
    keys = sorted(units)
    if not keys:
        return {}
    if len(keys) == 1:
        return {keys[0]: sparsity}
    order = sorted(keys, key=lambda u: (deltas.get(u, 0.0), u))
    spread = min(spread, sparsity, 1 - sparsity)
    rank = {u: r / (len(order) - 1) for r, u in enumerate(order)}  # 0 = least sensitive
    s = {u: sparsity + spread * (1 - 2 * rank[u]) for u in keys}
    total = sum(units.values())
    for _ in range(20):  # re-centre, clip, repeat: converges in a few rounds
        mean = sum(s[u] * units[u] for u in keys) / total
        if abs(mean - sparsity) < 1e-6:
            break
        s = {u: min(0.99, max(0.0, s[u] + sparsity - mean)) for u in keys}
    return s


@torch.no_grad()
def compute_masks(model, sparsity: float, pattern: str = "none", allocation: str = "per_layer",
                  protected: set[int] | None = None, deltas: dict[tuple[int, str], float] | None = None,
                  norms: dict[str, torch.Tensor] | None = None) -> Masks:
    """Keep-masks for the prunable weights. norms (from input_norms) switch the score from |w| to Wanda's
    |w| * ||x|| compared within each output row (global allocation compares across all matrices)."""
    weights = prunable_weights(model, protected)
    if norms is not None:
        scores = {n: w.detach().abs().float() * norms[n].to(w.device)[None, :] for n, (_, _, w) in weights.items()}
    else:
        scores = {n: w for n, (_, _, w) in weights.items()}
    per_row = norms is not None
    if pattern == "2:4":
        return {n: nm_mask(sc) for n, sc in scores.items()}
    if pattern != "none":
        raise ValueError(f"prune.pattern {pattern!r}: allowed values are 'none', '2:4'")
    if allocation == "global":
        return global_masks(scores, sparsity)
    if allocation == "per_layer":
        return {n: magnitude_mask(sc, sparsity, per_row) for n, sc in scores.items()}
    if allocation == "sensitivity":
        if deltas is None:
            raise ValueError("prune.allocation 'sensitivity' needs a sensitivity report (prune.sensitivity=true)")
        units: dict[tuple[int, str], int] = {}
        for _, (i, g, w) in weights.items():
            units[(i, g)] = units.get((i, g), 0) + w.numel()
        alloc = sensitivity_allocation(units, deltas, sparsity)
        return {n: magnitude_mask(scores[n], alloc[(i, g)], per_row) for n, (i, g, _) in weights.items()}
    raise ValueError(f"prune.allocation {allocation!r}: allowed values are 'global', 'per_layer', 'sensitivity'")


@torch.no_grad()
def apply_masks(model, masks: Masks) -> None:
    """Zero every masked-out weight in place (call after each optimizer step to keep pruned weights at zero)."""
    for name, m in masks.items():
        p = model.get_parameter(name)
        p.mul_(m.to(device=p.device, dtype=p.dtype))


@torch.no_grad()
def unstructured_masks(model) -> Masks:
    """Keep-masks read back from a model: True where a decoder linear weight is non-zero."""
    return {n: w != 0 for n, (_, _, w) in prunable_weights(model).items()}


@torch.no_grad()
def sparsity_by_layer(model) -> tuple[dict[int, float], dict[str, float]]:
    """Share of exact zeros per decoder layer (its 7 linear weights) and per matrix."""
    per_layer_z: dict[int, list[int]] = {}
    per_matrix = {}
    for n, (i, _, w) in prunable_weights(model).items():
        z = int((w == 0).sum())
        per_matrix[n] = z / w.numel()
        acc = per_layer_z.setdefault(i, [0, 0])
        acc[0] += z
        acc[1] += w.numel()
    return {i: z / t for i, (z, t) in sorted(per_layer_z.items())}, per_matrix
