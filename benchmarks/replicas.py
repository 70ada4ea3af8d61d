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

from benchmarks import run_modes
from loadtest.serve_bench import free_port
import threading
from collections import Counter
from serve.replicas.forwarding import REPLICA_HEADER, metric_value

MODES_HELP = 'modes (each with its own --help): --kills: replicas killed under load (formerly benchmarks/replica_kills.py)'
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
    ap = argparse.ArgumentParser(epilog=MODES_HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


# --- `--kills`: formerly benchmarks/replica_kills.py --------------------------------

KILLS_DOC = """Replicas that die under load (docs/reliability.md): 32 clients against 2 Ray Serve replicas, one replica
SIGKILLed every 20 s for 2 minutes; what each client saw, per kill.

    python -m benchmarks.replicas --kills [--artifact .cache/bench/forms/wo8] [--clients 32] [--duration 120]

The server is the documented command, ``python -m serve --model ARTIFACT --replicas 2`` (a local Ray instance). The
clients are threads with httpx, each sending chat completions one after another until the time is up, streamed
and whole in turn (greedy, ``--max-tokens`` each, one of 8 system prompts so prefix routing has work). Every
``--kill-every`` seconds the replicas' pids are read from ``/replicas`` and the one that took the most requests
since the last kill gets SIGKILL; Ray starts a replacement. A request's outcome:

- whole: ``ok`` (200 with a completion) or failed (any other status, or a cut connection);
- streamed: ``ok`` (``[DONE]`` after its tokens), ``failed_before_start`` (a non-200 status, an error event or a
  cut before its first token), ``error_after_start`` (an error event after some tokens: the client knows),
  ``cut_after_start`` (the connection ended with neither ``[DONE]`` nor an error event: the client cannot tell).

The targets: 0 failed whole requests, 0 failed streams that had not started, 0 cut streams. Per kill: the
victim's streams that had started (and how they ended), the requests the ingress sent again to another replica
(``compressor:ingress_errors_total{code="replica_failed_retried"}``), and the seconds until the replacement was
ready. The artifact is the SmolLM2 weight-only INT8 gqa form, built once when missing. Results go to
benchmarks/results/replica_kills.json.
"""

KILLS_OUT = ROOT / "benchmarks" / "results" / "replica_kills.json"
DEFAULT_ARTIFACT = ROOT / ".cache" / "bench" / "forms" / "wo8"


def ensure_artifact(path: Path) -> Path:
    """The SmolLM2 weight-only INT8 gqa artifact (as benchmarks.batch1_forms builds its ``wo8``)."""
    if (path / "manifest.json").is_file():
        return path
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from compress.config import load_config
    from compress.corpus.splits import splits_from_config
    from compress.export.gqa import build_gqa_artifact
    from compress.loading.models import load_teacher
    from compress.quantize.quantizer import quantize_artifact

    cfg = load_config("configs/default.yaml")
    model, tok = load_teacher("embedded")
    splits = splits_from_config(tok, cfg.data)
    fp32 = path.parent / "fp32"
    if not (fp32 / "manifest.json").is_file():
        build_gqa_artifact(model, tok, fp32)
    del model
    qcfg = cfg.quantize.model_copy(update={"method": "weight_only", "smoothquant_alpha": None, "kv_cache": "float32"})
    quantize_artifact(fp32, path, splits.calib, qcfg)
    return path


def one_request(url: str, model: str, messages: list[dict], max_tokens: int, stream: bool) -> dict:
    rec = {"stream": stream, "start": time.monotonic(), "first": None, "end": None, "status": None,
           "replica": None, "tokens": 0, "outcome": None}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        if not stream:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
            rec.update(status=r.status_code, replica=r.headers.get(REPLICA_HEADER))
            ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
            rec["outcome"] = "ok" if ok else f"failed_http_{r.status_code}"
            return rec
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
            rec.update(status=r.status_code, replica=r.headers.get(REPLICA_HEADER))
            if r.status_code != 200:
                r.read()
                rec["outcome"] = "failed_before_start"
                return rec
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    rec["outcome"] = "ok"
                    break
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec["outcome"] = "error_after_start" if rec["tokens"] else "failed_before_start"
                    break
                if any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                    rec["tokens"] += 1
                    if rec["first"] is None:
                        rec["first"] = time.monotonic()
            else:
                rec["outcome"] = "cut_after_start" if rec["tokens"] else "failed_before_start"
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["outcome"] = ("cut_after_start" if rec["tokens"] else "failed_before_start") if stream else "failed_cut"
    finally:
        rec["end"] = time.monotonic()
    return rec


def results_json(out: dict) -> str:
    """Indented JSON with each request record on one line (a few hundred of them)."""
    text = json.dumps({k: v for k, v in out.items() if k != "records"}, indent=1)
    rows = ",\n  ".join(json.dumps(r) for r in out.get("records", []))
    return text[:-2] + f',\n "records": [\n  {rows}\n ]\n}}\n'


def ingress_counters(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=60).text
    return {k: metric_value(text, "compressor:ingress_errors_total", code=k)
            for k in ("replica_failed_retried", "replica_failed", "replica_failed_mid_stream", "queue_full")}


def replicas_now(url: str) -> list[dict]:
    return httpx.get(url + "/replicas", timeout=60).json()["replicas"]


def kills_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.replicas --kills", description=KILLS_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--kill-every", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--set", action="append", default=[], metavar="serve.KEY=VALUE")
    ap.add_argument("--prefix-imbalance", type=int, default=None, metavar="K",
                    help="the router's imbalance (default: the server's, a quarter of serve.max_batch_size, at least 8)")
    ap.add_argument("--out", type=Path, default=KILLS_OUT)
    args = ap.parse_args(argv)

    artifact = ensure_artifact(args.artifact)
    rng = random.Random(0)
    systems = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(8)]
    records: list[dict] = []
    kills: list[dict] = []
    lock = threading.Lock()
    where = artifact.resolve()
    out = {"artifact": str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else str(where),
           "cores": os.cpu_count(), "clients": args.clients, "duration_s": args.duration,
           "kill_every_s": args.kill_every, "max_tokens": args.max_tokens, "prefix_imbalance": args.prefix_imbalance,
           "load_average_before": os.getloadavg()[0]}

    with server(artifact, 2, sets=tuple(args.set), imbalance=args.prefix_imbalance) as (url, startup):
        out["startup_s"] = round(startup, 1)
        model = model_id(url)
        t0 = time.monotonic()
        stop_at = t0 + args.duration

        def client(i: int) -> None:
            k = 0
            while time.monotonic() < stop_at:
                msgs = [{"role": "system", "content": systems[(i + k) % len(systems)]},
                        {"role": "user", "content": f"client {i} question {k}: where is the atlas?"}]
                rec = one_request(url, model, msgs, args.max_tokens, stream=(i + k) % 2 == 0)
                with lock:
                    records.append(rec)
                k += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        n, routed_seen = 0, {}
        while True:
            t_next = t0 + args.kill_every * (n + 1)
            if t_next >= stop_at:
                break
            time.sleep(max(0.0, t_next - time.monotonic()))
            # The replica that took the most requests since the last kill: the harsher case (after a kill, prefix
            # routing keeps the survivor's conversations on it, so the replacement may be nearly idle).
            live = replicas_now(url)
            victim = max(live, key=lambda r: (r.get("requests_routed") or 0) - routed_seen.get(r["replica"], 0))
            routed_seen = {r["replica"]: r.get("requests_routed") or 0 for r in live}
            before = ingress_counters(url)
            t_kill = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            kill = {"n": n + 1, "at_s": round(t_kill - t0, 1), "victim": victim["replica"], "t": t_kill,
                    "counters_before": before,
                    "routed_before": {r["replica"]: r.get("requests_routed") for r in live},
                    "finished_on_victim_before": sum(1 for r in list(records) if r["replica"] == victim["replica"])}
            replaced = None
            while replaced is None and time.monotonic() < t_kill + args.kill_every - 1:
                try:
                    rs = replicas_now(url)
                    if len(rs) == 2 and all(r.get("ready") for r in rs) and victim["replica"] not in \
                            {r["replica"] for r in rs}:
                        replaced = time.monotonic() - t_kill
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.2)
            kill["replacement_ready_s"] = round(replaced, 1) if replaced is not None else None
            kill["counters_after"] = ingress_counters(url)
            kills.append(kill)
            print(f"kill {n + 1} at {kill['at_s']} s: {victim['replica']} (pid {victim['pid']}); replacement ready "
                  f"in {kill['replacement_ready_s']} s", flush=True)
            n += 1
        for t in threads:
            t.join(600)
        out["wall_s"] = round(time.monotonic() - t0, 1)

    for kill in kills:
        t_kill, victim = kill.pop("t"), kill["victim"]
        on_victim = [r for r in records if r["replica"] == victim and r["start"] < t_kill <= r["end"]]
        window = [r for r in records if t_kill <= r["end"] < t_kill + args.kill_every]
        # Streams the victim was serving when it died. A stream reaches the client only once its first token has
        # (serve/replicas/deploy.py), so each of these had started, though its first token may reach the client
        # after the kill on a loaded machine; whole requests the ingress sent again show the survivor's id.
        streams = [r for r in on_victim if r["stream"]]
        kill.update(
            victim_streams=len(streams),
            victim_streams_ended=dict(Counter(r["outcome"] for r in streams)),
            victim_whole_requests=dict(Counter(r["outcome"] for r in on_victim if not r["stream"])),
            requests_ended_in_window=len(window),
            outcomes_in_window=dict(Counter(r["outcome"] for r in window)),
            sent_again=(kill["counters_after"]["replica_failed_retried"]
                        - kill["counters_before"]["replica_failed_retried"]))
    tally = Counter((("stream" if r["stream"] else "whole"), r["outcome"]) for r in records)
    out.update(
        requests=len(records), tokens_per_s=round(sum(r["tokens"] if r["stream"] else args.max_tokens
                                                      for r in records if r["outcome"] == "ok") / out["wall_s"], 1),
        outcomes={f"{k}/{o}": n for (k, o), n in sorted(tally.items())},
        failed_whole=sum(n for (k, o), n in tally.items() if k == "whole" and o != "ok"),
        failed_streams_before_start=tally[("stream", "failed_before_start")],
        streams_error_after_start=tally[("stream", "error_after_start")],
        streams_cut_after_start=tally[("stream", "cut_after_start")],
        kills=kills, load_average_after=os.getloadavg()[0],
        by_replica=dict(Counter(str(r["replica"]) for r in records)),
        records=[[int(r["stream"]), round(r["start"] - t0, 2), r["first"] and round(r["first"] - t0, 2),
                  round(r["end"] - t0, 2), r["replica"], r["outcome"]] for r in records],
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(results_json(out))

    print(f"\n{out['requests']} requests in {out['wall_s']} s, {out['tokens_per_s']} output tokens/s; "
          f"{len(kills)} kills")
    print("| kill | at s | streams on the victim: how they ended | sent again to the survivor | replacement ready s | "
          "requests ending in the next window |")
    print("|---:|---:|---|---:|---:|---|")
    for k in kills:
        print(f"| {k['n']} | {k['at_s']} | {k['victim_streams']}: {k['victim_streams_ended']} | "
              f"{k['sent_again']:.0f} | {k['replacement_ready_s']} | {k['outcomes_in_window']} |")
    print(f"failed whole requests {out['failed_whole']}, failed streams before their first token "
          f"{out['failed_streams_before_start']}, streams ended by an error event {out['streams_error_after_start']}, "
          f"streams cut without one {out['streams_cut_after_start']}")
    print(f"wrote {args.out}")
    bad = out["failed_whole"] + out["failed_streams_before_start"] + out["streams_cut_after_start"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(run_modes(main, {"--kills": kills_main}))
