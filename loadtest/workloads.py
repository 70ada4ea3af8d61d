"""Seeded serving workloads as plain data: what the load generator and the baselines replay.

A workload is a ``list[dict]``; each request is
``{"id", "kind", "prompt", "max_tokens", "temperature", "ignore_eos"}``, where ``kind`` is

- ``mixed``: a passage of the embedded corpus of random length, random output length;
- ``shared_prefix``: one long passage shared by all such requests, then a short distinct question
  (the prefix cache's case: the first one is cold, the rest hit);
- ``repeat``: an exact copy of an earlier request (the result cache's case).

Lengths are in words of the embedded corpus (about 1.7 SmolLM2 tokens or 2-3 tiny-model tokens
per word); ``fit_to_context`` trims prompts to a model's context with its tokenizer. Greedy and
``ignore_eos`` by default so every system generates exactly ``max_tokens`` tokens and throughput
compares like with like. Same arguments -> the same list, on any machine (numpy's PCG64).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

KINDS = ("mixed", "shared_prefix", "repeat")

_QUESTIONS = (
    "Summarize the text above in one sentence.",
    "What is the main point of this passage?",
    "List three keywords from the text.",
    "Explain the previous paragraph to a beginner.",
    "Which Python feature does this describe?",
    "Give an example that uses this.",
    "What could go wrong here?",
    "Rewrite the first sentence more simply.",
)


def _words() -> list[list[str]]:
    from compress.corpus.splits import embedded_corpus

    # Long documents only, so a slice of any requested length exists without wrapping.
    return [d.split() for d in embedded_corpus() if len(d.split()) >= 64]


def _passage(docs: list[list[str]], rng: np.random.Generator, n_words: int) -> str:
    doc = docs[int(rng.integers(len(docs)))]
    if len(doc) <= n_words:
        # Join following documents: a longer passage than any single topic.
        out = list(doc)
        k = int(rng.integers(len(docs)))
        while len(out) < n_words:
            out += docs[k % len(docs)]
            k += 1
        return " ".join(out[:n_words])
    start = int(rng.integers(0, len(doc) - n_words + 1))
    return " ".join(doc[start:start + n_words])


def make_workload(
    n_requests: int = 32,
    seed: int = 0,
    prompt_words: tuple[int, int] = (16, 192),
    max_tokens: tuple[int, int] = (16, 64),
    shared_prefix_frac: float = 0.25,
    shared_prefix_words: int = 384,
    repeat_frac: float = 0.125,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> list[dict]:
    """``n_requests`` requests: ``shared_prefix_frac`` of them share one ``shared_prefix_words``-word
    passage, ``repeat_frac`` repeat an earlier request exactly, the rest are mixed. Ranges are
    inclusive ``(low, high)``; the order is shuffled (seeded) so the kinds interleave."""
    if n_requests < 1:
        raise ValueError(f"n_requests must be >= 1 (got {n_requests})")
    for name, (lo, hi) in (("prompt_words", prompt_words), ("max_tokens", max_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be (low, high) with 1 <= low <= high (got {(lo, hi)})")
    if not (0 <= shared_prefix_frac and 0 <= repeat_frac and shared_prefix_frac + repeat_frac <= 1):
        raise ValueError("shared_prefix_frac and repeat_frac must be >= 0 and sum to <= 1 "
                         f"(got {shared_prefix_frac} + {repeat_frac})")
    rng = np.random.default_rng(seed)
    docs = _words()
    n_shared = int(round(n_requests * shared_prefix_frac))
    n_repeat = min(int(round(n_requests * repeat_frac)), max(0, n_requests - n_shared - 1))
    n_mixed = n_requests - n_shared - n_repeat
    # Repeats need an original to copy: when everything else is shared-prefix they copy those.
    prefix = _passage(docs, rng, shared_prefix_words) if n_shared else ""

    def out_len() -> int:
        return int(rng.integers(max_tokens[0], max_tokens[1] + 1))

    base: list[dict] = []
    for _ in range(n_mixed):
        text = _passage(docs, rng, int(rng.integers(prompt_words[0], prompt_words[1] + 1)))
        base.append({"kind": "mixed", "prompt": text, "max_tokens": out_len()})
    for i in range(n_shared):
        q = _QUESTIONS[i % len(_QUESTIONS)]
        # A distinct tail keeps each shared-prefix request a result-cache miss.
        base.append({"kind": "shared_prefix", "prompt": f"{prefix}\n\nQuestion {i + 1}: {q}", "max_tokens": out_len()})
    order = rng.permutation(len(base))
    base = [base[i] for i in order]
    # Repeats go after their original so it has (usually) finished and sits in the result cache.
    reqs = list(base)
    for _ in range(n_repeat):
        src_pos = int(rng.integers(len(base)))
        src = base[src_pos]
        at = int(rng.integers(min(len(reqs), reqs.index(src) + 2), len(reqs) + 1))
        reqs.insert(at, {**src, "kind": "repeat"})
    return [{"id": i, **r, "temperature": temperature, "ignore_eos": ignore_eos} for i, r in enumerate(reqs)]


def fit_to_context(workload: list[dict], artifact_dir: str | Path, max_len: int | None = None) -> list[dict]:
    """A copy whose prompts are cut at the end (keeping a shared prefix shared) so prompt + max_tokens fits
    ``max_len`` tokens (default: the artifact's ``max_positions``), counted with its tokenizer, plus the BOS
    a model whose manifest says ``add_bos_token`` takes first (compress/loading/special_tokens.py; the server adds it).
    Prompts stay text: the server tokenizes them."""
    from tokenizers import Tokenizer

    artifact_dir = Path(artifact_dir)
    tok = Tokenizer.from_file(str(artifact_dir / "tokenizer.json"))
    manifest = json.loads((artifact_dir / "manifest.json").read_text())
    if max_len is None:
        max_len = int(manifest["max_positions"])
    n_bos = 1 if manifest.get("add_bos_token") and manifest.get("bos_token_id") is not None else 0
    out = []
    for r in workload:
        budget = max_len - int(r["max_tokens"]) - 1 - n_bos
        if budget < 1:
            raise ValueError(f"request {r['id']}: max_tokens {r['max_tokens']} leaves no room in a context of {max_len}")
        prompt = r["prompt"]
        ids = tok.encode(prompt, add_special_tokens=False).ids
        cut = budget
        # Decoding a cut and re-encoding it can merge differently: shrink until it really fits.
        while len(ids) > budget and cut > 0:
            prompt = tok.decode(ids[:cut])
            ids2 = tok.encode(prompt, add_special_tokens=False).ids
            if len(ids2) <= budget:
                break
            cut -= max(1, len(ids2) - budget)
        out.append({**r, "prompt": prompt})
    return out


def summarize(workload: list[dict]) -> dict:
    """Counts by kind and total requested output tokens (for logs and the docs)."""
    kinds = {k: sum(1 for r in workload if r["kind"] == k) for k in KINDS}
    return {"requests": len(workload), **kinds, "max_tokens_total": sum(int(r["max_tokens"]) for r in workload),
            "prompt_words_total": sum(len(r["prompt"].split()) for r in workload)}
