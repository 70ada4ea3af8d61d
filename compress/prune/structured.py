"""Structured pruning of Llama-style decoders: MLP neurons, KV-head groups and whole layers.

Families (``SUPPORTED_MODEL_TYPES``): Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3. QK-norm weights
(Qwen3, Gemma 3) are per head dimension and shared by the heads, so cutting heads leaves them alone;
Gemma's extra norms act on the hidden size, which pruning keeps; Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` are cut by slicing the rows of each part. Other families are refused naming why
(``REFUSED``).

Also home of the helpers the other pruning modules share (architecture check,
layer access, calibration loss), so the import graph stays one-way:
``structured`` <- ``unstructured`` <- ``sensitivity`` <- ``stage`` (and ``reconstruct`` <- ``stage``).

Importance (default ``activation``, as in Minitron, arXiv:2407.14679), measured
in one forward pass over the calib blocks:

* MLP neuron j of layer l: RMS over calib tokens of its activation
  ``act(gate_j(x)) * up_j(x)`` times the L2 norm of column j of ``down_proj``,
  i.e. the RMS size of what the neuron adds to the residual stream. Minitron uses
  the activation alone; the column norm makes the score invariant to moving a
  scale between ``up_proj`` and ``down_proj`` and costs nothing.
* KV group g of layer l (one KV head and the query heads that share it): RMS over
  tokens of the L2 norm of the group's output after ``o_proj``.
* Layer l: Block Influence, mean over tokens of ``1 - cos(h_in, h_out)``
  (ShortGPT / Minitron depth pruning); a sensitivity report, when given, ranks by
  the measured calib loss increase instead.

``weight_norm`` ranks neurons by ``||down[:, j]|| * ||up[j]||`` and groups by
``||o[:, g]||_F * ||v[g]||_F``, without data; layers still need the activation
score (weights say nothing about how much a layer changes the residual).

transformers' Llama config has one ``intermediate_size`` and one head count for
all layers, so the *count* is the same in every layer while *which* neurons and
heads go is chosen per layer. Protected layers are never dropped; they lose the
same number of neurons/heads as the others (a per-layer width would need a
custom config class, which ``from_pretrained`` and the exporter do not know).

One job, one module although over 400 lines: structured pruning end to end (score, plan,
slice or mask, restore). Score, plan and apply share the per-layer geometry and index
conventions, and the shared helpers at the top live here on purpose (the one-way import
graph above); a split would only move them into a module every pruning module imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# Phi-3 fuses q/k/v and gate/up into one Linear each.
FUSED_ATTN_LINEARS = ("qkv_proj", "o_proj")
FUSED_MLP_LINEARS = ("gate_up_proj", "down_proj")
FUSED_MODEL_TYPES = ("phi3",)
REFUSED = {
    "gpt_neox": "its layers are gpt_neox.layers with a head-interleaved fused query_key_value (MHA: a head is "
                "its own KV group), dense_h_to_4h/dense_4h_to_h MLPs and a parallel residual; this module "
                "cuts model.model.layers of Llama-style decoders only",
    "gpt2": "its Conv1D c_attn/c_proj/c_fc are [in, out] fused matrices under transformer.h; this module "
            "cuts model.model.layers of Llama-style decoders only",
}
# Kept MLP widths are rounded to this multiple (when the original width is one) for kernel-friendly shapes
# and so that 2:4 sparsity can follow a structured prune.
NEURON_MULTIPLE = 8


class UnsupportedArchitectureError(ValueError):
    """Pruning was asked of a model family it does not know how to cut."""


# ---------------------------------------------------------------- shared helpers


def architecture_name(model) -> str:
    cfg = getattr(model, "config", None)
    archs = getattr(cfg, "architectures", None) or [type(model).__name__]
    return f"{archs[0]} (model_type {getattr(cfg, 'model_type', None)!r})"


def check_supported(model) -> None:
    """Raise UnsupportedArchitectureError unless model is a Llama-family causal LM we can cut."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        why = f" ({REFUSED[mt]})" if mt in REFUSED else ""
        raise UnsupportedArchitectureError(
            f"pruning does not support {architecture_name(model)}{why}: supported are Llama-style decoders "
            f"(model_type {', '.join(SUPPORTED_MODEL_TYPES)}; SmolLM is llama). "
            f"Set prune.enabled=false for this model."
        )
    attn_names, mlp_names = linear_names(model)
    try:
        layers = decoder_layers(model)
        for layer in layers:
            for n in attn_names:
                assert isinstance(getattr(layer.self_attn, n), nn.Linear)
            for n in mlp_names:
                assert isinstance(getattr(layer.mlp, n), nn.Linear)
    except (AttributeError, AssertionError):
        raise UnsupportedArchitectureError(
            f"pruning expected model.model.layers[i].self_attn.{attn_names} and .mlp.{mlp_names} "
            f"as nn.Linear in {architecture_name(model)}; this checkpoint's modules differ (quantized or custom code?)"
        ) from None


