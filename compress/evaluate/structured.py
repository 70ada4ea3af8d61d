"""The accept gate's structured genre: what programs ask of a chat model (JSON into a schema, one tool call among
several tools), scored for the candidate against the baseline.

A compressed model that keeps its perplexity can still lose JSON validity or tool-call accuracy. The tasks
(``accept.structured_sets``; ``structured`` = compress/evaluate/chatsets/structured.jsonl, read by no other stage):
``extract`` and ``json`` tasks ask for a JSON object with given keys, ``tool`` tasks offer several tools. Each model
answers each task twice, greedily, on the serving engine, rendered as the server renders it (serve/api/tools.py):

- free (no constraint; tools with ``tool_choice`` auto): valid when the answer parses and validates against the
  task's schema, or is a call of an offered tool whose arguments validate: ``structured_valid_share``, and the drop
  against the baseline's share, ``structured_valid_drop`` (accept.max_structured_valid_drop);
- constrained (``response_format`` json_schema; ``tool_choice`` required): valid by construction, so what counts is
  whether the candidate gives the baseline's answer, field by field: the same tool (another tool scores 0) with the
  same arguments, the same value under each key: ``structured_agreement`` (accept.min_structured_agreement); the
  share of answers equal whole is ``structured_exact_agreement`` (logged).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

NAMED = {"structured": "chatsets/structured.jsonl", "structured_second": "chatsets/structured_second.jsonl"}


class StructuredEvalError(ValueError):
    pass


def load_tasks(specs: list[str], field: str = "accept.structured_sets") -> list[dict]:
    tasks = []
    for spec in specs:
        if spec in NAMED:
            text = resources.files("compress.evaluate").joinpath(NAMED[spec]).read_text()
        elif Path(spec).is_file():
            text = Path(spec).read_text()
        else:
            raise StructuredEvalError(f"{field}: {spec!r} is neither a named set ({', '.join(NAMED)}) nor a .jsonl file")
        for i, line in enumerate(l for l in text.splitlines() if l.strip()):
            t = json.loads(line)
            if t.get("kind") not in ("extract", "json", "tool") or not t.get("messages") or \
                    ("tools" if t["kind"] == "tool" else "schema") not in t:
                raise StructuredEvalError(f"{field}: {spec} line {i + 1}: a task needs kind (extract, json, tool), "
                                          "messages, and schema (extract, json) or tools (tool)")
            tasks.append(t)
    return tasks


def json_in(text: str):
    """The JSON object in a free answer: the whole text, a fenced block, or the outermost {...} span; else None."""
    spans = [text, *re.findall(r"```(?:json)?\s*(.*?)```", text, flags=re.S)]
    if "{" in text:
        spans.append(text[text.find("{"):text.rfind("}") + 1])
    for s in spans:
        try:
            obj = json.loads(s)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def valid_against(obj, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(obj, schema)
        return True
    except jsonschema.ValidationError:
        return False


@dataclass
class Answers:
    free: list[str]  # each task's unconstrained answer (text)
    free_calls: list[list[tuple[str, dict]]]  # tool tasks: the calls parsed from it ([] elsewhere)
    forced: list[str | tuple[str, dict] | None]  # constrained: the JSON text, or the one (name, arguments) call
    # (its text where max_new_tokens cut it short)


def answer(artifact: str | Path, tasks: list[dict], max_new_tokens: int) -> Answers:
    """Both answers of every task from ``artifact``, all requests on one evaluation engine."""
    from compress.evaluate.generate import evaluation_engine
    from serve.api.chat_template import render_template, template_specials
    from serve.api.tools import ToolUse, added_tokens, detect_format, with_tools
    from serve.artifact import read_manifest
    from serve.engine.grammar import GrammarSpec
    from serve.engine.sampling import SamplingParams
    from serve.engine.tokenizer import encode_chat, load_tokenizer

    manifest = read_manifest(artifact, verify=False)
    source = manifest.get("chat_template")
    if not source:
        raise StructuredEvalError(f"{artifact}: no chat template; set accept.structured_sets: [] for a model that is "
                                  "not used through chat")
    tok = load_tokenizer(artifact)
    fmt, markers = detect_format(source), added_tokens(tok)
    specials = template_specials(tok, manifest)
    jobs = []  # (task index, "free" | "forced", prompt ids, grammar, ToolUse or None)
    for i, t in enumerate(tasks):
        use = ToolUse(fmt, t["tools"], None, markers) if t["kind"] == "tool" else None
        msgs, extra = with_tools(source, t["messages"], use)
        ids = encode_chat(tok, manifest, render_template(source, msgs, True, **specials, **extra))
        forced = (ToolUse(fmt, t["tools"], "required", markers).grammar() if use
                  else GrammarSpec.json_schema(t["schema"], "accept.structured_sets"))
        jobs += [(i, "free", ids, None, use), (i, "forced", ids, forced, use)]
    out = Answers([""] * len(tasks), [[] for _ in tasks], [None] * len(tasks))
    with evaluation_engine(artifact, [j[2] for j in jobs], max_new_tokens) as engine:
        handles = [engine.add_request(ids, SamplingParams.greedy(max_new_tokens, structured=g,
                                                                 skip_special_tokens=False))
                   for _, _, ids, g, _ in jobs]
        engine.run_until_done()
        for (i, mode, _, _, use), h in zip(jobs, handles):
            text = h.result().text
            if mode == "free":
                out.free[i] = text
                if use is not None:
                    out.free_calls[i] = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                         for c in use.split(text)[1]]
            elif use is not None:
                calls = use.split(text)[1]  # a call cut short by max_new_tokens stays its text
                out.forced[i] = ((calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"]))
                                 if calls else text)
            else:
                out.forced[i] = text
    return out


def free_valid(task: dict, a: Answers, i: int) -> bool:
    if task["kind"] == "tool":
        params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in task["tools"]}
        calls = a.free_calls[i]
        return bool(calls) and all(n in params and valid_against(args, params[n]) for n, args in calls)
    obj = json_in(a.free[i])
    return obj is not None and valid_against(obj, task["schema"])


def same_forced(x, y) -> bool:
    """The same constrained answer: the same call (name and arguments), the same JSON object, or (cut short by
    max_new_tokens) the same text."""
    if x is None or y is None:
        return False
    if isinstance(x, tuple) or isinstance(y, tuple):
        return x == y
    try:
        return json.loads(x) == json.loads(y)
    except ValueError:
        return x == y


def _obj(x):
    """A constrained answer as fields: a call's {"name", **arguments}, a JSON object's keys; None when unparsed."""
    if isinstance(x, tuple):
        return {"\0name": x[0], **x[1]}
    try:
        obj = json.loads(x) if isinstance(x, str) else None
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def field_agreement(x, y) -> float:
    """The share of fields a candidate's constrained answer has as the baseline's: every key of either (a call's name
    counts as one; another tool scores 0); two answers that did not parse agree when their texts do."""
    a, b = _obj(x), _obj(y)
    if a is None or b is None:
        return float(a is None and b is None and x == y and x is not None)
    if a.get("\0name") != b.get("\0name"):
        return 0.0
    keys = set(a) | set(b)
    return sum(k in a and k in b and a[k] == b[k] for k in keys) / len(keys) if keys else 1.0


def structured_figures(candidate: Answers, baseline: Answers, tasks: list[dict]) -> dict:
    n = len(tasks)
    cand = [free_valid(t, candidate, i) for i, t in enumerate(tasks)]
    base = [free_valid(t, baseline, i) for i, t in enumerate(tasks)]
    exact = [same_forced(candidate.forced[i], baseline.forced[i]) for i in range(n)]
    agree = [field_agreement(candidate.forced[i], baseline.forced[i]) for i in range(n)]
    by_kind = {k: {"valid": sum(c for c, t in zip(cand, tasks) if t["kind"] == k),
                   "baseline_valid": sum(b for b, t in zip(base, tasks) if t["kind"] == k),
                   "agree": sum(a for a, t in zip(agree, tasks) if t["kind"] == k),
                   "n": sum(t["kind"] == k for t in tasks)} for k in sorted({t["kind"] for t in tasks})}
    return {"structured_valid_share": sum(cand) / n, "structured_baseline_valid_share": sum(base) / n,
            "structured_valid_drop": (sum(base) - sum(cand)) / n, "structured_agreement": sum(agree) / n,
            "structured_exact_agreement": sum(exact) / n, "structured_tasks": n, "by_kind": by_kind}


def evaluate_structured(candidate: str | Path, baseline: str | Path, tasks: list[dict], max_new_tokens: int) -> dict:
    """The genre's figures of ``candidate`` against ``baseline`` (artifact folders)."""
    if not tasks:
        return {}
    return structured_figures(answer(candidate, tasks, max_new_tokens), answer(baseline, tasks, max_new_tokens), tasks)
