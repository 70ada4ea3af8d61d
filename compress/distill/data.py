"""What the student is distilled on: the corpus's train blocks, the teacher's own generations, or both.

Distilling on the corpus alone teaches the student the corpus: on SmolLM2 a 25 % MLP-pruned student came
back to 1.06x the teacher's perplexity on documentation but stayed at 1.66x on Python source (issue 18,
docs/distillation.md). The teacher's own samples cover what the teacher does, not what one corpus holds.

Generation follows LLM-QAT's data-free recipe (Liu et al., 2023): each sequence starts from a token drawn
uniformly from the vocabulary (special tokens excluded), after BOS when the model takes one, and the teacher
samples the rest at ``temperature`` with no top-k/top-p, so the blocks follow the teacher's own distribution.
EOS is suppressed (every block is ``block_size`` tokens, as the corpus's are). Seeded: the same config
(and generation batch size) gives the same blocks.

``distill.data``: ``corpus`` (the train split), ``generated`` (only the teacher's blocks), ``mix`` (both,
shuffled together by the training loop's data order), ``chat`` (the teacher's own conversations: each block starts
as the model's chat template opens a user turn, its default system turn included, and the teacher writes the rest
at ``temperature``: the user's message, the end of the turn, the assistant turn and its answer, and on; special
tokens the template does not use are suppressed), ``chat_mix`` (those conversations and the corpus's train blocks,
shuffled together). ``chat`` is the distribution of use for a chat model, and is data-free: no prompt of the gate's
chat set (compress/evaluate/chatsets/) is read.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from compress.corpus.splits import DataSplits


def chat_opening(tokenizer, bos_id: int | None = None) -> list[int]:
    """The token ids with which the model's chat template opens a user turn (a default system turn included)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("distill.data 'chat' needs a model with a chat template; use generated or mix")
    mark = "MARKER7b1f"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text[:text.index(mark)], add_special_tokens=False)["input_ids"]
    return ids if bos_id is None or (ids and ids[0] == bos_id) else [bos_id, *ids]


