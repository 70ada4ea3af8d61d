"""Writes tiny_mc.jsonl: 8 four-way multiple-choice items from the Python docs shipped with CPython
(pydoc_data.topics): a sentence's first words as the context, its true ending and three other sentences'
endings as the choices. Deterministic; run from the repository root: python tests/data/lm_eval_task/make_data.py"""

import json
import random
import re
from pathlib import Path

from pydoc_data.topics import topics

sentences = []
for name in sorted(topics):
    for s in re.split(r"(?<=\.)\s+", " ".join(topics[name].split())):
        words = s.split()
        if 10 <= len(words) <= 16 and s.endswith(".") and re.fullmatch(r"[A-Za-z ,.'()-]+", s):
            sentences.append(words)
rng = random.Random(0)
picked = rng.sample(sentences, 8)
items = []
for i, words in enumerate(picked):
    cut = len(words) // 2
    ending = " ".join(words[cut:])
    others = [" ".join(w[len(w) // 2:]) for j, w in enumerate(picked) if j != i]
    choices = [ending, *rng.sample(others, 3)]
    rng.shuffle(choices)
    items.append({"context": " ".join(words[:cut]), "choices": choices, "label": choices.index(ending)})
out = Path(__file__).with_name("tiny_mc.jsonl")
out.write_text("".join(json.dumps(it) + "\n" for it in items))
print(f"{len(items)} items -> {out}")
