"""The KV shape and the one KV budget's arithmetic, for the server and the calculator alike.

``KVCacheSpec`` is what a model's KV cache depends on (layers, KV heads, head dim, the cache's dtype); the
server sizes its block pool from it (serve/engine/engine.py) and ``compressor kv-calc`` (loadtest/kv_calc.py) sizes
what a budget holds with the same type and the same functions, so the two never drift.

The budget (docs/serving.md, "One KV budget"): ``serve.kv_memory_mb`` is split between the block pool and the
dense copies of each running row the attention layout keeps beside it (``ROW_COPIES``); ``split_budget``
makes the split, ``num_blocks_for_budget`` sizes the pool, ``kv_layout`` does both for a ServeConfig and
``context_length`` is the inverse: the longest sequence that split holds, or the error that names the key.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from serve.config import ConfigError, ServeConfig

log = logging.getLogger(__name__)

# The one KV dtype table: bytes per element by ONNX/numpy dtype name, with the usual short aliases. The
# runners' numpy pools hold SERVED_KV_DTYPES only; the calculator sizes any of them.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "int8": 1, "uint8": 1, "int4": 0.5,
}
SERVED_KV_DTYPES = ("float32", "float16", "int8")

# Dense copies of a row's K/V per position kept beside the block pool, by attention layout: gqa's in-place rows
# (1); standard's past buffers plus ORT's present outputs of the same size while a call runs (2).
# ``serve.kv_rows_share`` of the budget pays for them.
ROW_COPIES: dict[str, int] = {"gqa": 1, "standard": 2}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a KV dtype name (case-insensitive); ValueError naming the known ones."""
    try:
        return float(DTYPE_BYTES[str(dtype).lower()])
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None


