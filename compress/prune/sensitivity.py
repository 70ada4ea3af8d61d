"""Per-layer, per-group pruning sensitivity: the calib loss increase when one part alone is pruned.

Groups (which ones are scanned follows the config's method and non-zero ratios):
* ``mlp_neurons``  the layer's least important mlp_ratio of MLP neurons removed (masked)
* ``attn_heads``   the layer's least important head_ratio of KV groups removed (at least one)
* ``layer``        the whole layer skipped (its attention and MLP add nothing to the residual)
* ``attn_weights`` q/k/v/o pruned to the target sparsity (or 2:4) by the configured score
* ``mlp_weights``  gate/up/down pruned to the target sparsity (or 2:4) by the configured score

Every probe masks weights in place and restores them bit for bit, so the model
handed in is unchanged afterwards. A probe at layer l leaves layers 0..l-1 as they
were, so their outputs are recorded once and each probe re-runs only layers l..L-1,
the final norm and the LM head (~40% less compute on SmolLM2; checked against a
full forward before use, with the full forward as fallback). Only the blocks passed in are read (give it
the calib split; the selection split must stay unseen until the final measurement).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from compress.prune.structured import (
    NEURON_MULTIPLE,
    Importance,
    StructuredPlan,
    calib_loss,
    check_supported,
    collect_importance,
    decoder_layers,
    keep_count,
    kv_geometry,
    mask_plan,
    restore,
    top_indices,
)
from compress.prune.unstructured import compute_masks, input_norms

STRUCTURED_GROUPS = ("mlp_neurons", "attn_heads", "layer")
UNSTRUCTURED_GROUPS = ("attn_weights", "mlp_weights")
ALL_GROUPS = STRUCTURED_GROUPS + UNSTRUCTURED_GROUPS


def default_groups(cfg) -> list[str]:
    groups: list[str] = []
    if cfg.method in ("structured", "both"):
        if cfg.mlp_ratio > 0:
            groups.append("mlp_neurons")
        if cfg.head_ratio > 0:
            groups.append("attn_heads")
        groups.append("layer")
    if cfg.method in ("unstructured", "both") and (cfg.sparsity > 0 or cfg.pattern != "none"):
        groups += list(UNSTRUCTURED_GROUPS)
    return groups


@dataclass
class SensitivityReport:
    base_loss: float
    rows: list[dict] = field(default_factory=list)  # layer, group, ratio, loss, delta
    num_layers: int = 0
    blocks: int = 0
    tokens: int = 0
    seconds: float = 0.0
    importance: str = "activation"
    suffix_replay: bool = False

    def table(self) -> list[dict]:
        return [dict(r) for r in self.rows]

    def groups(self) -> list[str]:
        return list(dict.fromkeys(r["group"] for r in self.rows))

    def deltas(self, group: str) -> dict[int, float]:
        return {r["layer"]: r["delta"] for r in self.rows if r["group"] == group}

    def ranking(self, group: str) -> list[int]:
        """Layers from least to most sensitive for one group."""
        d = self.deltas(group)
        return sorted(d, key=lambda i: (d[i], i))

    def figure(self):
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 4), dpi=100)
        ax = fig.add_subplot(1, 1, 1)
        for g in self.groups():
            d = self.deltas(g)
            xs = sorted(d)
            ratio = next(r["ratio"] for r in self.rows if r["group"] == g)
            ax.plot(xs, [d[i] for i in xs], marker="o", ms=3, label=f"{g} ({ratio:g})")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("calib loss increase (nats/token)")
        ax.set_title(f"Pruning sensitivity (base loss {self.base_loss:.3f}, {self.tokens} calib tokens)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        return fig

    def metrics(self) -> dict[str, float]:
        out = {"sens_base_loss": float(self.base_loss), "sens_seconds": float(self.seconds)}
        for g in self.groups():
            d = list(self.deltas(g).values())
            out[f"sens_{g}_delta_mean"] = float(np.mean(d))
            out[f"sens_{g}_delta_max"] = float(np.max(d))
        return out


class _SuffixReplay:
    """Each decoder layer's inputs, as the model passed them, per calib batch; re-runs a suffix of layers."""

    def __init__(self, model, blocks: np.ndarray, batch_size: int):
        self.model = model
        self.layers = decoder_layers(model)
        self.batches: list[tuple[torch.Tensor, list[tuple[tuple, dict]]]] = []
        dev = next(model.parameters()).device
        captured: dict[int, tuple[tuple, dict]] = {}

        def pre(i):
            def fn(mod, args, kwargs):
                captured[i] = (args, dict(kwargs))
            return fn

        hooks = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(self.layers)]
        try:
            for s in range(0, len(blocks), batch_size):
                x = torch.as_tensor(blocks[s : s + batch_size], dtype=torch.long, device=dev)
                captured.clear()
                model(input_ids=x, use_cache=False)
                self.batches.append((x, [captured[i] for i in range(len(self.layers))]))
        finally:
            for h in hooks:
                h.remove()

    def loss(self, start: int) -> float:
        """Mean next-token cross-entropy with layers start..L-1 re-run from their recorded input."""
        total, count = 0.0, 0
        for x, inputs in self.batches:
            args, kwargs = inputs[start]
            h = args[0] if args else kwargs["hidden_states"]
            for j in range(start, len(self.layers)):
                a, kw = inputs[j]
                kw = {k: v for k, v in kw.items() if k != "hidden_states"}
                h = self.layers[j](h, *a[1:], **kw)
                h = h[0] if isinstance(h, tuple) else h
            logits = self.model.lm_head(self.model.model.norm(h))[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                    reduction="sum")
            total += float(nll)
            count += x[:, 1:].numel()
        return total / max(count, 1)


