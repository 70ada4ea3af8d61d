"""The target's own conversations, for its drafter to learn: prompts, the target's greedy answers and, at every
answer position, the target's last hidden state (what the draft head reads when it serves).

The answers come from the serving engine on the target's own artifact (serve/engine/engine.py, greedy, many users
at once), with the runner's ``hidden`` output recorded through the engine's ``hidden_sink``: no second pass, and
the states are exactly those the server will hand the head (same graph, same kernels).

Prompts, all offline (nothing is downloaded) and none of the serving benchmark's (benchmarks/sweep.py TOPICS,
benchmarks/speculative.py FUNCTIONS), which judge the drafter:
  * user turns the target writes itself, sampled after its chat template opens a user turn (as ``distill.data:
    chat`` does, compress/distill/data.py): the target's own idea of a request;
  * questions on the topics of CPython's own documentation (``pydoc_data.topics``, the default corpus's source);
  * edits and explanations of standard-library functions, their source inline (the copy-heavy genre of code edits).
"""

from __future__ import annotations

import importlib
import inspect
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

GENERAL = ("rainbows", "the water cycle", "a chess opening", "how vaccines work", "the Roman empire", "glaciers",
           "a healthy breakfast", "learning a language", "electric cars", "the stock market", "coral reefs",
           "time zones", "a first marathon", "the human heart", "bread baking", "earthquakes", "public speaking",
           "the solar system", "saving money", "honey bees", "the internet", "a camping trip", "the piano",
           "climate change", "ancient Egypt", "a good night's sleep", "magnets", "the Olympic games", "origami",
           "the immune system", "tea", "lighthouses", "wind power", "a job offer", "dinosaurs", "the Moon landing")
ASKS = ("Describe {t} in a short paragraph.", "What are the main ideas behind {t}?", "Summarize what matters about "
        "{t}.", "Write a short poem about {t}.", "List some tips related to {t}.", "How would you explain {t} to a "
        "friend?", "Why is {t} interesting?")
DOC_ASKS = ("Explain the Python topic '{t}' with a short example.", "What does the Python reference say about "
            "'{t}'? Answer briefly.", "Give an example of '{t}' in Python and explain it.")
CODE_ASKS = ("Add a docstring to this Python function. Reply with the complete function only, in one Python code "
             "block.", "Explain what this Python function does, step by step.", "Rewrite this Python function with "
             "clearer variable names. Reply with the complete function only.", "Add type hints and a docstring to "
             "this function. Reply with the complete function in one code block.", "Write two unit tests for this "
             "function.")
CODE_FUNCTIONS = ("textwrap.wrap", "textwrap.fill", "textwrap.shorten", "string.Template.substitute",
                  "posixpath.join", "posixpath.splitext", "posixpath.normpath", "posixpath.relpath", "fnmatch.translate",
                  "fnmatch.filter", "shlex.split", "shlex.join", "html.unescape", "base64.b64encode", "calendar.isleap",
                  "calendar.leapdays", "bisect.insort_right", "heapq.nlargest", "heapq.nsmallest", "heapq.merge",
                  "statistics.mean", "statistics.variance", "statistics.stdev", "statistics.quantiles",
                  "colorsys.yiq_to_rgb", "colorsys.rgb_to_yiq", "difflib.get_close_matches", "json.dumps",
                  "json.loads", "random.Random.shuffle", "random.Random.choices", "functools.reduce",
                  "functools.total_ordering", "operator.attrgetter", "copy.deepcopy", "glob.glob", "glob.escape",
                  "ntpath.splitdrive", "urllib.parse.urljoin", "urllib.parse.quote", "urllib.parse.urlencode",
                  "zipfile.is_zipfile", "tempfile.mkdtemp", "shutil.copyfile", "shutil.which", "os.makedirs",
                  "contextlib.contextmanager", "dataclasses.asdict", "dataclasses.replace", "enum.unique",
                  "inspect.getdoc", "inspect.cleandoc", "keyword.iskeyword", "locale.atof", "secrets.token_hex",
                  "textwrap.TextWrapper.wrap", "typing.get_type_hints",
                  "warnings.warn_explicit", "weakref.finalize.__call__", "uuid.uuid4", "ipaddress.ip_address",
                  "pprint.pformat", "quopri.encodestring", "sched.scheduler.run", "traceback.format_exception")


@dataclass
class Conversation:
    """One conversation: its tokens (prompt then answer), where the answer starts, and the hidden state that chose
    each answer token (``hidden[j]`` chose ``ids[start + j]``), fp16."""

    ids: np.ndarray
    start: int
    hidden: np.ndarray


def _source(name: str) -> str | None:
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return inspect.getsource(obj)
        except (AttributeError, OSError, TypeError):
            return None
    return None


