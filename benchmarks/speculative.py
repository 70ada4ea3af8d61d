"""Speculative decoding through the server: tokens/s with and without drafts, one sitting, the openai SDK.

    python -m benchmarks.speculative --artifact <artifact> [--method prompt_lookup] [--method draft=<draft artifact>]
        [--prompts 6] [--max-tokens 256] [--load 8 32] [--workloads code_edit chat]
        [--out benchmarks/results/speculative.json]

A ``draft=`` folder may be a draft model or a draft head (compress/draft/, docs/drafter.md).

One user (streamed ``chat.completions``, greedy, caches off: result cache 0, prefix caching off):
  * ``code_edit``: a function from CPython's own sources and an instruction whose answer rewrites it (type hints,
    a rename, comments): the answer copies much of the prompt, where prompt lookup lands its drafts;
  * ``chat``: the short user turns of benchmarks/sweep.py (the answer copies nothing).
Each prompt runs on a fresh server per method, servers one after another; tokens/s = completion tokens / wall time
summed over the prompts, and each method's figure is printed as a multiple of ``off`` measured in the same run.
Greedy outputs must be identical to ``off`` on every prompt (the text is compared; a difference is reported).

Under load (``--load``): c users at once, chat prompts, 64 tokens each (``ignore_eos``), 2 requests per user, not
streamed, speculation on vs off: the back-off (serve.speculative_max_rows) must keep tokens/s at >= 0.97x.
The server's spec-decode counters (/metrics) give the acceptance rate and tokens per check; each one-user server's
peak RSS (VmHWM) is recorded beside its tokens/s.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks import run_modes
from benchmarks.sweep import chats, cpu_flags
from loadtest.loadgen import parse_prometheus, read_peak_rss
from loadtest.serve_bench import running_server
from compress.evaluate.structured import json_in, load_tasks, valid_against
from loadtest.loadgen import read_peak_rss

MODES_HELP = 'modes (each with its own --help): --structured: structured outputs and tool calls through the server (formerly benchmarks/structured.py)'
ROOT = Path(__file__).resolve().parent.parent
EDITS = ("Add type hints to this Python function. Reply with the complete updated function only, in one Python code "
         "block.",
         "Rename this function by adding the suffix _v2 to its name and change nothing else. Reply with the complete "
         "function only, in one Python code block.",
         "Add a short comment above each statement of this function. Reply with the complete function only, in one "
         "Python code block.")
FUNCTIONS = ("textwrap.indent", "string.capwords", "colorsys.rgb_to_hsv", "html.escape", "colorsys.hls_to_rgb",
             "textwrap.dedent", "statistics.median", "shlex.quote", "statistics.mode", "colorsys.rgb_to_hls")


def code_edits(n: int) -> list[list[dict]]:
    """``n`` chat turns asking to rewrite a function of the standard library, the function's source inline."""
    import importlib

    out = []
    for i, name in enumerate(FUNCTIONS[:n]):
        mod, fn = name.rsplit(".", 1)
        src = inspect.getsource(getattr(importlib.import_module(mod), fn))
        out.append([{"role": "user", "content": f"{EDITS[i % len(EDITS)]}\n\n```python\n{src}```"}])
    return out


def spec_counters(url: str) -> dict:
    """The server's spec-decode counters (vllm:spec_decode_*_total), 0 where absent."""
    values = parse_prometheus(httpx.get(url + "/metrics", timeout=30).text)
    return {key: values.get(f"vllm:spec_decode_{key}_total", 0.0)
            for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}