def linear_names(model) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(attention, MLP) Linear names of a layer: Phi-3's are fused."""
    if getattr(model.config, "model_type", None) in FUSED_MODEL_TYPES:
        return FUSED_ATTN_LINEARS, FUSED_MLP_LINEARS
    return ATTN_LINEARS, MLP_LINEARS


def _up_weight(layer) -> torch.Tensor:
    if hasattr(layer.mlp, "gate_up_proj"):
        w = layer.mlp.gate_up_proj.weight
        return w[w.shape[0] // 2:]
    return layer.mlp.up_proj.weight


def _v_weight(layer, n_kv: int, hd: int) -> torch.Tensor:
    if hasattr(layer.self_attn, "qkv_proj"):
        return layer.self_attn.qkv_proj.weight[-n_kv * hd:]
    return layer.self_attn.v_proj.weight


def decoder_layers(model) -> nn.ModuleList:
    return model.model.layers


def head_dim(model) -> int:
    c = model.config
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def kv_geometry(model) -> tuple[int, int, int]:
    """(num KV heads, query heads per KV head, head dim)."""
    c = model.config
    n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return n_kv, c.num_attention_heads // n_kv, head_dim(model)


def normalize_layers(indices, num_layers: int) -> set[int]:
    """Python-style (negative allowed) layer indices -> set of 0..n-1; out of range is an error."""
    out = set()
    for i in indices:
        if not -num_layers <= i < num_layers:
            raise ValueError(f"prune.protected_layers: layer {i} does not exist (the model has {num_layers} layers)")
        out.add(i % num_layers)
    return out


def calib_loss(model, blocks: np.ndarray, batch_size: int = 4) -> float:
    """Mean next-token cross-entropy (nats) over the blocks."""
    from compress.evaluate.torch_eval import perplexity

    return math.log(perplexity(model, blocks, batch_size=batch_size))


def count_params(model) -> dict[str, int]:
    """Total (tied weights once) and non-embedding parameters (without input embeddings and LM head)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    emb = {id(model.get_input_embeddings().weight)}
    out = model.get_output_embeddings()
    if out is not None:
        emb.add(id(out.weight))
    emb_n = sum(p.numel() for p in model.parameters() if id(p) in emb)
    return {"total": total, "non_embedding": total - emb_n}


# ---------------------------------------------------------------- importance


@dataclass
class Importance:
    neurons: list[torch.Tensor]  # per layer [intermediate]
    groups: list[torch.Tensor]  # per layer [num_kv_heads]
    layers: torch.Tensor  # [num_layers], higher = more important
    method: str
    tokens: int = 0


def _weight_norm_scores(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    n_kv, n_rep, hd = kv_geometry(model)
    neurons, groups = [], []
    for layer in decoder_layers(model):
        down, up = layer.mlp.down_proj.weight.float(), _up_weight(layer).float()
        neurons.append(down.norm(dim=0) * up.norm(dim=1))
        o = layer.self_attn.o_proj.weight.float().reshape(-1, n_kv, n_rep * hd)  # [hidden, group, k]
        v = _v_weight(layer, n_kv, hd).float().reshape(n_kv, hd, -1)
        groups.append(o.norm(dim=(0, 2)) * v.norm(dim=(1, 2)))
    return neurons, groups


def _neuron_hook(acc: torch.Tensor):
    """Adds each down_proj input channel's sum of squares (an MLP neuron's activation energy) into ``acc``."""
    def fn(mod, args):
        x = args[0].float()
        acc.add_(x.pow(2).sum(dim=tuple(range(x.dim() - 1))).double())
    return fn


def _group_hook(acc: torch.Tensor, o_proj_weight: torch.Tensor, n_kv: int, width: int):
    """Adds each KV group's output energy through o_proj (its heads' slice of the weight) into ``acc``."""
    w = o_proj_weight.float().reshape(-1, n_kv, width)  # [hidden, g, k]

    def fn(mod, args):
        x = args[0].float().reshape(-1, n_kv, width)  # [tokens, g, k]
        acc.add_(torch.einsum("tgk,hgk->tgh", x, w).pow(2).sum(dim=(0, 2)).double())
    return fn


def _influence_hook(bi: torch.Tensor, i: int):
    """Adds layer ``i``'s Block Influence (1 - cosine of its input and output hidden states, per token) to bi[i]."""
    def fn(mod, args, kwargs, out):
        h_in = args[0] if args else kwargs["hidden_states"]
        h_out = out[0] if isinstance(out, tuple) else out
        cos = torch.nn.functional.cosine_similarity(h_in.float(), h_out.float(), dim=-1)
        bi[i] += (1 - cos).sum().double()
    return fn