def _probe_plan(base: StructuredPlan, layer: int, group: str, imp: Importance, cfg) -> StructuredPlan:
    plan = StructuredPlan(base.num_layers, base.intermediate_size, base.num_kv_heads, base.n_rep, base.head_dim)
    if group == "layer":
        plan.drop_layers = [layer]
    elif group == "mlp_neurons":
        k = keep_count(base.intermediate_size, cfg.mlp_ratio, NEURON_MULTIPLE)
        plan.keep_neurons[layer] = top_indices(imp.neurons[layer], k)
    elif group == "attn_heads":
        k = min(keep_count(base.num_kv_heads, cfg.head_ratio), base.num_kv_heads - 1)
        plan.keep_groups[layer] = top_indices(imp.groups[layer], max(k, 0))
    return plan


def _group_ratio(group: str, cfg, base: StructuredPlan) -> float:
    if group == "layer":
        return 1.0
    if group == "mlp_neurons":
        return 1 - keep_count(base.intermediate_size, cfg.mlp_ratio, NEURON_MULTIPLE) / base.intermediate_size
    if group == "attn_heads":
        k = min(keep_count(base.num_kv_heads, cfg.head_ratio), base.num_kv_heads - 1)
        return 1 - k / base.num_kv_heads
    return 0.5 if cfg.pattern == "2:4" else cfg.sparsity


@torch.no_grad()
def sensitivity_scan(model, calib_blocks: np.ndarray, cfg, groups: list[str] | None = None,
                     batch_size: int = 4) -> SensitivityReport:
    """Loss increase on calib_blocks[:cfg.sensitivity_blocks] for each (layer, group) pruned alone."""
    check_supported(model)
    groups = list(groups) if groups is not None else default_groups(cfg)
    bad = [g for g in groups if g not in ALL_GROUPS]
    if bad:
        raise ValueError(f"sensitivity groups {bad}: allowed are {list(ALL_GROUPS)}")
    blocks = np.asarray(calib_blocks)[: cfg.sensitivity_blocks]
    if len(blocks) == 0:
        raise ValueError("sensitivity_scan needs at least one calib block")
    t0 = time.perf_counter()
    model.eval()
    L = len(decoder_layers(model))
    n_kv, n_rep, hd = kv_geometry(model)
    inter = decoder_layers(model)[0].mlp.down_proj.in_features
    base_plan = StructuredPlan(L, inter, n_kv, n_rep, hd)
    imp = None
    if any(g in ("mlp_neurons", "attn_heads") for g in groups):
        imp = collect_importance(model, blocks, cfg.importance, batch_size, layer_scores=False)
    base = calib_loss(model, blocks, batch_size)
    replay: _SuffixReplay | None = None
    try:
        replay = _SuffixReplay(model, blocks, batch_size)
        if not abs(replay.loss(0) - base) <= 1e-4 * max(1.0, abs(base)):
            replay = None
    except Exception:  # an architecture whose layers cannot be re-run from their inputs: full forwards
        replay = None
    report = SensitivityReport(base_loss=base, num_layers=L, blocks=len(blocks),
                               tokens=int(blocks.shape[0] * (blocks.shape[1] - 1)), importance=cfg.importance)
    norms = None
    if any(g in UNSTRUCTURED_GROUPS for g in groups) and cfg.unstructured_score == "wanda":
        norms = input_norms(model, blocks, batch_size)
    for layer in range(L):
        for group in groups:
            if group in UNSTRUCTURED_GROUPS:
                masks = compute_masks(model, cfg.sparsity, cfg.pattern, "per_layer",
                                      protected=set(range(L)) - {layer}, norms=norms)
                kind = "attn" if group == "attn_weights" else "mlp"
                saved = []
                for name, m in masks.items():
                    if f".{'self_attn' if kind == 'attn' else 'mlp'}." in name:
                        p = model.get_parameter(name)
                        saved.append((p, p.detach().clone()))
                        p.mul_(m)
            else:
                if group == "attn_heads" and n_kv < 2:
                    continue
                saved = mask_plan(model, _probe_plan(base_plan, layer, group, imp, cfg))
            try:
                loss = replay.loss(layer) if replay is not None else calib_loss(model, blocks, batch_size)
            finally:
                restore(saved)
            report.rows.append({"layer": layer, "group": group, "ratio": round(_group_ratio(group, cfg, base_plan), 4),
                                "loss": loss, "delta": loss - base if math.isfinite(loss) else float("inf")})
    report.seconds = time.perf_counter() - t0
    report.suffix_replay = replay is not None
    return report