def one_user(artifact: Path, overrides: dict, prompts: list[list[dict]], max_tokens: int) -> dict:
    """Each prompt streamed in turn on one fresh server: texts, tokens, seconds, the spec counters."""
    import openai

    with running_server(artifact, overrides) as (url, proc):
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
        client.chat.completions.create(model=name, messages=chats(1, seed=99)[0], max_tokens=8, temperature=0)
        texts, tokens, wall = [], 0, 0.0
        for msgs in prompts:
            t0 = time.perf_counter()
            stream = client.chat.completions.create(model=name, messages=msgs, max_tokens=max_tokens, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
            parts, usage = [], None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            wall += time.perf_counter() - t0
            texts.append("".join(parts))
            tokens += usage.completion_tokens
        counters = spec_counters(url)
        peak = read_peak_rss(proc.pid)
    return {"texts": texts, "tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2),
            "peak_rss_mib": round(peak / 2**20) if peak else None, **counters}


def under_load(artifact: Path, overrides: dict, c: int, workload: str = "chat") -> dict:
    """``c`` users at once, two requests each: chat turns (64 tokens, ``ignore_eos``) or code edits (128 tokens)."""
    import openai

    with running_server(artifact, overrides) as (url, _):
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
        extra, max_tokens = ({"ignore_eos": True}, 64) if workload == "chat" else ({}, 128)

        def one(msgs):
            r = client.chat.completions.create(model=name, messages=msgs, max_tokens=max_tokens, temperature=0,
                                               extra_body=extra)
            return r.usage.completion_tokens

        one(chats(1, seed=99)[0])
        prompts = chats(2 * c, seed=c) if workload == "chat" else \
            [code_edits(len(FUNCTIONS))[i % len(FUNCTIONS)] for i in range(2 * c)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            tokens = sum(pool.map(one, prompts))
        wall = time.perf_counter() - t0
        counters = spec_counters(url)
    return {"c": c, "tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2), **counters}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(epilog=MODES_HELP, description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--method", action="append", default=None,
                    help="prompt_lookup, or draft=<artifact folder> (repeatable; default prompt_lookup)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per workload (at most 10; 0: no one-user runs)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--load", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--load-workload", choices=["chat", "code_edit"], default="chat",
                    help="what the users under load ask (code_edit: where drafts land, to find the break-even)")
    ap.add_argument("--workloads", nargs="+", choices=["code_edit", "chat"], default=["code_edit", "chat"])
    ap.add_argument("--set", action="append", default=[], help="extra serve.KEY=VALUE for every server")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/speculative.json")
    args = ap.parse_args(argv)
    base = {"result_cache_size": 0, "enable_prefix_caching": False}
    for item in args.set:
        k, v = item.split("=", 1)
        k = k.removeprefix("serve.")  # as the help and the config file spell it
        base[k] = json.loads(v) if v[:1] in "0123456789[{tf-" else v
    methods = {"off": "off"}
    for m in args.method or ["prompt_lookup"]:
        methods[m.split("=", 1)[0] if m.startswith("draft=") else m] = m.split("=", 1)[1] if "=" in m else m
    workloads = {"code_edit": code_edits(args.prompts), "chat": chats(args.prompts, seed=7)} if args.prompts else {}
    workloads = {k: v for k, v in workloads.items() if k in args.workloads}
    res = {"artifact": str(args.artifact), "cpu_flags": cpu_flags(), "max_tokens": args.max_tokens,
           "load_workload": args.load_workload,
           "settings": base, "methods": methods, "one_user": {}, "under_load": {}}
    print(f"CPU flags: {res['cpu_flags']}")
    for wl, prompts in workloads.items():
        rows = {}
        for label, spec in methods.items():
            rows[label] = one_user(args.artifact, {**base, "speculative": spec}, prompts, args.max_tokens)
            r, off = rows[label], rows["off"]
            same = [a == b for a, b in zip(r["texts"], off["texts"])]
            r["identical_to_off"] = sum(same)
            r["x_off"] = round(r["tokens_per_s"] / off["tokens_per_s"], 3)
            acc = r["num_accepted_tokens"] / r["num_draft_tokens"] if r["num_draft_tokens"] else 0.0
            r["acceptance_rate"] = round(acc, 3)
            r["tokens_per_check"] = round((r["num_accepted_tokens"] + r["num_drafts"]) / r["num_drafts"], 2) \
                if r["num_drafts"] else 0.0
            print(f"{wl:9s} {label:14s} {r['tokens_per_s']:7.2f} tok/s  x{r['x_off']:.2f} of off  identical "
                  f"{sum(same)}/{len(same)}  acceptance {acc:.2f}  tokens/check {r['tokens_per_check']}  "
                  f"peak RSS {r['peak_rss_mib']} MiB", flush=True)
        res["one_user"][wl] = rows
    for c in args.load:
        rows = {}
        for label, spec in methods.items():
            rows[label] = under_load(args.artifact, {**base, "speculative": spec}, c, args.load_workload)
            rows[label]["x_off"] = round(rows[label]["tokens_per_s"] / rows["off"]["tokens_per_s"], 3)
            print(f"c={c:<3d} {label:14s} {rows[label]['tokens_per_s']:7.2f} tok/s  x{rows[label]['x_off']:.2f} of off"
                  f"  drafts {rows[label]['num_drafts']:.0f}", flush=True)
        res["under_load"][str(c)] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


# --- `--structured`: formerly benchmarks/structured.py ------------------------------

STRUCTURED_DOC = """Structured outputs through the server, the openai SDK: valid share with constraints off and on, and what the
constraint costs in tokens/s.

    python -m benchmarks.speculative --structured --artifact <artifact> [--set-file structured_second] [--load 1 32]
        [--max-tokens 64] [--out benchmarks/results/structured.json]

Validity (one user, greedy): every task of a chat set of structured tasks (compress/evaluate/chatsets/, default the
second set, which no stage reads): ``extract`` and ``json`` tasks ask for a JSON object with given keys, once as
plain chat (constraints off: the answer parsed from the text, a fenced block allowed) and once through the SDK's
``chat.completions.parse`` with a pydantic model of the schema (on: valid = a parsed object); ``tool`` tasks offer several tools, once with ``tool_choice`` auto (off: a call
the server parsed) and once ``required`` (on). Valid = parses and validates against the schema (jsonschema), or a call
of an offered tool whose arguments validate.

Cost (``--load``): c users at once, two requests each, greedy (or ``--temperature``, seeded), ``max_tokens`` each: free text (``ignore_eos``), and a
JSON schema that holds the row in one long string until ``max_tokens`` (so both run the same number of tokens);
then half the users constrained, half free, the free half's tokens/s per request against the all-free run. The
modes alternate on one server (result cache and prefix caching off), each twice, and the better of each is kept.
"""

LONG = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 100000}}, "required": ["answer"]}


