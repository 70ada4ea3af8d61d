"""A wave of first prompts through the engine, its two split calls cut at half the rows or where their work is even.

    python -m benchmarks.prompt_cut --artifact <gqa artifact> [--prompts 32] [--long 4] [--trials 8]

One wave: ``--prompts`` of the sweep's chat prompts (benchmarks/sweep.py) in the artifact's template, the first
``--long`` of them made ~8x longer (the prompt repeated), admitted in one engine step (prefix and result caches
off, one new token each), so the step is the runner's batched first-prompt call, run as two calls at once on the
split session (serve/runners/gqa.py). Each trial runs the same wave twice, cut at n // 2 and by ``balanced_cut``
(the order alternating), a new seed per trial; prints each trial's pair, the medians, and balanced / half.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.burst import cpu_flags
from benchmarks.prompt_profile import chat_prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--long", type=int, default=0, help="how many of the prompts are made ~8x longer")
    p.add_argument("--trials", type=int, default=8)
    a = p.parse_args(argv)

    import serve.runners.gqa as runner_gqa
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams
    from serve.runners.onnx_session import CPU

    eng = Engine(a.artifact, ServeConfig(providers=[CPU], verify_artifact=False, max_batch_size=max(a.prompts, 16),
                                         enable_prefix_caching=False, result_cache_size=0,
                                         max_num_batched_tokens=65536), start=False)
    if not isinstance(eng.runner, runner_gqa.GqaRunner) or eng.runner.split.session is None:
        raise SystemExit("--artifact: needs a gqa artifact on a CPU with 2+ cores (the split session)")
    cuts = {"half": lambda lens, share: len(lens) // 2, "balanced": runner_gqa.balanced_cut}
    print(f"CPU flags: {cpu_flags()}; {a.prompts} prompts, {a.long} long")
    times: dict[str, list[float]] = {k: [] for k in cuts}
    try:
        for trial in range(a.trials + 1):  # trial 0 warms both up and is not counted
            wave = chat_prompts(a.artifact, a.prompts, seed=32 + trial)
            wave[:a.long] = [ids * 8 for ids in wave[:a.long]]
            pair = {}
            for name in (("half", "balanced") if trial % 2 else ("balanced", "half")):
                runner_gqa.balanced_cut = cuts[name]
                handles = [eng.add_request(ids, SamplingParams.greedy(1, ignore_eos=True)) for ids in wave]
                t = time.perf_counter()
                eng.step()
                pair[name] = time.perf_counter() - t
                if any(len(h.output_ids) != 1 for h in handles):
                    raise SystemExit("the wave did not run as one step (raise max_num_batched_tokens)")
                eng.run_until_done()
            if trial:
                for k, v in pair.items():
                    times[k].append(v)
                print(f"trial {trial}: half {pair['half'] * 1e3:7.0f} ms  balanced {pair['balanced'] * 1e3:7.0f} ms")
    finally:
        runner_gqa.balanced_cut = cuts["balanced"]
        eng.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median: half {med['half'] * 1e3:.0f} ms, balanced {med['balanced'] * 1e3:.0f} ms, "
          f"balanced / half {med['balanced'] / med['half']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
