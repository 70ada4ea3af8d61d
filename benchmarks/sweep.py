"""The server at several concurrency levels, through the openai SDK: output tokens/s, tokens per server CPU-second
and peak RSS, one fresh server per (artifact, level), artifacts interleaved at each level.

    python -m benchmarks.sweep --artifact wo8=<weight-only> --artifact w8a8=<W8A8> [--concurrency 1 8 32 64]
        [--requests-per-user 3] [--max-tokens 64] [--set max_batch_size=64]
        [--llama-server <llama.cpp>/build/bin/llama-server --gguf [q8_0=]smollm2-q8_0.gguf [--gguf q4_k_m=...]]  # anchors
        [--source w8a8_then=<git worktree of an older commit>]   # that artifact served by that tree's server

Workload (``--workload``): ``chat``, seeded short user turns of a few kinds (questions, instructions, small talk);
``long_prompt``, a standard-library function of about 650 tokens to explain (prompt-heavy: long prompts, short
answers). Chat completions through the model's own template, streamed, greedy, exactly ``--max-tokens`` new tokens
each (``ignore_eos``), ``requests-per-user x c`` requests at concurrency c (at least 8) from c client threads; each
level reports output tokens/s, prompt tokens/s and time to first token (p50, p99). Caches off:
the result cache (``result_cache_size`` 0) and prefix caching (``enable_prefix_caching`` false), so every token is
computed. The server's CPU seconds are read from /proc (user + system, its whole process). ``--llama-server`` adds
llama.cpp's own server on the same model (one parallel slot per user, prompt cache off), the same client and
prompts, one system after another. Prints the CPU flags,
the load average and, per artifact, each level's tokens/s as a multiple of its own c1 in the same run; writes
``benchmarks/results/sweep.json``. ``--repeats N`` runs the whole sequence N times (the systems' order rotated) and
reports medians, with each round's own x c1 beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from loadtest.serve_bench import free_port, running_server, wait_ready

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ("the tides", "a sourdough starter", "binary search", "the French revolution", "photosynthesis",
          "a bicycle gear", "compound interest", "the moons of Jupiter", "a haiku", "recursion", "volcanoes",
          "a job interview", "jet lag", "the printing press", "black holes", "a garden in winter")
FORMS = ("Explain {t} to a twelve-year-old.", "Write three sentences about {t}.", "What should I know about {t}?",
         "Give me a short list of facts on {t}.", "Tell me a story that involves {t}.")


def cpu_flags() -> str:
    """The CPU's vector flags that matter to the kernels, for a results file (the other tools import it from here)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    have = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return " ".join(have) or "none of avx2/avx512"


def chats(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "user", "content": rng.choice(FORMS).format(t=rng.choice(TOPICS))}] for _ in range(n)]


def long_prompts(n: int, seed: int = 0, chars: int = 2600) -> list[list[dict]]:
    """Seeded requests to explain a standard-library function of about ``chars`` characters (~650 tokens)."""
    import inspect
    import json as json_mod
    import textwrap as textwrap_mod

    sources = [inspect.getsource(f) for mod in (json_mod.decoder, json_mod.encoder, textwrap_mod)
               for f in vars(mod).values() if inspect.isfunction(f) and f.__module__ == mod.__name__]
    sources += [inspect.getsource(c) for mod in (json_mod.decoder, json_mod.encoder, textwrap_mod)
                for c in vars(mod).values() if inspect.isclass(c) and c.__module__ == mod.__name__]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        code = rng.choice(sources)
        while len(code) < chars:
            code += "\n" + rng.choice(sources)
        out.append([{"role": "user", "content": f"Explain what this code does:\n```python\n{code[:chars]}\n```"}])
    return out


def workload_requests(workload: str, n: int, seed: int, prompt_chars: int) -> list[list[dict]]:
    return long_prompts(n, seed, prompt_chars) if workload == "long_prompt" else chats(n, seed)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, slots: int, max_tokens: int, prompt_room: int = 256):
    """llama.cpp's own ``llama-server`` on ``gguf`` with ``slots`` parallel slots (continuous batching), its
    context split between them (``prompt_room`` tokens of prompt each, plus ``max_tokens``), 2 threads, on a free
    127.0.0.1 port; yields (base URL, process). The anchor of benchmarks/history.md, never a dependency."""
    import subprocess

    port = free_port()
    ctx = slots * (prompt_room + max_tokens)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(ctx), "-t", str(os.cpu_count() or 2), "-tb", str(os.cpu_count() or 2), "--no-webui",
           "-b", "2048", "-ub", "512", "--cache-reuse", "0", "--no-cache-prompt"]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 300, log, path="/health")
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.unlink(missing_ok=True)