def load_set(name: str) -> list[dict]:
    return load_tasks([name], "--set-file")


def pydantic_model(schema: dict):
    """A pydantic model of a task's flat object schema (string, integer, number, boolean, enum, array of strings)."""
    from typing import Literal

    from pydantic import ConfigDict, create_model

    kinds = {"string": str, "integer": int, "number": float, "boolean": bool}
    fields = {}
    for k, sub in schema["properties"].items():
        tp = Literal[tuple(sub["enum"])] if "enum" in sub else (
            list[kinds[sub["items"]["type"]]] if sub.get("type") == "array" else kinds[sub["type"]])
        fields[k] = (tp, ...)
    return create_model("Answer", __config__=ConfigDict(extra="forbid"), **fields)


def validity(client, name: str, tasks: list[dict], max_tokens: int) -> dict:
    import openai

    rows = []
    for t in tasks:
        row = {"kind": t["kind"]}
        for mode in ("off", "on"):
            kw = dict(model=name, messages=t["messages"], max_tokens=max_tokens, temperature=0)
            if t["kind"] == "tool":
                r = client.chat.completions.create(**kw, tools=t["tools"],
                                                   tool_choice="required" if mode == "on" else "auto")
                calls = r.choices[0].message.tool_calls or []
                schemas = {x["function"]["name"]: x["function"]["parameters"] for x in t["tools"]}
                ok = bool(calls) and all(c.function.name in schemas and valid_against(
                    json.loads(c.function.arguments), schemas[c.function.name]) for c in calls)
                row[mode] = {"valid": ok, "calls": [(c.function.name, c.function.arguments) for c in calls],
                             "text": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason}
            elif mode == "on":  # the SDK's parse with a pydantic model of the schema, as applications call it
                try:
                    r = client.chat.completions.parse(**kw, response_format=pydantic_model(t["schema"]))
                    msg, finish = r.choices[0].message, r.choices[0].finish_reason
                    parsed, text = msg.parsed, msg.content
                except openai.LengthFinishReasonError as e:
                    parsed, finish, text = None, "length", e.completion.choices[0].message.content
                row[mode] = {"valid": parsed is not None and valid_against(parsed.model_dump(), t["schema"]),
                             "parsed": parsed is not None, "text": text, "finish_reason": finish}
            else:
                r = client.chat.completions.create(**kw)
                text = r.choices[0].message.content or ""
                obj = json_in(text)
                row[mode] = {"valid": obj is not None and valid_against(obj, t["schema"]), "text": text,
                             "finish_reason": r.choices[0].finish_reason}
        rows.append(row)
    share = {m: round(sum(r[m]["valid"] for r in rows) / len(rows), 3) for m in ("off", "on")}
    # constrained answers that finished (not cut by max_tokens): valid by construction
    finished = [r["on"] for r in rows if r["on"]["finish_reason"] != "length"]
    share["on_finished"] = round(sum(x["valid"] for x in finished) / len(finished), 3) if finished else None
    share["on_cut_by_max_tokens"] = len(rows) - len(finished)
    by_kind = {k: {m: round(sum(r[m]["valid"] for r in rows if r["kind"] == k)
                             / sum(r["kind"] == k for r in rows), 3) for m in ("off", "on")}
               for k in sorted({r["kind"] for r in rows})}
    return {"share_valid": share, "by_kind": by_kind, "tasks": rows}


