"""Special tokens as the model expects them: does a sequence start with BOS, and which ids end generation.

One decision per model, made from its tokenizer (and model config), applied wherever text becomes
tokens on the compress side (data blocks, golden prompts) and written to the artifact manifest so the
server can apply the same rule (``from_manifest`` is that rule read back; standard library only, so the
server, which does not import compress/, can mirror it in a few lines).

The BOS rule: a model takes BOS at the start of every sequence when its tokenizer has a BOS token and
encoding text with special tokens (``tokenizer("x")``, what the model's own authors ship as the default)
puts that BOS first. This reads the tokenizer's post-processor, which is where every source records
the choice: ``add_bos_token`` in a tokenizer_config, and for a GGUF file its
``tokenizer.ggml.add_bos_token`` metadata, which transformers maps to ``add_bos_token`` and bakes into
the converted tokenizer.json (the attribute itself is not saved; the post-processor is). SmolLM2 has a
BOS token but does not add it: no BOS. Llama-style sentencepiece models add it: BOS.

Chat templates: a template that writes ``{{ bos_token }}`` itself (``chat_template_adds_bos``) already
starts the rendered text with BOS, so rendered chat text is then encoded without adding another.

EOS ids: the union of the generation config's and the config's ``eos_token_id`` (an int or a list) and
the tokenizer's EOS, sorted (what manifests held before), then any end-of-turn token the chat template
writes (``<|eot_id|>``, ``<end_of_turn>``, ...) that is not already there, appended so the first id stays
the model's primary EOS. Generation stops on any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Tokens that end an assistant turn in common chat formats; counted as EOS when the model's chat template
# writes them (so the model learned to emit them) and the vocabulary has them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|end_of_turn|>",
                      "</s>", "<|END_OF_TURN_TOKEN|>")


@dataclass(frozen=True)
class SpecialTokens:
    """bos_id: prepended to every sequence, None when the model takes no BOS. eos_ids: generation stops on any."""

    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    chat_template_adds_bos: bool = False

    @property
    def add_bos(self) -> bool:
        return self.bos_id is not None

    def prefix(self) -> list[int]:
        return [self.bos_id] if self.bos_id is not None else []

    def encode(self, tokenizer, text: str) -> list[int]:
        """Plain text (a prompt, a document) as the model expects it: BOS (when it takes one) + the text's tokens."""
        return self.prefix() + list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_rendered_chat(self, tokenizer, text: str) -> list[int]:
        """Text rendered by the chat template: BOS is added only when the template did not write it."""
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def manifest_fields(self) -> dict:
        return {"add_bos_token": self.add_bos, "eos_token_ids": list(self.eos_ids),
                "chat_template_adds_bos": self.chat_template_adds_bos}


def bos_id_of(tokenizer) -> int | None:
    """The BOS id when the model expects every sequence to start with it, else None (see the module doc)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        with_special = list(tokenizer("x")["input_ids"])
        plain = list(tokenizer("x", add_special_tokens=False)["input_ids"])
    except Exception:  # a tokenizer that cannot encode: fall back to its flag
        return int(bos) if getattr(tokenizer, "add_bos_token", False) else None
    added = with_special[: len(with_special) - len(plain)] if with_special[len(with_special) - len(plain):] == plain else []
    return int(bos) if added[:1] == [int(bos)] else None


def _as_ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if x is not None]
    return [int(v)]


def eos_ids_of(model, tokenizer) -> list[int]:
    """Every id that ends generation (see the module doc for the order)."""
    ids: set[int] = set()
    if model is not None:
        for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
            ids.update(_as_ids(getattr(src, "eos_token_id", None) if src is not None else None))
    ids.update(_as_ids(getattr(tokenizer, "eos_token_id", None)))
    out = sorted(ids)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        vocab = tokenizer.get_vocab()
        out += sorted({int(vocab[t]) for t in END_OF_TURN_TOKENS if t in template and t in vocab} - ids)
    return out


def chat_template_adds_bos(tokenizer) -> bool:
    """Whether the chat template writes BOS itself (its rendering of one user message starts with the BOS token)."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not getattr(tokenizer, "chat_template", None):
        return False
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return isinstance(text, str) and text.startswith(bos)


def special_tokens(tokenizer, model=None) -> SpecialTokens:
    """The one decision for a model: its BOS rule and EOS ids (model optional: the tokenizer's EOS only)."""
    return SpecialTokens(bos_id_of(tokenizer), eos_ids_of(model, tokenizer), chat_template_adds_bos(tokenizer))


def from_manifest(manifest: dict) -> SpecialTokens:
    """The decision recorded in an artifact manifest. Manifests written before these fields existed read as
    today's behaviour then: no BOS added, the listed EOS ids, the template's text encoded as it is."""
    bos = manifest.get("bos_token_id")
    add = bool(manifest.get("add_bos_token", False)) and bos is not None
    return SpecialTokens(int(bos) if add else None, _as_ids(manifest.get("eos_token_ids")),
                         bool(manifest.get("chat_template_adds_bos", False)))