def run_level(artifact: Path, c: int, requests: int, max_tokens: int, overrides: dict,
              llama: Path | None = None, source: Path | None = None, workload: str = "chat",
              prompt_chars: int = 2600) -> dict:
    import openai

    server = (llama_server(llama, artifact, c, max_tokens, 256 if workload == "chat" else prompt_chars // 2) if llama
              else running_server(artifact, overrides, source=source))
    with server as (url, proc):
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)

        def one(msgs) -> tuple[int, int, float]:
            """(output tokens, prompt tokens, seconds to the first token) of one streamed request: the first chunk
            with text, or (a model whose first tokens make no whole character yet) the first chunk with a choice."""
            t0, text_at, any_at, done, usage = time.perf_counter(), None, None, 0, None
            for chunk in client.chat.completions.create(model=name, messages=msgs, max_tokens=max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True}):
                if chunk.choices:
                    any_at = any_at if any_at is not None else time.perf_counter() - t0
                    if chunk.choices[0].delta.content:
                        text_at = text_at if text_at is not None else time.perf_counter() - t0
                        done += 1
                usage = chunk.usage or usage
            ttft = text_at if text_at is not None else any_at
            return (usage.completion_tokens if usage else done), (usage.prompt_tokens if usage else 0), ttft

        one(workload_requests(workload, 1, 99, prompt_chars)[0])  # warm: first-call allocations are not the steady state
        peak, stop = [rss_mib(proc.pid)], threading.Event()

        def sample():
            while not stop.wait(0.2):
                peak.append(rss_mib(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            done = list(pool.map(one, workload_requests(workload, requests, c, prompt_chars)))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid) - cpu0
        stop.set()
        sampler.join()
    tokens, prompt = sum(d[0] for d in done), sum(d[1] for d in done)
    ttft = [d[2] for d in done if d[2] is not None]
    return {"c": c, "requests": requests, "output_tokens": tokens, "prompt_tokens": prompt, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1), "prompt_tokens_per_s": round(prompt / wall, 1),
            "ttft_p50_s": round(percentile(ttft, 50), 3), "ttft_p99_s": round(percentile(ttft, 99), 3),
            "tokens_per_cpu_s": round(tokens / cpu, 1), "peak_rss_mib": round(max(peak)),
            "load": round(os.getloadavg()[0], 1)}