def timed(client, name: str, c: int, modes: list[str], max_tokens: int, temperature: float = 0.0) -> dict:
    """c users, two requests each; ``modes[i % len(modes)]`` says whether user i is ``free`` or ``json``."""
    prompts = chats(2 * c, seed=c)

    def one(i: int):
        mode = modes[i % len(modes)]
        extra = {"ignore_eos": True} if mode == "free" else {
            "response_format": {"type": "json_schema", "json_schema": {"name": "long", "schema": LONG}}}
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=name, messages=prompts[i], max_tokens=max_tokens,
                                           temperature=temperature, seed=i, extra_body=extra)
        return mode, r.usage.completion_tokens, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        done = list(pool.map(one, range(2 * c)))
    wall = time.perf_counter() - t0
    per_mode = {}
    for m in set(modes):
        mine = [(n, s) for mode, n, s in done if mode == m]
        per_mode[m] = round(sum(n / s for n, s in mine) / len(mine), 2)  # mean tokens/s of one request
    return {"tokens": sum(n for _, n, _ in done), "wall_s": round(wall, 2),
            "tokens_per_s": round(sum(n for _, n, _ in done) / wall, 2), "request_tokens_per_s": per_mode}


def cost(artifact: Path, c: int, max_tokens: int, rounds: int = 2, temperature: float = 0.0) -> dict:
    import openai

    with running_server(artifact, {"result_cache_size": 0, "enable_prefix_caching": False}) as (url, proc):
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
        timed(client, name, 1, ["json"], 8)  # compile the schema, warm the sessions
        runs = {"free": [], "json": [], "mixed": []}
        for _ in range(rounds):
            runs["free"].append(timed(client, name, c, ["free"], max_tokens, temperature))
            runs["json"].append(timed(client, name, c, ["json"], max_tokens, temperature))
            if c > 1:
                runs["mixed"].append(timed(client, name, c, ["free", "json"], max_tokens, temperature))
        peak = read_peak_rss(proc.pid)
    best = {m: max(r, key=lambda x: x["tokens_per_s"]) for m, r in runs.items() if r}
    out = {"c": c, "temperature": temperature, "runs": runs, "best": best, "peak_rss_mib": round(peak / 2**20) if peak else None,
           "json_x_free": round(best["json"]["tokens_per_s"] / best["free"]["tokens_per_s"], 3)}
    if "mixed" in best:
        free_alone = max(r["request_tokens_per_s"]["free"] for r in runs["free"])
        free_mixed = max(r["request_tokens_per_s"]["free"] for r in runs["mixed"])
        out["free_rows_beside_json_x_alone"] = round(free_mixed / free_alone, 3)
    return out