def served_kv_dtype(manifest: dict) -> str:
    """The manifest's kv_dtype (default float32) if the runners' numpy pools can hold it, else ValueError."""
    kv_dtype = manifest.get("kv_dtype", "float32")
    if kv_dtype not in SERVED_KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} not supported (have {sorted(SERVED_KV_DTYPES)})")
    return kv_dtype


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one token's K/V across the whole model. ``dtype`` is the cache's (a name of DTYPE_BYTES,
    or a number of bytes per element for the calculator); ``name`` is only for reports."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str | float = "float32"
    name: str = ""

    def __post_init__(self):
        for f in ("num_layers", "num_kv_heads", "head_dim"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"{f} must be >= 1 (got {getattr(self, f)})")
        self.element_bytes  # noqa: B018 - an unknown dtype is an error at construction, naming the known ones

    @property
    def element_bytes(self) -> float:
        if isinstance(self.dtype, (int, float)):
            if self.dtype <= 0:
                raise ValueError(f"dtype bytes must be > 0 (got {self.dtype})")
            return float(self.dtype)
        return dtype_bytes(self.dtype)

    @property
    def exact_bytes_per_token(self) -> float:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element (fractional for int4 odd sizes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def bytes_per_token(self) -> int:
        return int(math.ceil(self.exact_bytes_per_token))

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    @classmethod
    def from_manifest(cls, manifest: dict, name: str = "") -> KVCacheSpec:
        return cls(int(manifest["num_layers"]), int(manifest["num_kv_heads"]), int(manifest["head_dim"]),
                   str(manifest.get("kv_dtype", "float32")), name)


def num_blocks_for_budget(budget_bytes: int, spec: KVCacheSpec, block_size: int) -> int:
    """How many blocks of ``block_size`` tokens fit in ``budget_bytes``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    n = budget_bytes // spec.bytes_per_block(block_size)
    if n < 1:
        raise ValueError(
            f"a KV memory budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens needs "
            f"{spec.bytes_per_block(block_size)} bytes ({spec.bytes_per_token} per token); raise serve.kv_memory_mb"
        )
    return int(n)


def split_budget(budget_bytes: float, spec: KVCacheSpec, layout: str | None, rows_share: float) -> tuple[float, int | None]:
    """(block pool bytes, dense row positions) of a KV budget for an attention layout; rows None for a layout
    that keeps no dense rows (none given: the whole budget is one pool)."""
    copies = ROW_COPIES.get(layout) if layout else None
    if not copies:
        return budget_bytes, None
    if not 0 < rows_share < 1:
        raise ValueError(f"kv_rows_share must be in (0, 1) (got {rows_share})")
    row_bytes = int(budget_bytes * rows_share)
    return budget_bytes - row_bytes, int(row_bytes // (spec.exact_bytes_per_token * copies))


def kv_layout(config: ServeConfig, spec: KVCacheSpec, layout: str) -> tuple[int, int | None]:
    """(pool blocks, dense row positions or None) for a ServeConfig's budget.

    ``serve.kv_rows_share`` of ``serve.kv_memory_mb`` goes to the rows, the rest to the pool. With
    ``serve.num_blocks`` set the pool is that size and the rows get the matching share.
    """
    bs = config.kv_block_size
    copies = ROW_COPIES.get(layout)
    share = config.kv_rows_share if copies else 0.0
    if config.num_blocks:
        num_blocks = config.num_blocks
        rows = int(num_blocks * bs * share / (1 - share)) // copies if share else None
    else:
        pool_bytes, rows = split_budget(config.kv_memory_mb * 2**20, spec, layout if share else None, share)
        num_blocks = num_blocks_for_budget(int(pool_bytes), spec, bs)
    if rows is not None and rows < 1:
        raise ConfigError(f"serve.kv_memory_mb {config.kv_memory_mb} x kv_rows_share {share} leaves the KV rows no "
                          f"position ({spec.bytes_per_token} bytes each); raise serve.kv_memory_mb")
    return num_blocks, rows


def context_length(config: ServeConfig, spec: KVCacheSpec, manifest: dict, num_blocks: int,
                   row_tokens: int | None, layout: str = "gqa") -> int:
    """The context length served: serve.max_model_len (else the manifest's max positions), within what the KV
    budget holds for one sequence. An explicit serve.max_model_len the budget cannot hold is a ConfigError."""
    bs = config.kv_block_size
    max_pos = int(manifest.get("max_positions") or 2048)
    pool_tokens = num_blocks * bs
    holds = min(pool_tokens, row_tokens) if row_tokens is not None else pool_tokens
    want = min(config.max_model_len or max_pos, max_pos)
    if want <= holds:
        return want
    bpt = spec.bytes_per_token
    parts = f"the block pool {pool_tokens} tokens ({num_blocks} blocks of {bs})"
    if row_tokens is not None:
        share = config.kv_rows_share
        copies = ROW_COPIES.get(layout, 1)
        what = "gqa KV rows" if layout == "gqa" else f"{layout} layout's past buffers"
        parts += f" and the {what} {row_tokens} positions (kv_rows_share {share})"
        need_mb = max(-(-want // bs) * bs * bpt / (1 - share), want * bpt * copies / share) / 2**20
    else:
        need_mb = -(-want // bs) * bs * bpt / 2**20
    if config.num_blocks:
        share = config.kv_rows_share if row_tokens is not None else 0.5
        copies = ROW_COPIES.get(layout, 1) if row_tokens is not None else 1
        need_blocks = max(-(-want // bs), -(-int(want * copies * (1 - share) / share) // bs))
        budget, key, need = f"serve.num_blocks {config.num_blocks}", "serve.num_blocks", f"{need_blocks}"
    else:
        budget, key = f"serve.kv_memory_mb {config.kv_memory_mb} MiB", "serve.kv_memory_mb"
        need = f"{int(-(-need_mb // 1))} MiB"
    msg = (f"{budget} holds one sequence of at most {holds} tokens ({parts}, {bpt} bytes per token); "
           f"a context of {want} tokens needs {key} >= {need}")
    if config.max_model_len:
        raise ConfigError(f"serve.max_model_len {config.max_model_len} does not fit the KV budget: {msg}; "
                          f"raise {key} or lower serve.max_model_len")
    log.warning("context length lowered from the model's %d to %d tokens: %s", want, holds, msg)
    return holds


def available_bytes() -> int:
    """MemAvailable of this machine (Linux), else the total: what a stage or a second session may still take."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