@torch.no_grad()
def collect_importance(model, blocks: np.ndarray, method: str = "activation", batch_size: int = 4,
                       layer_scores: bool = True) -> Importance:
    """Score every MLP neuron, KV group and layer from one pass over the (calib) blocks.

    layer_scores=False skips the Block-Influence hooks (layer scores are then zeros); with method
    'weight_norm' no forward pass runs at all.
    """
    if method not in ("activation", "weight_norm"):
        raise ValueError(f"prune.importance {method!r}: allowed values are 'activation', 'weight_norm'")
    if method == "weight_norm" and not layer_scores:
        neurons, groups = _weight_norm_scores(model)
        return Importance([t.cpu() for t in neurons], [t.cpu() for t in groups],
                          torch.zeros(len(decoder_layers(model))), method, 0)
    layers = decoder_layers(model)
    n_kv, n_rep, hd = kv_geometry(model)
    L = len(layers)
    dev = next(model.parameters()).device
    neuron_sq = [torch.zeros(l.mlp.down_proj.in_features, dtype=torch.float64, device=dev) for l in layers]
    group_sq = [torch.zeros(n_kv, dtype=torch.float64, device=dev) for _ in layers]
    bi = torch.zeros(L, dtype=torch.float64, device=dev)
    hooks = []

    try:
        for i, layer in enumerate(layers):
            if layer_scores:
                hooks.append(layer.register_forward_hook(_influence_hook(bi, i), with_kwargs=True))
            if method == "activation":
                hooks.append(layer.mlp.down_proj.register_forward_pre_hook(_neuron_hook(neuron_sq[i])))
                hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
                    _group_hook(group_sq[i], layer.self_attn.o_proj.weight, n_kv, n_rep * hd)))
        model.eval()
        for s in range(0, len(blocks), batch_size):
            x = torch.as_tensor(blocks[s : s + batch_size], dtype=torch.long, device=dev)
            model(input_ids=x, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    n = max(int(np.prod(np.asarray(blocks).shape)), 1)
    if method == "activation":
        neurons = [
            (sq / n).sqrt().float() * layer.mlp.down_proj.weight.float().norm(dim=0)
            for sq, layer in zip(neuron_sq, layers)
        ]
        groups = [(sq / n).sqrt().float() for sq in group_sq]
    else:
        neurons, groups = _weight_norm_scores(model)
    return Importance([t.cpu() for t in neurons], [t.cpu() for t in groups], (bi / n).float().cpu(), method, n)


# ---------------------------------------------------------------- plan


@dataclass
class StructuredPlan:
    """What to keep, in original layer indices. Layers in drop_layers have no keep entries."""

    num_layers: int
    intermediate_size: int
    num_kv_heads: int
    n_rep: int
    head_dim: int
    drop_layers: list[int] = field(default_factory=list)
    keep_neurons: dict[int, list[int]] = field(default_factory=dict)
    keep_groups: dict[int, list[int]] = field(default_factory=dict)

    @property
    def kept_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in set(self.drop_layers)]

    def removed_neurons(self, layer: int) -> list[int]:
        keep = set(self.keep_neurons.get(layer, range(self.intermediate_size)))
        return [j for j in range(self.intermediate_size) if j not in keep]

    def removed_groups(self, layer: int) -> list[int]:
        keep = set(self.keep_groups.get(layer, range(self.num_kv_heads)))
        return [g for g in range(self.num_kv_heads) if g not in keep]

    def new_intermediate_size(self) -> int:
        return len(next(iter(self.keep_neurons.values()))) if self.keep_neurons else self.intermediate_size

    def new_num_kv_heads(self) -> int:
        return len(next(iter(self.keep_groups.values()))) if self.keep_groups else self.num_kv_heads

    def to_dict(self) -> dict:
        return {
            "drop_layers": list(self.drop_layers),
            "intermediate_size": [self.intermediate_size, self.new_intermediate_size()],
            "num_key_value_heads": [self.num_kv_heads, self.new_num_kv_heads()],
            "num_attention_heads": [self.num_kv_heads * self.n_rep, self.new_num_kv_heads() * self.n_rep],
            "num_hidden_layers": [self.num_layers, self.num_layers - len(self.drop_layers)],
            "removed_kv_groups": {str(i): self.removed_groups(i) for i in self.kept_layers},
            "removed_neurons": {str(i): self.removed_neurons(i) for i in self.kept_layers},
        }


