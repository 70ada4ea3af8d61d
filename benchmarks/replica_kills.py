"""Replicas that die under load (docs/reliability.md): 32 clients against 2 Ray Serve replicas, one replica
SIGKILLed every 20 s for 2 minutes; what each client saw, per kill.

    python -m benchmarks.replica_kills [--artifact .cache/bench/forms/wo8] [--clients 32] [--duration 120]

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

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.replicas import WORDS, model_id, server
from serve.replicas.forwarding import REPLICA_HEADER, metric_value

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "replica_kills.json"
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--kill-every", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--set", action="append", default=[], metavar="serve.KEY=VALUE")
    ap.add_argument("--prefix-imbalance", type=int, default=None, metavar="K",
                    help="the router's imbalance (default: the server's, a quarter of serve.max_batch_size, at least 8)")
    ap.add_argument("--out", type=Path, default=OUT)
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
    raise SystemExit(main())
