"""KV-cache capacity calculator: memory for a context x concurrency, or what fits in a budget.

One token of K/V costs ``2 (K and V) x layers x kv_heads x head_dim x dtype bytes``; a sequence
holds ``context`` tokens (rounded up to whole blocks when the server pages them); ``concurrency``
sequences hold that many times more. Weights and activations come on top.

    python -m loadtest.kv_calc --preset llama-2-7b --dtype float16 --context 4096 --concurrency 32
    python -m loadtest.kv_calc --manifest artifacts/.../manifest.json --context 2048 --budget-gib 1
    python -m loadtest.kv_calc --hf-config path/to/hf_folder --context 8192 --budget-gib 24 --json
    python -m loadtest.kv_calc --manifest <artifact> --context 2048 --budget-gib 0.25 --layout gqa   # this server

``--layout gqa|standard`` models this project's server: ``serve.kv_memory_mb`` is split between the block
pool and the dense rows the layout keeps beside it (``--rows-share``, the server's ``kv_rows_share``), and
a sequence must fit both (docs/serving.md, "One KV budget"). Without it the whole budget is one pool.

From Python: ``kv_bytes_per_token``, ``kv_memory_bytes``, ``max_concurrency``, ``max_context``,
``shape_from_manifest``, ``shape_from_hf_config``; ``main(argv)`` is the CLI.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from serve.kv.budget import DTYPE_BYTES, ROW_COPIES, KVCacheSpec, split_budget  # the server's table and split
from serve.kv.budget import dtype_bytes as _table_bytes

GiB = 1024 ** 3
MiB = 1024 ** 2


def dtype_bytes(dtype: str | float) -> float:
    """Bytes per element: a dtype name (float32, float16, bfloat16, int8, fp8, int4; the server's table,
    serve.kv.cache.DTYPE_BYTES) or a number."""
    if isinstance(dtype, (int, float)):
        if dtype <= 0:
            raise ValueError(f"dtype bytes must be > 0 (got {dtype})")
        return float(dtype)
    try:
        return _table_bytes(dtype)
    except ValueError as e:
        raise ValueError(f"{e} or a number of bytes") from None


# The one KV shape type, shared with the server (serve/kv/budget.py); the calculator's old name stays.
KVShape = KVCacheSpec


# Public configs (config.json of each model): layers, KV heads (GQA/MQA), head dim.
PRESETS: dict[str, KVShape] = {
    "smollm2-135m": KVShape(30, 3, 64, "float32", "SmolLM2-135M"),
    "smollm2-360m": KVShape(32, 5, 64, "float16", "SmolLM2-360M"),
    "smollm2-1.7b": KVShape(24, 32, 64, "float16", "SmolLM2-1.7B"),
    "llama-2-7b": KVShape(32, 32, 128, "float16", "Llama-2-7B (MHA)"),
    "llama-2-13b": KVShape(40, 40, 128, "float16", "Llama-2-13B (MHA)"),
    "llama-2-70b": KVShape(80, 8, 128, "float16", "Llama-2-70B (GQA 8)"),
    "llama-3-8b": KVShape(32, 8, 128, "float16", "Llama-3-8B (GQA 8)"),
    "llama-3-70b": KVShape(80, 8, 128, "float16", "Llama-3-70B (GQA 8)"),
    "mistral-7b": KVShape(32, 8, 128, "float16", "Mistral-7B (GQA 8)"),
}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str | float = "float16") -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes(dtype)


def _tokens_per_seq(context: int, block_size: int | None) -> int:
    if context < 1:
        raise ValueError(f"context must be >= 1 token (got {context})")
    if block_size is None:
        return context
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    return math.ceil(context / block_size) * block_size   # a paged cache holds whole blocks


def kv_memory_bytes(shape: KVShape, context: int, concurrency: int = 1, block_size: int | None = None) -> float:
    """KV bytes for ``concurrency`` sequences of ``context`` tokens each (whole blocks if ``block_size``)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 (got {concurrency})")
    per_tok = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype)
    return per_tok * _tokens_per_seq(context, block_size) * concurrency