def keep_count(total: int, ratio: float, multiple: int = 1) -> int:
    """How many of `total` units survive removing `ratio` of them (at least 1)."""
    keep = total - int(round(ratio * total))
    if multiple > 1 and total % multiple == 0 and keep >= multiple:
        keep = int(round(keep / multiple)) * multiple
    return max(1, min(total, keep))


def top_indices(scores: torch.Tensor, k: int) -> list[int]:
    # Stable: ties keep the lower index.
    order = sorted(range(len(scores)), key=lambda j: (-float(scores[j]), j))
    return sorted(order[:k])


def make_plan(model, imp: Importance, mlp_ratio: float, head_ratio: float, layer_ratio: float,
              protected: set[int], layer_scores: dict[int, float] | None = None) -> StructuredPlan:
    """Pick what goes. layer_scores (higher = more important) override the Block-Influence ranking."""
    layers = decoder_layers(model)
    L = len(layers)
    n_kv, n_rep, hd = kv_geometry(model)
    inter = layers[0].mlp.down_proj.in_features
    plan = StructuredPlan(L, inter, n_kv, n_rep, hd)
    n_drop = int(round(layer_ratio * L))
    candidates = [i for i in range(L) if i not in protected]
    if n_drop > len(candidates) or n_drop >= L:
        raise ValueError(
            f"prune.layer_ratio {layer_ratio} asks to drop {n_drop} of {L} layers, but only {len(candidates)} "
            f"are not protected (prune.protected_layers) and at least one must stay"
        )
    score = layer_scores if layer_scores is not None else {i: float(imp.layers[i]) for i in range(L)}
    plan.drop_layers = sorted(sorted(candidates, key=lambda i: (score[i], i))[:n_drop])
    k_neurons = keep_count(inter, mlp_ratio, NEURON_MULTIPLE)
    k_groups = keep_count(n_kv, head_ratio)
    for i in plan.kept_layers:
        if k_neurons < inter:
            plan.keep_neurons[i] = top_indices(imp.neurons[i], k_neurons)
        if k_groups < n_kv:
            plan.keep_groups[i] = top_indices(imp.groups[i], k_groups)
    return plan


# ---------------------------------------------------------------- surgery


def _sliced_linear(lin: nn.Linear, out_idx=None, in_idx=None) -> nn.Linear:
    w = lin.weight.data
    if out_idx is not None:
        w = w[out_idx]
    if in_idx is not None:
        w = w[:, in_idx]
    new = nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None, device=w.device, dtype=w.dtype)
    new.weight.data.copy_(w)
    if lin.bias is not None:
        b = lin.bias.data if out_idx is None else lin.bias.data[out_idx]
        new.bias.data.copy_(b)
    new.train(lin.training)
    return new


def _group_rows(groups: list[int], width: int) -> torch.Tensor:
    return torch.tensor([g * width + k for g in groups for k in range(width)], dtype=torch.long)


