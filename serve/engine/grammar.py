"""Constrained decoding: a request's grammar (JSON schema, regex, choice list, Lark) and the matcher that masks
each step's logits to the tokens it allows and advances with each token the row keeps (llguidance; numpy only).

``GrammarSpec`` is what a request asks for, hashable (the result cache and the compiled-grammar cache key on it).
``GrammarCompiler`` (one per engine, built from the artifact's tokenizer) compiles a spec once and hands each
request a copy of the compiled matcher; a spec that does not compile raises ``SamplingError`` naming the request
field it came from. ``RowGrammar`` is one request's state: ``mask`` sets every forbidden token's logit to -inf,
``choose`` picks a row's token under the grammar (greedy rows check the model's own argmax
before paying for a mask), ``accept`` advances, ``mask_drafts`` masks a speculative row's k + 1 positions (each under the state after the
drafts before it) and leaves the state where it was, so the engine then advances by the tokens that stand.
Only constrained rows pay: an unconstrained request has no ``RowGrammar``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from serve.engine.sampling import SamplingError

log = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar")
GREEDY_TRIES = 4  # argmaxes a greedy row checks before it computes the grammar's mask
# JSON with the whitespace models write (newlines, indentation) but at most 24 characters of it between two tokens:
# free whitespace lets a model pad forever, and none at all pushes a model that indents off its own form (SmolLM2
# then ran on inside a string where, indenting, it closed the object; docs/serving-api.md).
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}
# one line, ", " and ": " (vLLM's disable_any_whitespace; tool calls, which models write on one line)
JSON_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What a row must generate. ``kind``: ``json`` (``value`` a JSON schema as canonical JSON text), ``regex``,
    ``choice`` (``value`` a JSON list of strings), ``grammar`` (Lark, llguidance's dialect, which also embeds JSON
    schemas as ``%json {...}``). ``field`` names the request field it came from, for errors; not part of equality."""

    kind: str
    value: str
    field: str = field(default="structured_outputs", compare=False)
    compact: bool = False  # json: one line, no whitespace beyond ", " and ": " (JSON_COMPACT)

    @classmethod
    def json_schema(cls, schema: dict | bool, field: str = "response_format", compact: bool = False) -> GrammarSpec:
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise SamplingError(field, f"{field}: a JSON schema must be an object (got {type(schema).__name__})")
        return cls("json", json.dumps(schema, sort_keys=False, separators=(",", ":")), field, compact)

    @classmethod
    def choice(cls, options: Sequence[str], field: str = "structured_outputs.choice") -> GrammarSpec:
        if not options or any(not isinstance(o, str) or not o for o in options):
            raise SamplingError(field, f"{field}: a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options)), field)

    def grammar_text(self) -> str:
        """The llguidance grammar (the JSON form its matcher takes)."""
        import llguidance

        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(
                self.value, defaults=JSON_COMPACT if self.compact else JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            alts = " | ".join(json.dumps(o) for o in json.loads(self.value))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alts}")
        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.value)
        raise SamplingError(self.field, f"{self.field}: unknown grammar kind {self.kind!r} (one of {KINDS})")


