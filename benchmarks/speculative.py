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

from benchmarks.burst import cpu_flags
from benchmarks.sweep import chats
from loadtest.loadgen import parse_prometheus, read_peak_rss
from loadtest.serve_bench import running_server

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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    raise SystemExit(main())