def template_special_ids(tokenizer) -> list[int]:
    """Special tokens that the chat template never writes: a teacher writing a conversation must not emit them."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return [int(i) for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids) if t not in template]


def teacher_generations(teacher, n_blocks: int, block_size: int, *, seed: int, temperature: float = 1.0,
                        bos_id: int | None = None, exclude_ids: list[int] | tuple[int, ...] = (),
                        batch_size: int = 32, progress: bool = True,
                        opening: list[int] | None = None) -> np.ndarray:
    """``n_blocks`` sampled sequences of ``block_size`` tokens, [n_blocks, block_size] int64.

    Without ``opening`` each starts from a uniformly drawn token (after BOS) and EOS is never drawn; with it, each
    starts with those ids (a chat turn's opening, chat_opening) and only ``exclude_ids`` are never drawn."""
    vocab = int(teacher.get_output_embeddings().weight.shape[0])
    allowed = np.setdiff1d(np.arange(vocab), np.asarray(list(exclude_ids), dtype=np.int64))
    rng = np.random.default_rng(seed)
    first = rng.choice(allowed, size=n_blocks)
    prefix = 1 if bos_id is None else 2
    eos = getattr(teacher.generation_config, "eos_token_id", None)
    if opening is not None:
        if len(opening) >= block_size:
            raise ValueError(f"the chat template's opening is {len(opening)} tokens, data.block_size {block_size}: "
                             f"raise data.block_size")
        prefix, eos = len(opening), list(exclude_ids)
    new = block_size - prefix
    device = next(teacher.parameters()).device
    out = np.empty((n_blocks, block_size), np.int64)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    was_training = teacher.training
    teacher.eval()
    bar = tqdm(total=n_blocks, desc="teacher generations", unit="block", disable=not progress)
    try:
        for lo in range(0, n_blocks, batch_size):
            ids = torch.as_tensor(first[lo:lo + batch_size, None])
            if opening is not None:
                ids = torch.as_tensor(opening, dtype=torch.long).repeat(len(ids), 1)
            elif bos_id is not None:
                ids = torch.cat([torch.full_like(ids, bos_id), ids], dim=1)
            out[lo:lo + len(ids)] = _sample(teacher, ids.to(device), new, temperature, eos, gen)
            bar.update(len(ids))
    finally:
        bar.close()
        teacher.train(was_training)
    return out


@torch.no_grad()
def _sample(model, ids: torch.Tensor, new: int, temperature: float, eos, gen: torch.Generator) -> np.ndarray:
    """Plain ancestral sampling with the KV cache: seeded through ``gen`` on the CPU, so the blocks do not
    depend on the device or on generate()'s logits processors. ``eos``: the ids never drawn."""
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    # transformers 5.x renames past_key_values to cache (the old name warns, then goes in 5.40)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True)
    past, logits = getattr(out, cache_arg), out.logits[:, -1]
    seq = [ids.cpu()]
    for i in range(new):
        logits = logits.float() / temperature
        if eos_ids:
            logits[:, eos_ids] = -float("inf")
        probs = torch.softmax(logits, dim=-1).cpu()
        nxt = torch.multinomial(probs, 1, generator=gen)
        seq.append(nxt)
        if i == new - 1:
            break
        out = model(input_ids=nxt.to(ids.device), use_cache=True, **{cache_arg: past})
        past, logits = getattr(out, cache_arg), out.logits[:, -1]
    return torch.cat(seq, dim=1).numpy()


def distill_blocks(train: np.ndarray, generated: np.ndarray | None, mode: str) -> np.ndarray:
    """The blocks the student trains on for ``distill.data`` = mode."""
    if mode == "corpus":
        return train
    mode = {"chat": "generated", "chat_mix": "mix"}.get(mode, mode)
    if generated is None or not len(generated):
        raise ValueError(f"distill.data {mode!r} needs the teacher's generations (distill.generated_blocks > 0)")
    if generated.shape[1] != train.shape[1]:
        raise ValueError(f"generated blocks of {generated.shape[1]} tokens against train blocks of {train.shape[1]}")
    return generated if mode == "generated" else np.concatenate([train, generated])


def training_splits(splits: DataSplits, teacher, tokenizer, cfg, cache: str | Path,
                    progress: bool = True) -> DataSplits:
    """``splits`` with its train blocks replaced by what ``cfg.data`` (a DistillConfig) asks for.

    With generations, the selection split (the distillation's best checkpoint and early stopping) gains as many
    samples of the teacher as it has corpus blocks, sampled in the same pass and never trained on: a student
    trained on the teacher's text is selected on it too, not on the corpus alone (which on SmolLM2 kept
    picking the untrained step 0). Only the distill stage reads these splits; the other stages keep theirs.

    The result is written to ``cache`` (an .npz) and read back on a re-run, so a resumed distillation
    trains on the same blocks without sampling them again."""
    if cfg.data == "corpus":
        return splits
    cache = Path(cache)
    if cache.is_file():
        return DataSplits.load(cache)
    n_eval = len(splits.selection)
    chat = cfg.data in ("chat", "chat_mix")
    generated = teacher_generations(
        teacher, cfg.generated_blocks + n_eval, splits.train.shape[1], seed=cfg.seed,
        temperature=cfg.generation_temperature, bos_id=splits.bos_token_id,
        exclude_ids=template_special_ids(tokenizer) if chat else list(getattr(tokenizer, "all_special_ids", [])),
        progress=progress, opening=chat_opening(tokenizer, splits.bos_token_id) if chat else None)
    train, held = generated[:cfg.generated_blocks], generated[cfg.generated_blocks:]
    out = dataclasses.replace(splits, train=distill_blocks(splits.train, train, cfg.data),
                              selection=np.concatenate([splits.selection, held]))
    tmp = cache.with_name(cache.stem + ".partial.npz")
    out.save(tmp)
    os.replace(tmp, cache)
    return out