def written_prompts(n: int, seed: int) -> list[str]:
    """``n`` user requests from the three offline sources, shuffled (the target's own turns are added apart)."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    sources = [s for s in map(_source, CODE_FUNCTIONS) if s and len(s) < 2500]
    out: list[str] = []
    while len(out) < n:  # each round asks again with other forms
        batch = [rng.choice(ASKS).format(t=t) for t in GENERAL for _ in range(2)]
        batch += [rng.choice(DOC_ASKS).format(t=t) for t in sorted(topics)]
        batch += [f"{rng.choice(CODE_ASKS)}\n\n```python\n{src}```" for src in sources]
        rng.shuffle(batch)
        out += batch
    return out[:n]


def _render(engine, messages: list[dict]) -> str:
    """``messages`` in the target's chat template, as the server renders them, up to the answer."""
    from serve.api.chat_template import render_template, template_specials

    manifest = engine.manifest
    return render_template(manifest["chat_template"], messages, True, **template_specials(engine.tokenizer, manifest))


def chat_ids(engine, messages: list[dict]) -> list[int]:
    """The prompt's ids as the model is used: a chat in its template, or the last message's plain text for a model
    without a chat template (its drafter learns completions)."""
    from serve.engine.tokenizer import encode_chat, encode_prompt

    if not engine.manifest.get("chat_template"):
        return encode_prompt(engine.tokenizer, engine.manifest, messages[-1]["content"])
    return encode_chat(engine.tokenizer, engine.manifest, _render(engine, messages))


def own_turns(engine, n: int, seed: int, max_tokens: int = 64) -> list[str]:
    """``n`` user turns the target writes itself: sampled (temperature 0.9) after its chat template opens a user
    turn, up to the end of the turn."""
    from serve.engine.tokenizer import encode_chat
    from serve.engine.sampling import SamplingParams

    mark = "MARKER7b1f"
    text = _render(engine, [{"role": "user", "content": mark}])
    opening = encode_chat(engine.tokenizer, engine.manifest, text[:text.index(mark)])
    tokenizer = engine.tokenizer
    turns = []
    wave = 128  # in waves: the engine's waiting queue is bounded (serve.max_waiting)
    bar = tqdm(total=n, desc="target's own user turns", leave=False)
    for lo in range(0, n, wave):
        handles = [engine.add_request(opening, SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed + i))
                   for i in range(lo, min(n, lo + wave))]
        for h in handles:
            text = tokenizer.decode(h.result().output_ids, skip_special_tokens=True).strip()
            if len(text) > 8:
                turns.append(text)
            bar.update(1)
    bar.close()
    return turns


def record(artifact: str | Path, n_prompts: int, *, max_tokens: int = 192, users: int = 8, own_share: float = 0.3,
           seed: int = 0, kv_memory_mb: int = 1024, progress: bool = True) -> list[Conversation]:
    """The target's greedy answers to ``n_prompts`` prompts (``own_share`` of them its own user turns), with the
    hidden state behind every answer token."""
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams

    states: dict[str, dict[int, np.ndarray]] = {}

    def sink(request_id: str, n_tokens: int, hidden: np.ndarray) -> None:
        states.setdefault(request_id, {})[n_tokens - 1] = hidden.astype(np.float16)

    config = ServeConfig(max_batch_size=users, result_cache_size=0, enable_prefix_caching=False,
                         kv_memory_mb=kv_memory_mb)
    engine = Engine(artifact, config, start=True, hidden_sink=sink)
    try:
        # a model without a chat template has no user turn to write
        n_own = int(round(n_prompts * own_share)) if engine.manifest.get("chat_template") else 0
        prompts = own_turns(engine, n_own, seed) + written_prompts(n_prompts - n_own, seed)
        out: list[Conversation] = []
        bar = tqdm(total=len(prompts), desc="target's answers", disable=not progress)
        pending = list(prompts)
        running: list = []
        while pending or running:
            while pending and len(running) < users * 2:
                ids = chat_ids(engine, [{"role": "user", "content": pending.pop()}])
                if len(ids) + max_tokens > engine.max_model_len:  # a long function for a short context: skip it
                    bar.update(1)
                    continue
                running.append((engine.add_request(ids, SamplingParams.greedy(max_tokens)), len(ids)))
            if not running:
                break
            handle, start = running.pop(0)
            res = handle.result()
            seen = states.pop(handle.request_id, {})
            ids = np.asarray([*res.prompt_ids, *res.output_ids], np.int32)
            n = len(ids) - start
            if n >= 2 and all(start + j in seen for j in range(n)):
                out.append(Conversation(ids, start, np.stack([seen[start + j] for j in range(n)])))
            bar.update(1)
        bar.close()
        return out
    finally:
        engine.shutdown()


def save(convs: list[Conversation], path: str | Path) -> None:
    """The conversations in one .npz (ids and hidden states concatenated, with offsets)."""
    lens = np.array([len(c.ids) for c in convs])
    np.savez(path, ids=np.concatenate([c.ids for c in convs]), lens=lens, starts=np.array([c.start for c in convs]),
             hidden=np.concatenate([c.hidden for c in convs]))


def load(path: str | Path) -> list[Conversation]:
    with np.load(path) as z:  # each z[key] reads the array again: once each
        all_ids, hidden, lens, starts = z["ids"], z["hidden"], z["lens"], z["starts"]
    out, at, hat = [], 0, 0
    for n, s in zip(lens, starts):
        ids = all_ids[at:at + n]
        out.append(Conversation(ids, int(s), hidden[hat:hat + n - s]))
        at, hat = at + n, hat + n - s
    return out