@torch.no_grad()
def apply_plan(model, plan: StructuredPlan) -> None:
    """Cut the model in place: smaller matrices, fewer layers, and a config that says so."""
    layers = decoder_layers(model)
    if len(layers) != plan.num_layers:
        raise ValueError(f"plan is for {plan.num_layers} layers, the model has {len(layers)}")
    hd, n_rep = plan.head_dim, plan.n_rep
    for i in plan.kept_layers:
        layer = layers[i]
        if i in plan.keep_neurons:
            idx = torch.tensor(plan.keep_neurons[i], dtype=torch.long, device=layer.mlp.down_proj.weight.device)
            if hasattr(layer.mlp, "gate_up_proj"):  # Phi-3: rows [gate | up]
                rows = torch.cat([idx, idx + plan.intermediate_size])
                layer.mlp.gate_up_proj = _sliced_linear(layer.mlp.gate_up_proj, out_idx=rows)
            else:
                layer.mlp.gate_proj = _sliced_linear(layer.mlp.gate_proj, out_idx=idx)
                layer.mlp.up_proj = _sliced_linear(layer.mlp.up_proj, out_idx=idx)
            layer.mlp.down_proj = _sliced_linear(layer.mlp.down_proj, in_idx=idx)
            if hasattr(layer.mlp, "intermediate_size"):
                layer.mlp.intermediate_size = len(idx)
        if i in plan.keep_groups:
            g = plan.keep_groups[i]
            dev = layer.self_attn.o_proj.weight.device
            q_rows = _group_rows(g, n_rep * hd).to(dev)
            kv_rows = _group_rows(g, hd).to(dev)
            att = layer.self_attn
            if hasattr(att, "qkv_proj"):  # Phi-3: rows [q | k | v]
                q_size, kv_size = plan.num_kv_heads * n_rep * hd, plan.num_kv_heads * hd
                rows = torch.cat([q_rows, kv_rows + q_size, kv_rows + q_size + kv_size])
                att.qkv_proj = _sliced_linear(att.qkv_proj, out_idx=rows)
            else:
                att.q_proj = _sliced_linear(att.q_proj, out_idx=q_rows)
                att.k_proj = _sliced_linear(att.k_proj, out_idx=kv_rows)
                att.v_proj = _sliced_linear(att.v_proj, out_idx=kv_rows)
            att.o_proj = _sliced_linear(att.o_proj, in_idx=q_rows)
            for name in ("num_heads", "num_key_value_heads"):  # modules that cache their head counts (Phi-3)
                if isinstance(getattr(att, name, None), int):
                    setattr(att, name, len(g) * (n_rep if name == "num_heads" else 1))
    kept = [layers[i] for i in plan.kept_layers]
    for new_idx, layer in enumerate(kept):
        layer.self_attn.layer_idx = new_idx
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = new_idx
    model.model.layers = nn.ModuleList(kept)

    c = model.config
    c.head_dim = hd  # explicit: hidden_size // heads no longer holds once heads go
    c.intermediate_size = plan.new_intermediate_size()
    c.num_key_value_heads = plan.new_num_kv_heads()
    c.num_attention_heads = plan.new_num_kv_heads() * n_rep
    c.num_hidden_layers = len(kept)
    if isinstance(getattr(c, "layer_types", None), list) and len(c.layer_types) == plan.num_layers:
        c.layer_types = [c.layer_types[i] for i in plan.kept_layers]
    if hasattr(c, "max_window_layers") and isinstance(c.max_window_layers, int):
        c.max_window_layers = sum(1 for i in plan.kept_layers if i < c.max_window_layers)


@torch.no_grad()
def mask_plan(model, plan: StructuredPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zero, in place, exactly what apply_plan would remove; returns (param, original) pairs to restore.

    A dropped neuron's down_proj column, a dropped group's o_proj columns and a dropped layer's
    o_proj and down_proj (weights and biases) are what make those parts contribute to the residual
    stream, so the masked model computes the same function as the cut one.
    """
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def zero(p: torch.Tensor, idx=None, cols=False):
        saved.append((p, p.detach().clone()))
        if idx is not None:
            idx = idx.to(p.device)
        if idx is None:
            p.zero_()
        elif cols:
            p[:, idx] = 0
        else:
            p[idx] = 0

    layers = decoder_layers(model)
    for i in plan.drop_layers:
        for lin in (layers[i].self_attn.o_proj, layers[i].mlp.down_proj):
            zero(lin.weight)
            if lin.bias is not None:
                zero(lin.bias)
    for i in plan.kept_layers:
        rn = plan.removed_neurons(i)
        if rn:
            zero(layers[i].mlp.down_proj.weight, torch.tensor(rn), cols=True)
        rg = plan.removed_groups(i)
        if rg:
            zero(layers[i].self_attn.o_proj.weight, _group_rows(rg, plan.n_rep * plan.head_dim), cols=True)
    return saved


@torch.no_grad()
def restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for p, orig in reversed(saved):
        p.copy_(orig)
