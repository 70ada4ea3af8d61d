"""The reference as the checkpoint itself, in torch and its stored dtype, for models too large to judge against
their fp32 graph cheaply.

The accept stage compares a candidate with the model it came from. For SmolLM2 that reference is the exported
fp32 ONNX graph. For a 1B and up the fp32 graph is the most expensive thing the stage touches: 4 bytes a
parameter in memory (a 7B's 30 GB does not fit a 24 GB machine), and fp32 GEMMs at ~250 GFLOPS on 2 cores,
where torch's bf16 GEMM on AMX measured 1,395 GFLOPS on the same cores. So above a size (``accept.reference``,
``resolve``) the reference is the checkpoint as stored (bf16 for published models), loaded by transformers:

* its logits over the eval blocks (``prefill_batches``) feed ``onnx_eval.ReferencePass`` exactly where the fp32
  graph's did (perplexity, agreement, KL);
* its greedy answers to many prompts at once (``generate``: left-padded batches through its KV cache) and its
  scoring of answers (``continuation_logits``) are the chat set's teacher (compress/evaluate/chat.py).

The last projection runs in fp32 (``_logits``): logits rounded to bf16 (8 bits of mantissa, steps of 0.06 at 10)
would tie argmaxes that the graph tells apart. A 16-bit head is widened a few rows at a time (``HEAD_CHUNK_BYTES``),
never whole: an fp32 copy was 1 GB for the 1B's tied 128k x 2,048, 1.47 GiB for the 3B's and 2.2 GB for a 7B's,
the largest part of the accept stage's peak over the checkpoint itself. Batched bf16 answers are deterministic for
a given batch; they are not promised equal to batch-1 answers token for token, as the engine's are (a 16-bit
reference is itself an approximation of the fp32 one, by the bf16 rounding of every weight and activation).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compress.drivers.base import CONTINUATION_LOGITS_BYTES, _batches
from compress.evaluate.generate import Generated
# auto: the checkpoint is the reference from this many parameters on, when stored in 16 bits (memory.py reads it too)
from compress.sizing.memory import CHECKPOINT_FROM_PARAMS

log = logging.getLogger(__name__)

# Rows of one generate batch: a decode step reads every weight once whatever the rows, so as many as the work has
# (48 chat prompts: 0.69 s a step at 16 rows on the 1B, ~0.75 at 48); their K/V and logits stay small.
GENERATE_ROWS = 64
# fp32 rows of a 16-bit head widened at a time in _logits (a whole fp32 copy is 1.47 GiB for the 3B's). On the 3B's
# head and 2 cores a call of 48 rows took 0.37-0.55 s against 0.33-0.37 s with the copy, one of 256 rows about the
# same; smaller chunks were slower, larger no faster.
HEAD_CHUNK_BYTES = 16 * 2**20


class ReferenceSettingError(ValueError):
    """accept.reference asks for what this run cannot give (the message names the key and the fix)."""


@dataclass(frozen=True)
class CheckpointReference:
    """Where the checkpoint is and how it is read; ``loaded()`` holds it in memory for one phase of work."""

    model_dir: str
    cache_dir: str = ".cache/models"
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"  # as stored; "bfloat16" reads an fp32 checkpoint in bf16 (to measure what bf16 moves)

    @property
    def key(self) -> dict:
        """What identifies these weights for a cache: the checkpoint's files by name, size and mtime."""
        from compress.artifact import checkpoint_files

        return {"checkpoint": str(Path(self.model_dir).resolve()), "revision": self.revision, "dtype": self.dtype,
                "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in checkpoint_files(self.model_dir)}}

    def stored_bytes(self) -> int:
        """The checkpoint's weight files as stored: the reference's size beside a candidate's."""
        from compress.artifact import checkpoint_files

        return sum(p.stat().st_size for p in checkpoint_files(self.model_dir) if p.suffix != ".json")

    @contextmanager
    def loaded(self, eos_ids: Sequence[int] = ()) -> Iterator[CheckpointLM]:
        import gc

        import torch

        from compress.loading.models import load_teacher
        from serve.engine.heap import release_free_memory

        # glibc keeps what a candidate's session freed (1.9 GiB after the 3B's chat scoring): back to the system
        # before the checkpoint comes, or the two add up at the stage's peak
        gc.collect()
        release_free_memory()
        t0 = time.perf_counter()
        model, _ = load_teacher(self.model_dir, None, self.cache_dir, self.revision, self.trust_remote_code,
                                dtype=self.dtype if self.dtype == "auto" else getattr(torch, self.dtype))
        lm = CheckpointLM(model, eos_ids)
        log.info("reference: the checkpoint %s in %s on %s, loaded in %.1f s", self.model_dir, lm.dtype, lm.device,
                 time.perf_counter() - t0)
        try:
            yield lm
        finally:
            lm.model = lm.decoder = lm.head = None
            del model
            gc.collect()
            release_free_memory()


def stored_params_and_dtype(model_dir: str) -> tuple[int, str]:
    """The parameter count and the dtype most of them are stored in, from the safetensors headers (nothing
    loaded); (0, "") when there are none."""
    import json
    import struct

    path = Path(model_dir)
    by_dtype: dict[str, int] = {}
    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else []:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                by_dtype[t["dtype"]] = by_dtype.get(t["dtype"], 0) + math.prod(t["shape"])
    if not by_dtype:
        return 0, ""
    return sum(by_dtype.values()), max(by_dtype, key=by_dtype.get)


def resolve(setting: str, model_dir: str | None, needs_decode_speed: bool) -> bool:
    """Whether the checkpoint is the accept stage's reference: ``checkpoint`` yes, ``artifact`` no, ``auto`` when
    it has CHECKPOINT_FROM_PARAMS or more parameters, most stored in 16 bits, and the gate needs no baseline decode
    speed (which is the fp32 graph's, timed on ONNX Runtime)."""
    if setting == "artifact" or model_dir is None:
        if setting == "checkpoint":
            raise ReferenceSettingError("accept.reference: checkpoint needs the source checkpoint's folder; this run "
                                        "has none")
        return False
    if setting == "checkpoint":
        if needs_decode_speed:
            raise ReferenceSettingError("accept.reference: checkpoint has no baseline decode speed for "
                                 "accept.min_decode_speed_ratio; set accept.reference: artifact, or drop the floor")
        return True
    params, dtype = stored_params_and_dtype(model_dir)
    return not needs_decode_speed and params >= CHECKPOINT_FROM_PARAMS and dtype in ("BF16", "F16")


class CheckpointLM:
    """A torch causal LM driven for evaluation: what the ONNX drivers give (``prefill_batches``,
    ``continuation_logits``) and batched greedy ``generate``, logits in fp32 numpy."""

    def __init__(self, model, eos_ids: Sequence[int] = ()):
        import torch

        self.model = model
        self.device = next(model.parameters()).device
        if self.device.type == "cpu" and torch.cuda.is_available():
            model.to("cuda")
            self.device = torch.device("cuda")
        self.dtype = next(model.parameters()).dtype
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings().weight.detach()  # as stored: _logits widens it a chunk at a time
        self.vocab = int(self.head.shape[0])
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.eos_ids = frozenset(int(i) for i in eos_ids)

    def _logits(self, hidden) -> np.ndarray:
        """fp32 logits of hidden states [..., d]: fp32 products of the head's rows, widened ``HEAD_CHUNK_BYTES`` at
        a time when it is stored in 16 bits (exactly, so the logits are the fp32 head's)."""
        import torch

        with torch.inference_mode():
            h = hidden.reshape(-1, hidden.shape[-1]).float()
            out = torch.empty(h.shape[0], self.vocab, dtype=torch.float32, device=h.device)
            rows = self.vocab if self.head.dtype == torch.float32 else max(1, HEAD_CHUNK_BYTES // (4 * h.shape[1]))
            for a in range(0, self.vocab, rows):
                torch.mm(h, self.head[a:a + rows].float().T, out=out[:, a:a + rows])
            if self.softcap:
                out.div_(self.softcap).tanh_().mul_(self.softcap)
        return out.reshape(*hidden.shape[:-1], self.vocab).cpu().numpy()

    def _hidden(self, ids, mask=None, positions=None, past=None):
        import torch

        with torch.inference_mode():
            out = self.decoder(input_ids=ids.to(self.device),
                               attention_mask=None if mask is None else mask.to(self.device),
                               position_ids=None if positions is None else positions.to(self.device),
                               cache=past, use_cache=past is not None)
        return out.last_hidden_state, out.cache if past is not None else None

    def prefill_batches(self, blocks: np.ndarray, batch_size: int = 4) -> Iterator[np.ndarray]:
        """Logits [b, s, vocab] of equal-length blocks, ``batch_size`` rows at a time (no padding, no past)."""
        import torch

        blocks = np.asarray(blocks, np.int64)
        for i in range(0, len(blocks), batch_size):
            h, _ = self._hidden(torch.as_tensor(blocks[i:i + batch_size]))
            yield self._logits(h)

    def continuation_logits(self, prompts: Sequence[Sequence[int]], conts: Sequence[Sequence[int]],
                            max_logits_bytes: int = CONTINUATION_LOGITS_BYTES) -> Iterator[tuple[int, np.ndarray]]:
        """As the drivers' (compress/drivers/base.py): ``(index, logits [len(cont), vocab])`` at the positions that
        predict each non-empty continuation. Right-padded rows (causal: padding after a row changes nothing before
        it); only the continuation's positions go through the last projection."""
        import torch

        order = sorted((i for i, c in enumerate(conts) if len(c)), key=lambda i: len(prompts[i]) + len(conts[i]))

        def widths(rows: list[int]) -> tuple[int, int]:
            return max(len(conts[i]) for i in rows), max(len(prompts[i]) + len(conts[i]) for i in rows)

        for batch in _batches(order, widths, self.vocab, max_logits_bytes):
            seqs = [list(prompts[i]) + list(conts[i]) for i in batch]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, :len(s)] = torch.as_tensor(s)
            h, _ = self._hidden(ids)
            for r, i in enumerate(batch):
                p = len(prompts[i])
                yield i, self._logits(h[r, p - 1:p - 1 + len(conts[i])])

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, progress: bool = True,
                 desc: str = "reference answers", check: Callable[[str], None] | None = None,
                 logprobs: bool = False, rows: int = GENERATE_ROWS) -> Generated:
        """Greedy answers (ending at an EOS, which is kept) to every prompt, ``rows`` prompts of similar length at
        a time, left-padded; with ``logprobs`` each answer's NLL from the logits its tokens were picked from."""
        from tqdm.auto import tqdm

        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        answers: list[list[int]] = [[] for _ in prompts]
        nll = [0.0] * len(prompts)
        t0 = time.perf_counter()
        with tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress) as bar:
            for start in range(0, len(order), rows):
                batch = order[start:start + rows]
                outs, nlls = self._generate_batch([prompts[i] for i in batch], max_new_tokens, check, desc)
                for i, out, n in zip(batch, outs, nlls):
                    answers[i], nll[i] = out, n
                bar.update(len(batch))
        gen = Generated(answers, time.perf_counter() - t0, rows, nll if logprobs else None)
        log.info("%s: %d prompts, %d tokens in %.1f s (%.1f tok/s, %d rows at once)", desc, len(prompts), gen.tokens,
                 gen.seconds, gen.tokens_per_s, min(rows, len(prompts)))
        return gen

    def _generate_batch(self, prompts, max_new_tokens, check, desc) -> tuple[list[list[int]], list[float]]:
        """One left-padded batch's greedy answers and their NLLs."""
        import torch
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.as_tensor(list(p))
            mask[r, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        past = DynamicCache()
        h, past = self._hidden(ids, mask, positions, past)
        live = [True] * len(prompts)
        outs: list[list[int]] = [[] for _ in prompts]
        nll = [0.0] * len(prompts)
        for step in range(max_new_tokens):
            if check is not None:
                check(f"{desc}: step {step + 1} of {max_new_tokens}")
            lg = self._logits(h[:, -1])
            lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
            picked = lg.argmax(-1)
            for r in range(len(prompts)):
                if live[r]:
                    tok = int(picked[r])
                    outs[r].append(tok)
                    nll[r] += float(lse[r] - lg[r, tok])
                    live[r] = tok not in self.eos_ids
            if not any(live) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], -1)
            positions = positions[:, -1:] + 1
            h, past = self._hidden(torch.as_tensor(picked, dtype=torch.long)[:, None], mask, positions, past)
        return outs, nll