def drafts_keep_text(artifact: Path, set_name: str, max_tokens: int = 128) -> dict:
    """Greedy constrained answers (the set's JSON tasks, one at a time: drafting is for a lone row) on the engine in
    process, without and with prompt-lookup drafts: the token ids must be identical."""
    from serve.api.chat_template import render_template
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.grammar import GrammarSpec
    from serve.engine.sampling import SamplingParams
    from serve.engine.tokenizer import encode_chat

    tasks = [t for t in load_set(set_name) if t["kind"] != "tool"]
    outs, res = {}, {}
    for spec in ("off", "prompt_lookup"):
        eng = Engine(artifact, ServeConfig(kv_memory_mb=256, speculative=spec, result_cache_size=0), start=False)
        outs[spec], t0 = [], time.perf_counter()
        for t in tasks:
            ids = encode_chat(eng.tokenizer, eng.manifest, render_template(eng.manifest["chat_template"],
                                                                          t["messages"], True))
            h = eng.add_request(ids, SamplingParams.greedy(max_tokens, structured=GrammarSpec.json_schema(t["schema"])))
            eng.run_until_done()
            outs[spec].append(h.result().output_ids)
        st = eng.stats()
        res[spec] = {"seconds": round(time.perf_counter() - t0, 2), "drafts": st.spec_drafts,
                     "draft_tokens": st.spec_draft_tokens, "accepted_tokens": st.spec_accepted_tokens}
        eng.shutdown()
    res["identical"] = sum(a == b for a, b in zip(outs["off"], outs["prompt_lookup"]))
    res["answers"] = len(tasks)
    return res


def structured_main(argv: list[str] | None = None) -> int:
    import openai

    ap = argparse.ArgumentParser(prog="python -m benchmarks.speculative --structured", description=STRUCTURED_DOC.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--set-file", default="structured_second", help="chat set of structured tasks (package data)")
    ap.add_argument("--answer-tokens", type=int, default=160, help="max_tokens of the validity tasks")
    ap.add_argument("--load", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request under --load")
    ap.add_argument("--temperature", type=float, default=0.0, help="of each request under --load (0: greedy)")
    ap.add_argument("--drafts", action="store_true",
                    help="also: the set's JSON tasks with and without prompt-lookup drafts, greedy text compared")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/structured.json")
    args = ap.parse_args(argv)
    res = {"artifact": str(args.artifact), "cpu_flags": cpu_flags(), "set": args.set_file}
    print(f"CPU flags: {res['cpu_flags']}")
    if args.set_file:
        with running_server(args.artifact, {"result_cache_size": 0}) as (url, _):
            name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
            res["validity"] = v = validity(client, name, load_set(args.set_file), args.answer_tokens)
        print(f"schema-valid share, constraints off {v['share_valid']['off']:.3f} / on {v['share_valid']['on']:.3f}"
              f"  by kind {v['by_kind']}", flush=True)
    if args.drafts:
        res["drafts"] = d = drafts_keep_text(args.artifact, args.set_file or "structured_second")
        print(f"drafts: identical {d['identical']}/{d['answers']}, {d['prompt_lookup']['accepted_tokens']} of "
              f"{d['prompt_lookup']['draft_tokens']} drafted tokens accepted", flush=True)
    res["cost"] = []
    for c in args.load:
        r = cost(args.artifact, c, args.max_tokens, temperature=args.temperature)
        res["cost"].append(r)
        print(f"c={c:<3d} free {r['best']['free']['tokens_per_s']:7.2f} tok/s  json {r['best']['json']['tokens_per_s']:7.2f}"
              f"  x{r['json_x_free']:.3f}" + (f"  free rows beside json x{r['free_rows_beside_json_x_alone']:.3f}"
                                               if "free_rows_beside_json_x_alone" in r else ""), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_modes(main, {"--structured": structured_main}))
