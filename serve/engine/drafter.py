"""The engine's speculative-decoding front: which decode rows of a step get drafts, from which source, how long.

serve/engine/speculative.py has the rules (prompt lookup, the acceptance rule, the adaptive length);
serve/engine/draft_model.py the second model. The engine asks ``propose`` after scheduling a step (outside its
lock: a draft model runs there), hands the drafts to the scheduler, and reports every check to ``verified``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import numpy as np
from dataclasses import dataclass

from serve.config import ServeConfig
from serve.engine.scheduler import ScheduledSeq
from serve.engine.speculative import DraftLength, prompt_lookup
from serve.kv.cache import ScratchSequence
from serve.runners.protocol import RunRow

log = logging.getLogger(__name__)


@dataclass
class SpecCounters:
    """Monotonic counters, as vLLM's spec-decode metrics: checks, drafted tokens, accepted tokens."""

    drafts: int = 0  # rows that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0


class Drafter:
    def __init__(self, config: ServeConfig, *, draft_model=None):
        self.k_max = config.speculative_tokens
        self.max_rows = config.speculative_max_rows
        self.ngram = config.speculative_ngram
        self.model = draft_model
        self.lengths: dict[Hashable, DraftLength] = {}
        # beside a draft head, prompt lookup keeps a length of its own: on code edits its copies stand where the
        # head's guesses fail, and one source's failures must not pause the other
        self.lookup_lengths: dict[Hashable, DraftLength] = {}
        self._allowed: dict[Hashable, tuple[int, int]] = {}  # this step's (lookup k, head k) per request
        self._source: dict[Hashable, dict] = {}  # which lengths the drafts being checked came from
        self.counters = SpecCounters()

    def _length(self, key: Hashable, greedy: bool = True, lengths: dict | None = None) -> DraftLength:
        lengths = self.lengths if lengths is None else lengths
        d = lengths.get(key)
        if d is None:
            # the costs are timings, which differ run to run: a sampled request's lengths follow its acceptance
            # alone, so a seeded request draws the same numbers twice (greedy text is the same at any length)
            d = lengths[key] = DraftLength(self.k_max, self.costs if greedy else None)
        return d

    costs: list[float] | None = None  # a check of n positions over a decode step (index n), from ``calibrate``

    def calibrate(self, runner, block_manager, reps: int = 3) -> list[float]:
        """Time a check of 1 .. k_max + 1 positions on the runner (a scratch sequence's blocks, given back after):
        what a drafted step costs on this machine and graph, for the draft lengths (speculative.best_length)."""
        if self.model is not None and not self.reads_hidden:
            return []  # a draft model pays per drafted token too: its length stays the heuristic's
        scratch = ScratchSequence("check-costs")
        key = (scratch.request_id, scratch.epoch)  # the runner's name for its rows
        n_max = self.k_max + 1
        block_manager.start(scratch)
        try:
            if not block_manager.allocate(scratch, 64 + n_max):
                return []
            table = block_manager.block_table(scratch)
            runner.execute([RunRow(key, table, 0, list(range(1, 65)), True, False)])
            median = []
            for n in range(1, n_max + 1):
                times = []
                for _ in range(reps + 1):
                    t0 = time.perf_counter()
                    runner.execute([RunRow(key, table, 64, list(range(1, n + 1)), True, n > 1)])
                    times.append(time.perf_counter() - t0)
                median.append(float(np.median(times[1:])))
        except Exception:  # noqa: BLE001 - without the costs the lengths follow the heuristic alone
            log.exception("timing speculative checks failed; draft lengths follow acceptance alone")
            return []
        finally:
            block_manager.free(scratch)  # its on_free hook releases the runner's row
        self.costs = [0.0, *(t / median[0] for t in median)]
        log.info("speculative checks cost %s x a decode step at 1 .. %d positions",
                 ", ".join(f"{c:.2f}" for c in self.costs[1:]), n_max)
        return self.costs

    def candidates(self, rows: Sequence[ScheduledSeq], max_model_len: int) -> list[tuple[ScheduledSeq, int]]:
        """The step's decode rows that should draft now, each with how many tokens (none when the step is larger
        than ``speculative_max_rows``)."""
        if len(rows) > self.max_rows:
            return []
        out = []
        for r in rows:
            seq = r.seq
            if r.num_tokens != 1 or not r.samples or seq.params.prompt_logprobs is not None:
                continue
            # room for the drafts and the token after them, within max_tokens and the context
            room = min(seq.params.max_tokens - seq.num_output - 1, max_model_len - len(seq.token_ids))
            if room < 1:
                continue
            key = (seq.request_id, seq.epoch)
            k = self._length(key, seq.params.is_greedy).want()
            if self.reads_hidden:
                look = self._length(key, seq.params.is_greedy, self.lookup_lengths).want()
                self._allowed[key] = (min(look, room), min(k, room))
                k = max(k, look)
            k = min(k, room)
            if k > 0:
                out.append((r, k))
        return out

    def propose(self, wanted: Sequence[tuple[ScheduledSeq, int]]) -> list[list[int]]:
        """Drafts for each (row, k); [] where the source has none. Never raises: a failing draft model logs and
        drafts nothing, and the step runs without speculation."""
        if self.model is None:  # prompt lookup
            return [prompt_lookup(r.seq.token_ids, k, self.ngram) for r, k in wanted]
        if self.reads_hidden:
            # a draft head costs little and knows nothing of the prompt: where the sequence repeats an n-gram of two
            # tokens or more (code edits, quoting) the lookup's tokens go, the head drafts the other rows, and a
            # one-token match (a common word: weak evidence) drafts only where the head does not
            keys = [(r.seq.request_id, r.seq.epoch) for r, _ in wanted]
            allowed = [self._allowed.pop(key, (k, k)) for key, (_, k) in zip(keys, wanted)]
            looked = [prompt_lookup(r.seq.token_ids, lk, self.ngram, min_ngram=min(2, self.ngram)) if lk else []
                      for (r, _), (lk, _) in zip(wanted, allowed)]
            rest = [i for i, (d, (_, hk)) in enumerate(zip(looked, allowed)) if not d and hk]
            drafted = self._model_drafts([(wanted[i][0], allowed[i][1]) for i in rest]) if rest else []
            for i, d in zip(rest, drafted):
                looked[i] = d
            rest = [i for i in rest if looked[i]]
            for i, ((r, _), (lk, _)) in enumerate(zip(wanted, allowed)):
                if not looked[i] and lk:
                    looked[i] = prompt_lookup(r.seq.token_ids, lk, self.ngram)
            for i, key in enumerate(keys):
                self._source[key] = self.lookup_lengths if i not in rest else self.lengths
            return looked
        return self._model_drafts(wanted)

    def _model_drafts(self, wanted: Sequence[tuple[ScheduledSeq, int]]) -> list[list[int]]:
        try:
            return self.model.propose([((r.seq.request_id, r.seq.epoch), r.seq.token_ids, k) for r, k in wanted])
        except Exception:  # noqa: BLE001 - drafts are an optimisation: serve without them
            log.exception("the draft model failed; this step runs without drafts")
            for r, _ in wanted:  # what the draft holds for them may be half written: start them afresh
                self.model.release((r.seq.request_id, r.seq.epoch))
            return [[] for _ in wanted]

    @property
    def reads_hidden(self) -> bool:
        """Whether the source drafts from the served model's hidden state (a draft head): the runner outputs it."""
        return bool(getattr(self.model, "reads_hidden", False))

    def observe(self, key: Hashable, n_tokens: int, hidden) -> None:
        """The served model's hidden state at the position that chose the sequence's newest token."""
        self.model.observe(key, n_tokens, hidden)

    def verified(self, key: Hashable, proposed: int, accepted: int) -> None:
        c = self.counters
        c.drafts += 1
        c.draft_tokens += proposed
        c.accepted_tokens += accepted
        self._length(key, lengths=self._source.pop(key, None)).update(proposed, accepted)

    def release(self, key: Hashable) -> None:
        """The request's sequence is gone (finished, cancelled, preempted: a new epoch starts afresh)."""
        for held in (self.lengths, self.lookup_lengths, self._allowed, self._source):
            held.pop(key, None)
        if self.model is not None:
            self.model.release(key)


def make_drafter(config: ServeConfig, manifest: dict, tokenizer) -> Drafter | None:
    """The drafter ``serve.speculative`` asks for (None when off); a draft model is loaded here."""
    if config.speculative == "off":
        return None
    model = None
    # "auto" reaches here only for a local folder (the registry's model manager resolves it to the champion's own
    # drafter): prompt lookup
    if config.speculative not in ("prompt_lookup", "auto"):
        from serve.engine.draft_head import DraftHead, is_draft_head

        if is_draft_head(config.speculative):  # the served model's own head (compress/draft/)
            model = DraftHead(config.speculative, config, manifest, tokenizer)
        else:
            from serve.engine.draft_model import DraftModel  # a second runner: only when asked for

            model = DraftModel(config.speculative, config, manifest, tokenizer)
    return Drafter(config, draft_model=model)