def medians(rounds: list[dict[str, list[dict]]]) -> dict[str, list[dict]]:
    """Per system and level over the rounds: median tokens/s and tokens per CPU-second, the largest peak RSS, x c1 of
    the medians, and each round's own x c1 (its c1 and its level measured in the same round)."""
    import statistics

    out: dict[str, list[dict]] = {}
    for name in rounds[0]:
        levels = []
        for i, first in enumerate(rounds[0][name]):
            rs = [rnd[name][i] for rnd in rounds]
            levels.append({"c": first["c"], "requests": first["requests"],
                           "output_tokens": int(statistics.median(r["output_tokens"] for r in rs)),
                           "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 1),
                           "tokens_per_cpu_s": round(statistics.median(r["tokens_per_cpu_s"] for r in rs), 1),
                           **{k: round(statistics.median(r[k] for r in rs), 3)
                              for k in ("prompt_tokens_per_s", "ttft_p50_s", "ttft_p99_s") if k in rs[0]},
                           "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
                           "x_c1_rounds": [r["x_c1"] for r in rs]})
        for lv in levels:
            lv["x_c1"] = round(lv["tokens_per_s"] / levels[0]["tokens_per_s"], 2)
        out[name] = levels
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n")[0])
    p.add_argument("--artifact", action="append", required=True, metavar="NAME=PATH",
                   help="an artifact to serve (repeat to compare; NAME defaults to the folder name)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--requests-per-user", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload", choices=["chat", "long_prompt"], default="chat",
                   help="chat: short user turns; long_prompt: ~650-token code to explain (prompt-heavy)")
    p.add_argument("--prompt-chars", type=int, default=2600, help="long_prompt: characters of code per prompt")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a ServeConfig field")
    p.add_argument("--set-for", action="append", default=[], metavar="NAME:KEY=JSON",
                   help="a ServeConfig field for the artifact NAME only (the same artifact under two names: an A/B of "
                        "a server setting in one run)")
    p.add_argument("--llama-server", type=Path, default=None, metavar="BIN",
                   help="also llama.cpp's llama-server on --gguf, one slot per user (benchmarks/history.md: the build)")
    p.add_argument("--gguf", action="append", default=[], metavar="[NAME=]FILE",
                   help="the same model for --llama-server (e.g. Q8_0); repeat for several (q4_k_m=..., q8_0=...)")
    p.add_argument("--source", action="append", default=[], metavar="NAME=DIR",
                   help="serve the artifact NAME with the server of the source tree DIR (e.g. a git worktree of the "
                        "commit an issue was filed against: the server as it was, in the same run)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every (system, level) this many times, the systems' order rotated each round; the figures "
                        "are the medians (this 2-core VM moves them +-5 %% from one run to the next)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sweep.json")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: at least 1")
    arts = {}
    for spec in a.artifact:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        arts[name or Path(path).name] = Path(path).resolve()  # a --source tree runs from its own folder
    overrides = {"result_cache_size": 0, "enable_prefix_caching": False, "max_batch_size": max(a.concurrency),
                 "kv_memory_mb": 1024}
    overrides.update({k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)})
    head = {"cpu_flags": cpu_flags(), "cores": os.cpu_count(), "load_average": os.getloadavg()[0],
            "overrides": overrides, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"CPU flags: {head['cpu_flags']}; cores {head['cores']}; load average {head['load_average']:.1f}; {overrides}")
    sources = dict(spec.split("=", 1) for spec in a.source)
    unknown = set(sources) - set(arts)
    if unknown:
        p.error(f"--source names no --artifact: {sorted(unknown)}")
    own: dict[str, dict] = {}
    for spec in a.set_for:
        name, sep, kv = spec.partition(":")
        if not sep or "=" not in kv or name not in arts:
            p.error(f"--set-for {spec!r}: NAME:KEY=JSON, NAME one of the --artifact names {sorted(arts)}")
        key, value = kv.split("=", 1)
        own.setdefault(name, {})[key] = json.loads(value)
    systems = {n: (p, None) for n, p in arts.items()}
    if a.llama_server:
        ggufs = {name or "": Path(f) for name, _, f in (g.rpartition("=") for g in a.gguf)}
        if not (ggufs and all(f.is_file() for f in ggufs.values()) and a.llama_server.is_file()):
            p.error("--llama-server needs the binary and --gguf, the model file(s) it serves")
        for name, f in ggufs.items():
            systems[f"llama-server-{name}" if name else "llama-server"] = (f, a.llama_server)
    rounds: list[dict[str, list[dict]]] = []
    for k in range(a.repeats):
        names = list(systems)
        order = names[k % len(names):] + names[:k % len(names)]  # nobody always goes first
        runs: dict[str, list[dict]] = {n: [] for n in systems}
        for c in a.concurrency:
            for name in order:
                path, llama = systems[name]
                src = Path(sources[name]) if name in sources else None
                r = run_level(path, c, max(8, a.requests_per_user * c), a.max_tokens, {**overrides, **own.get(name, {})},
                              llama, src, a.workload, a.prompt_chars)
                base = runs[name][0]["tokens_per_s"] if runs[name] else r["tokens_per_s"]
                r["x_c1"] = round(r["tokens_per_s"] / base, 2)
                runs[name].append(r)
                tag = f"[{k + 1}/{a.repeats}] " if a.repeats > 1 else ""
                print(f"{tag}{name:>10} c{c:<3} {r['tokens_per_s']:7.1f} tok/s ({r['x_c1']:5.2f}x c1)  "
                      f"TTFT p50 {r['ttft_p50_s']:6.3f} s p99 {r['ttft_p99_s']:6.3f} s  "
                      f"{r['prompt_tokens_per_s']:7.1f} prompt tok/s  "
                      f"{r['tokens_per_cpu_s']:6.1f} tok/CPU-s  peak RSS {r['peak_rss_mib']:5d} MiB  load {r['load']}",
                      flush=True)
        rounds.append(runs)
    rows = rounds[0] if a.repeats == 1 else medians(rounds)
    if a.repeats > 1:
        print("medians over the rounds (x c1: of the medians; per round in brackets):")
        for name, levels in rows.items():
            for r in levels:
                print(f"{name:>10} c{r['c']:<3} {r['tokens_per_s']:7.1f} tok/s ({r['x_c1']:5.2f}x c1 {r['x_c1_rounds']})  "
                      f"{r['tokens_per_cpu_s']:6.1f} tok/CPU-s")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({**head, "workload": a.workload, "max_tokens": a.max_tokens,
                                 **({"prompt_chars": a.prompt_chars} if a.workload == "long_prompt" else {}), "artifacts": {n: str(p) for n, (p, _) in systems.items()},
                                 "sources": sources, "set_for": own, "repeats": a.repeats, "rows": rows,
                                 **({"rounds": rounds} if a.repeats > 1 else {})}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
