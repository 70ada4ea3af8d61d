"""Engine replicas on Ray Serve (docs/scaling.md): output tokens/s at 1 and 2 replicas against the single process,
and the prefix-cache hit rate of prefix-aware routing against round-robin, all in one run.

    python -m benchmarks.replicas --artifact .cache/bench/smollm2-gqa-wo8 [--requests 32] [--concurrency 8]

Each configuration is the documented command in its own process, started fresh (so every prefix cache starts
empty): ``python -m serve --model ARTIFACT`` for the single process, ``... --replicas N --routing R`` for Ray
Serve (a local Ray instance each time). The clients are the openai SDK in threads.

1. Throughput: ``--requests`` chat completions (distinct prompts, greedy, ``--max-tokens`` each, ``ignore_eos``), at
   most ``--concurrency`` at once: output tokens/s, and the ratio to the 1-replica run of the same script.
2. Prefix hits: ``--systems`` system prompts of about 130 words each, ``--per-system`` users each, shuffled, at
   ``--concurrency``: the replicas' prefix cache hits / prompt tokens looked up (vllm:prefix_cache_hits_total /
   vllm:prefix_cache_queries_total of the merged /metrics), prefix-aware against round-robin, 2 replicas.

Results go to benchmarks/results/replicas.json (``--out`` elsewhere). Run it with ``nice -n 10`` on a shared
machine; the figures move with the load (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from loadtest.serve_bench import free_port

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "replicas.json"

WORDS = ("library shelf atlas map history river mountain city index catalogue reader loan desk floor archive "
         "journal article volume edition chapter author title subject record request renewal fine card hour "
         "opening closing weekday weekend reference manuscript periodical newspaper microfilm study room").split()


@contextmanager
def server(artifact: Path, replicas: int | None, routing: str = "prefix", sets: tuple[str, ...] = (),
           imbalance: int | None = None):
    """The documented command in a subprocess; yields the base URL once every replica is ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve", "--model", str(artifact), "--port", str(port), "--log-level", "warning",
           "--set", "serve.verify_artifact=false", *[x for s in sets for x in ("--set", s)]]
    if replicas:
        cmd += ["--replicas", str(replicas), "--routing", routing]
        if imbalance is not None:
            cmd += ["--prefix-imbalance", str(imbalance)]
    log = tempfile.NamedTemporaryFile("w+b", prefix="bench-replicas-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                log.seek(0)
                raise RuntimeError(f"{' '.join(cmd)} did not come up:\n{log.read()[-3000:].decode(errors='replace')}")
            try:
                if replicas:
                    rs = httpx.get(url + "/replicas", timeout=10).json()["replicas"]
                    if len(rs) == replicas and all(r.get("ready") for r in rs):
                        break
                elif httpx.get(url + "/ready", timeout=10).status_code == 200:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        startup = time.monotonic() - t0
        yield url, startup
    finally:
        proc.send_signal(signal.SIGTERM)  # --replicas: deletes the application, stops Serve and the local Ray
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        Path(log.name).unlink(missing_ok=True)


def model_id(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def run_chats(url: str, convs: list[list[dict]], max_tokens: int, concurrency: int) -> dict:
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    name = model_id(url)

    def one(msgs):
        r = c.chat.completions.create(model=name, messages=msgs, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, convs))
    wall = time.perf_counter() - t0
    return {"requests": len(convs), "output_tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1)}


def prefix_counters(url: str) -> tuple[float, float]:
    from serve.replicas.forwarding import metric_value

    text = httpx.get(url + "/metrics", timeout=60).text
    return (metric_value(text, "vllm:prefix_cache_hits_total"), metric_value(text, "vllm:prefix_cache_queries_total"))


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--per-system", type=int, default=6)
    ap.add_argument("--prefix-max-tokens", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="serve.KEY=VALUE",
                    help="a serve setting for every server (e.g. serve.kv_memory_mb=64)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT, help="results file (default %(default)s)")
    args = ap.parse_args(argv)

    rng = random.Random(0)
    out = {"artifact": str(args.artifact), "cores": os.cpu_count(), "sets": args.set,
           "load_average_before": os.getloadavg()[0]}
    sets = tuple(args.set)

    if not args.skip_throughput:
        convs = [[{"role": "user", "content": f"{i}. {sentence(rng, 12)}?"}] for i in range(args.requests)]
        thr = {}
        for label, n in (("single process", None), ("1 replica", 1), ("2 replicas", 2)):
            with server(args.artifact, n, sets=sets) as (url, startup):
                run_chats(url, convs[:2], 4, 2)  # warm-up: first-request costs out of the timing
                r = run_chats(url, convs, args.max_tokens, args.concurrency)
            r["startup_s"] = round(startup, 1)
            thr[label] = r
            print(f"{label:>15}: {r['tokens_per_s']:7.1f} output tokens/s ({r['output_tokens']} tokens in "
                  f"{r['wall_s']} s; up in {startup:.0f} s)", flush=True)
        base = thr["1 replica"]["tokens_per_s"]
        for r in thr.values():
            r["ratio_to_1_replica"] = round(r["tokens_per_s"] / base, 3)
        out["throughput"] = thr
        print("ratio to 1 replica: " + ", ".join(f"{k} {v['ratio_to_1_replica']:.2f}" for k, v in thr.items()))

    systems = [f"You are assistant number {s} of the city library. " + sentence(rng, 130) for s in range(args.systems)]
    convs = [[{"role": "system", "content": systems[s]}, {"role": "user", "content": f"{u}: {sentence(rng, 8)}?"}]
             for s in range(args.systems) for u in range(args.per_system)]
    rng.shuffle(convs)
    pref = {}
    for routing in ("prefix", "round_robin"):
        with server(args.artifact, 2, routing, sets=sets) as (url, _):
            h0, q0 = prefix_counters(url)
            r = run_chats(url, convs, args.prefix_max_tokens, args.concurrency)
            h1, q1 = prefix_counters(url)
            reps = httpx.get(url + "/replicas", timeout=60).json()["replicas"]
            per = {x["replica"]: x["requests_routed"] for x in reps}
        r.update(prefix_hits=h1 - h0, prefix_queries=q1 - q0, hit_rate=round((h1 - h0) / max(q1 - q0, 1), 4),
                 requests_per_replica=sorted(per.values()))
        pref[routing] = r
        print(f"{routing:>12}: prefix-cache hit rate {r['hit_rate']:.3f} ({r['prefix_hits']:.0f} of "
              f"{r['prefix_queries']:.0f} prompt tokens), {r['tokens_per_s']} output tokens/s, requests per replica "
              f"{r['requests_per_replica']}", flush=True)
    out["prefix"] = pref
    out["load_average_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {out['load_average_before']:.2f} -> {out['load_average_after']:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
