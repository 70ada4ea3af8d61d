"""Chat-set figures of artifacts against their teacher, on the gate's set and on a second set no stage reads.

    python -m benchmarks.chat_check --teacher artifacts/export/<key>/artifact \
        --candidate int8=artifacts/quantize/<key>/artifact --candidate chain=... [--json out.json]

A candidate may also be a Hugging Face model folder (a pruned or distilled student before export, e.g.
artifacts/prune/<key>/model or artifacts/distill/<key>/model): it is built into a gqa artifact first, so the
pruning damage and what distillation recovered are measured on the same chat sets.

The gate's set is compress/evaluate/chatsets/use.jsonl (single-turn prompts). The second set,
benchmarks/data/chat_second.jsonl, is another style (system personas, multi-turn conversations, opinions, creative
and how-to requests), written apart from the first and read by no stage of the pipeline, no config and no test
threshold: it checks that a verdict on the first set holds on chat it was not tuned on (issue 26: within 0.03 of
the perplexity ratio).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from compress.evaluate import chat as chat_eval

SECOND_SET = Path(__file__).parent / "data" / "chat_second.jsonl"
SHOWN = ("chat_perplexity_ratio", "chat_top1_agreement", "chat_judged_ratio", "chat_late_divergence_share",
         "chat_median_divergence", "chat_tokens")


def as_artifact(item: str) -> str:
    """NAME=FOLDER with FOLDER an artifact (manifest.json) as it is, or an HF model folder built into one."""
    name, _, path = item.partition("=")
    if (Path(path) / "manifest.json").is_file():
        return item
    from compress.export.gqa import build_gqa_artifact
    from compress.loading.models import load_teacher

    model, tok = load_teacher(path)[:2]
    out = Path(tempfile.mkdtemp(prefix=f"chat_{name}_")) / "artifact"
    build_gqa_artifact(model, tok, out)
    return f"{name}={out}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--candidate", action="append", required=True, help="NAME=ARTIFACT_DIR (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--divergence-tokens", type=int, default=16)
    ap.add_argument("--cache", default=None, help="teacher-answer cache folder (default: a temporary one)")
    ap.add_argument("--sets", nargs="+", choices=("gate", "second"), default=["gate", "second"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cache = a.cache or tempfile.mkdtemp(prefix="chat_targets_")
    a.candidate = [as_artifact(c) for c in a.candidate]
    sets = {name: spec for key, name, spec in (("gate", "use (gate)", "builtin"),
                                               ("second", "second (never tuned on)", str(SECOND_SET)))
            if key in a.sets}
    out: dict = {}
    for set_name, spec in sets.items():
        prompts = chat_eval.render(a.teacher, chat_eval.load_sets([spec]))
        t0 = time.perf_counter()
        targets = chat_eval.teacher_targets(a.teacher, prompts, a.max_new_tokens, cache)
        out[set_name] = {"teacher_seconds": time.perf_counter() - t0}
        for item in a.candidate:
            name, _, path = item.partition("=")
            t0 = time.perf_counter()
            r = chat_eval.evaluate_chat(path, a.teacher, prompts, targets, a.divergence_tokens, a.max_new_tokens)
            r["seconds"] = time.perf_counter() - t0
            out[set_name][name] = r
    print(f"\n| set | candidate | {' | '.join(SHOWN)} | seconds |\n|---|---|{'---:|' * (len(SHOWN) + 1)}")
    for set_name, res in out.items():
        for name, r in res.items():
            if isinstance(r, dict):
                print(f"| {set_name} | {name} | " + " | ".join(f"{r[k]:.4g}" for k in SHOWN) + f" | {r['seconds']:.0f} |")
    if len(sets) == 2:
        for name in (c.partition("=")[0] for c in a.candidate):
            a_, b_ = (out[s][name]["chat_perplexity_ratio"] for s in sets)
            print(f"{name}: second-set ratio - gate-set ratio = {b_ - a_:+.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