class GrammarCompiler:
    """Compiles specs for one tokenizer; the compiled matchers are kept (LRU, ``capacity``) and copied per request."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int], capacity: int = 64):
        import llguidance  # the server's only constrained-decoding dependency; imported when a grammar is first used

        eos = sorted(int(i) for i in eos_ids)
        self.vocab_size = int(vocab_size)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=eos or None)
        self.eos_ids = frozenset(eos)
        self.capacity = capacity
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and /metrics

    def matcher(self, spec: GrammarSpec) -> RowGrammar:
        """A fresh matcher for one request; SamplingError (naming ``spec.field``) if the grammar does not compile."""
        with self._lock:
            proto = self._compiled.get(spec)
            if proto is not None:
                self._compiled.move_to_end(spec)
        if proto is None:
            proto = self._compile(spec)
            with self._lock:
                self._compiled[spec] = proto
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        return RowGrammar(proto.deep_copy(), self.vocab_size)

    def _compile(self, spec: GrammarSpec):
        import llguidance

        try:
            text = spec.grammar_text()
        except (ValueError, TypeError) as e:
            raise SamplingError(spec.field, f"{spec.field}: {e}") from None
        m = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if m.is_error():
            raise SamplingError(spec.field, f"{spec.field}: the {spec.kind} does not compile: "
                                f"{m.get_error().strip().splitlines()[0]}")
        self.compiles += 1
        return m


class RowGrammar:
    """One request's grammar state (not thread-safe: the engine's step touches it, with its lock held)."""

    __slots__ = ("m", "vocab", "_bits")

    def __init__(self, matcher, vocab_size: int):
        self.m = matcher
        self.vocab = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the request ends with ``stop``)."""
        return self.m.is_stopped()

    @property
    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None

    def allowed(self) -> np.ndarray:
        """Boolean [vocab]: the tokens the grammar allows next."""
        self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab].view(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one row of ``logits`` [vocab] with the forbidden tokens at -inf."""
        out = np.asarray(logits, dtype=np.float32).copy()
        out[~self.allowed()[: out.shape[-1]]] = -np.inf
        return out

    def choose(self, logits: np.ndarray, sample: Callable[[np.ndarray], int], greedy: bool,
               untruncated: bool = False) -> int:
        """The token ``sample`` picks from ``logits`` restricted to what the grammar allows.

        A greedy row first takes the model's own argmax and checks that one token (no mask: what most steps of a
        model that follows its schema cost, ~0.003 ms against ~0.2 ms for a 49k vocabulary's mask); a refused one is
        set to -inf and the next argmax checked, up to GREEDY_TRIES, before the row pays the mask. The argmax of the
        masked logits is the same token either way (ties included: both take the lowest id).

        A sampled row with no truncation (``untruncated``: no top-k, top-p or min-p, whose sets would differ before
        and after the mask) draws from the unmasked distribution p and keeps an allowed token; a refused draw is
        replaced by a draw from the masked one. Token t then comes with p(t) + (1 - A) p(t) / A = p(t) / A (A: the
        mass the grammar allows), exactly the masked distribution, for one draw where the model agrees with its
        grammar and two where it does not. Other sampled rows always draw from the masked logits (one draw)."""
        if greedy:
            x = logits
            for _ in range(GREEDY_TRIES):  # the highest allowed token, found from the top down
                tok = sample(x)
                if self.m.validate_tokens([tok]) == 1:
                    return tok
                if x is logits:
                    x = np.array(logits, dtype=np.float32)
                x[tok] = -np.inf
        elif untruncated:
            tok = sample(logits)
            if self.m.validate_tokens([tok]) == 1:
                return tok
        return sample(self.mask(logits))

    def accept(self, token: int) -> bool:
        """Advance by one kept token; False (and the matcher in its error state) if the grammar forbids it."""
        return bool(self.m.consume_token(int(token)))

    def mask_drafts(self, logits: np.ndarray, drafts: Sequence[int]) -> np.ndarray:
        """``logits`` [k + 1, vocab] of a row checked with k drafts: row i masked under the state after drafts[:i].
        A draft the grammar forbids gets -inf at its own position (so it is never accepted) and the rows after it
        stay as they are (they are never read). The state is left as it was."""
        out = np.asarray(logits, dtype=np.float32).copy()
        consumed = 0
        for i in range(out.shape[0]):
            out[i, ~self.allowed()[: out.shape[-1]]] = -np.inf
            if i == len(drafts) or not np.isfinite(out[i, int(drafts[i])]):
                break
            if not self.m.consume_token(int(drafts[i])):  # allowed by the mask: cannot fail, but never trust it
                break
            consumed += 1
        if consumed:
            self.m.rollback(consumed)
        return out