def max_concurrency(shape: KVShape, budget_bytes: float, context: int, block_size: int | None = None) -> int:
    """How many sequences of ``context`` tokens fit in ``budget_bytes`` of KV memory (0 if not one)."""
    return int(budget_bytes // kv_memory_bytes(shape, context, 1, block_size))


def max_context(shape: KVShape, budget_bytes: float, concurrency: int = 1, block_size: int | None = None) -> int:
    """The longest context each of ``concurrency`` sequences can hold in ``budget_bytes``."""
    per_tok = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype)
    tokens = int(budget_bytes // (per_tok * concurrency))
    return (tokens // block_size) * block_size if block_size else tokens


def shape_from_manifest(path: str | Path) -> KVShape:
    """From an artifact's manifest.json (or its folder): layers, kv heads, head dim, kv_dtype."""
    p = Path(path)
    p = p / "manifest.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no manifest.json; pass an artifact folder or its manifest.json")
    m = json.loads(p.read_text())
    try:
        return KVShape(int(m["num_layers"]), int(m["num_kv_heads"]), int(m["head_dim"]), m.get("kv_dtype", "float32"),
                       m.get("architecture", p.parent.name))
    except KeyError as e:
        raise ValueError(f"{p}: manifest lacks {e.args[0]!r}; is it an artifact manifest (compress/artifact.py)?") from None


def shape_from_hf_config(path: str | Path | dict, dtype: str | None = None) -> KVShape:
    """From a Hugging Face config.json (or its folder, or the dict): num_hidden_layers,
    num_key_value_heads (default: num_attention_heads, i.e. MHA), head_dim (default hidden / heads).
    ``dtype`` default: the config's torch_dtype/dtype, else float16."""
    if isinstance(path, dict):
        cfg, where = path, "config"
    else:
        p = Path(path)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no config.json; pass a Hugging Face model folder or its config.json")
        cfg, where = json.loads(p.read_text()), str(p)
    cfg = cfg.get("text_config", cfg)   # multimodal configs nest the language model's
    try:
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    except KeyError as e:
        raise ValueError(f"{where}: lacks {e.args[0]!r}; not a decoder-only transformer config?") from None
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    dt = dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "float16"
    return KVShape(layers, kv, head_dim, str(dt), str(cfg.get("_name_or_path") or cfg.get("model_type") or ""))


def _fmt_bytes(b: float) -> str:
    if b >= GiB:
        return f"{b / GiB:,.2f} GiB"
    if b >= MiB:
        return f"{b / MiB:,.1f} MiB"
    return f"{b / 1024:,.1f} KiB" if b >= 1024 else f"{b:,.0f} B"


def server_split(shape: KVShape, budget_bytes: float, layout: str, rows_share: float = 0.5) -> tuple[float, int]:
    """This server's split of a KV budget: (block pool bytes, dense row positions) for ``layout``."""
    copies = ROW_COPIES.get(layout)
    if copies is None:
        raise ValueError(f"--layout {layout!r}: one of {', '.join(sorted(ROW_COPIES))} (or leave it out: one pool)")
    if not 0 < rows_share < 1:
        raise ValueError(f"--rows-share must be in (0, 1) (got {rows_share})")
    return split_budget(budget_bytes, shape, layout, rows_share)  # the server's own split


def report(shape: KVShape, context: int, concurrency: int | None = None, budget_bytes: float | None = None,
           block_size: int | None = None, layout: str | None = None, rows_share: float = 0.5) -> dict:
    """The figures the CLI prints: per token, per sequence, for ``concurrency`` sequences, and what
    ``budget_bytes`` holds (max concurrency at ``context``; max context at ``concurrency``); with ``layout``
    as this server splits the budget (``server_split``)."""
    per_tok = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype)
    out = {"shape": asdict(shape), "context": context, "block_size": block_size, "bytes_per_token": per_tok,
           "bytes_per_sequence": kv_memory_bytes(shape, context, 1, block_size)}
    if concurrency is not None:
        out["concurrency"] = concurrency
        out["total_bytes"] = kv_memory_bytes(shape, context, concurrency, block_size)
    if budget_bytes is not None:
        out["budget_bytes"] = budget_bytes
        pool = budget_bytes
        if layout is not None:
            pool, rows = server_split(shape, budget_bytes, layout, rows_share)
            out.update(layout=layout, rows_share=rows_share, pool_bytes=pool, row_positions=rows)
        out["max_concurrency"] = max_concurrency(shape, pool, context, block_size)
        out["max_context"] = max_context(shape, pool, concurrency or 1, block_size)
        if layout is not None:  # every running sequence also needs its positions in the dense rows
            out["max_concurrency"] = min(out["max_concurrency"], rows // context)
            out["max_context"] = min(out["max_context"], rows // (concurrency or 1))
    return out


def _print(r: dict) -> None:
    s = r["shape"]
    print(f"{s['name'] or 'model'}: {s['num_layers']} layers x {s['num_kv_heads']} KV heads x {s['head_dim']} head dim, "
          f"KV dtype {s['dtype']}" + (f", blocks of {r['block_size']}" if r["block_size"] else ""))
    print(f"  per token     {r['bytes_per_token']:>14,.0f} B  ({_fmt_bytes(r['bytes_per_token'])})")
    print(f"  per sequence  {r['bytes_per_sequence']:>14,.0f} B  ({_fmt_bytes(r['bytes_per_sequence'])}) "
          f"at {r['context']:,} tokens")
    if "total_bytes" in r:
        print(f"  x {r['concurrency']:<11,} {r['total_bytes']:>14,.0f} B  ({_fmt_bytes(r['total_bytes'])})")
    if "layout" in r:
        print(f"  layout {r['layout']} (kv_rows_share {r['rows_share']}): pool {_fmt_bytes(r['pool_bytes'])}, "
              f"dense rows {r['row_positions']:,} positions")
    if "budget_bytes" in r:
        print(f"  budget {_fmt_bytes(r['budget_bytes'])}: max concurrency {r['max_concurrency']:,} at "
              f"{r['context']:,} tokens; max context {r['max_context']:,} tokens at "
              f"{r.get('concurrency', 1):,} concurrent")


def build_parser(prog: str = "python -m loadtest.kv_calc") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="KV-cache memory for a context and concurrency, "
                                "or the max concurrency / context for a memory budget.")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options, for embedding as a subcommand (``compressor kv-calc``); ``run(args)`` runs it."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--manifest", help="an artifact folder or its manifest.json")
    src.add_argument("--hf-config", help="a Hugging Face model folder or its config.json")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a known model's shape")
    p.add_argument("--layers", type=int, help="number of layers (with --kv-heads and --head-dim, instead of a source)")
    p.add_argument("--kv-heads", type=int, help="KV heads (= attention heads for MHA; fewer for GQA/MQA)")
    p.add_argument("--head-dim", type=int, help="head dimension")
    p.add_argument("--dtype", default=None, help=f"KV cache dtype: {', '.join(sorted(DTYPE_BYTES))} "
                   "(default: the source's, else float16)")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (prompt + output; default 4096)")
    p.add_argument("--concurrency", type=int, default=None, help="sequences held at once")
    p.add_argument("--budget-gib", type=float, default=None, help="KV memory budget in GiB: prints what fits")
    p.add_argument("--block-size", type=int, default=None, help="round each sequence up to whole blocks of this size")
    p.add_argument("--layout", choices=sorted(ROW_COPIES), default=None,
                   help="model this server's split of the budget for this attention layout (pool + dense rows)")
    p.add_argument("--rows-share", type=float, default=0.5, help="the server's serve.kv_rows_share (default 0.5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def shape_from_args(args: argparse.Namespace) -> KVShape:
    manual = (args.layers, args.kv_heads, args.head_dim)
    if args.manifest:
        shape = shape_from_manifest(args.manifest)
    elif args.hf_config:
        shape = shape_from_hf_config(args.hf_config)
    elif args.preset:
        shape = PRESETS[args.preset]
    elif all(v is not None for v in manual):
        return KVShape(*manual, args.dtype or "float16", "custom")
    else:
        raise ValueError("give a source: --manifest, --hf-config, --preset, or all of --layers --kv-heads --head-dim")
    if any(v is not None for v in manual):
        raise ValueError("--layers/--kv-heads/--head-dim cannot be combined with --manifest/--hf-config/--preset")
    return KVShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, args.dtype or shape.dtype, shape.name)


def run(args: argparse.Namespace) -> int:
    try:
        shape = shape_from_args(args)
        budget = args.budget_gib * GiB if args.budget_gib is not None else None
        if budget is not None and budget <= 0:
            raise ValueError(f"--budget-gib must be > 0 (got {args.budget_gib})")
        if args.layout is not None and budget is None:
            raise ValueError("--layout needs --budget-gib (the server's serve.kv_memory_mb)")
        r = report(shape, args.context, args.concurrency, budget, args.block_size, args.layout, args.rows_share)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        _print(r)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
