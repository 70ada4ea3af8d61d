"""The run's summary: each stage's wall time and key figures, the verdict's checks by genre, the search's table or
the quantize stage's forms (summary.md in MLflow, the Prefect artifact and the log)."""

from __future__ import annotations

from compress.registry import store as registry
from tasks.chain import Chain, StageRecorder
from tasks.results import Judged, Registered
from tasks.search import SearchSummary


KEY_FIGURES = {
    "benchmark": ["bench_output_tokens_per_s", "bench_output_tokens_per_s_ratio", "bench_e2e_mean_s",
                  "bench_e2e_p99_s", "bench_ttft_p99_s", "bench_peak_rss_mb"],
    "accept": ["candidate_perplexity", "baseline_perplexity", "gate_perplexity_ratio", "gate_top1_agreement",
               "heldout_perplexity_ratio", "heldout_top1_agreement", "selection_perplexity_ratio",
               "gate_downstream_accuracy", "gate_downstream_drop", "gate_chat_perplexity_ratio",
               "gate_chat_top1_agreement", "gate_chat_judged_ratio", "candidate_size_bytes",
               "candidate_decode_ms_per_token"],
}


class StageTimer(StageRecorder):
    """Wall time and key figures of each stage (StageRecorder.run), and the run summary made of them."""

    def markdown(self, name: str, experiment: str, run, tracking_uri: str, registered: list[Registered],
                 verdict: Judged | None = None, champion_vs: dict | None = None, ui: str | None = None) -> str:
        """The run summary; ``ui`` None: for MLflow's own pages (relative links), else their address (Prefect)."""
        route = registry.run_route(run.info.experiment_id, run.info.run_id)
        link = f"[open the run]({route})" if ui is None else registry.outside_link(ui or None, route)
        lines = [f"# Compression run `{name}`", "",
                 f"MLflow run `{run.info.run_id}` in experiment `{experiment}` ({tracking_uri}): {link}",
                 "", "| stage | seconds | key figures |", "|---|---:|---|"]
        for r in self.rows:
            keys = KEY_FIGURES.get(r["stage"]) or list(r["metrics"])[:6]
            figs = ", ".join(f"{k}={r['metrics'][k]:.4g}" for k in keys
                             if isinstance(r["metrics"].get(k), (int, float)))
            lines.append(f"| {r['stage']} | {r['seconds']:.1f} | {figs} |")
        if verdict is not None:
            lines += ["", f"**Acceptance: {verdict.status}** (criteria: {verdict.criteria})"]
            lines += [f"- {r}" for r in verdict.reasons]
            lines += genre_markdown(verdict)
        if champion_vs and champion_vs["rows"]:
            lines += ["", f"Against champion v{champion_vs['version']} (registered figures):", "",
                      "| figure | candidate | champion | better |", "|---|---:|---:|---|"]
            lines += [f"| {r['what']} | {r['candidate']:.4g} | {r['champion']:.4g} | {r['better']} |"
                      for r in champion_vs["rows"]]
            if not champion_vs["use_measured"]:
                lines.append("(the champion has no chat-set figures: registered before they were measured)")
        if registered:
            lines += ["", "| model | version | aliases |", "|---|---|---|"]
            lines += [f"| {r.name} | {r.version} | {', '.join(r.aliases)} |" for r in registered]
        return "\n".join(lines)


def genre_markdown(verdict: Judged) -> list[str]:
    """Every genre's checks with values and limits: the verdict needs each to pass (the worst decides)."""
    if not verdict.checks:
        return []
    lines = ["", "| genre | check | value | limit | passed |", "|---|---|---:|---:|---|"]
    lines += [f"| {c.get('genre', '')} | {c['name']} | {c['value']:.4g} | {c['limit']:.4g} | "
              f"{'yes' if c['passed'] else '**no**'} |" for c in verdict.checks]
    if verdict.chat_note:
        lines += ["", f"chat set: {verdict.chat_note}"]
    if verdict.reference == "checkpoint":
        lines += ["", "judged against the source checkpoint as stored (accept.reference), not the fp32 graph"]
    if verdict.seconds:
        lines += ["", "accept stage seconds: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}"
                                                        for k, v in verdict.seconds.items())]
    return lines


def search_markdown(search: SearchSummary) -> str:
    """The search's table for the run summary (the same rows as the search.json artifact)."""
    lines = ["## Search (selection split; speed timed side by side)", "",
             "| candidate | size MiB | ms/token | tokens/s | perplexity ratio | top-1 agreement | accepted | front | picked |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in search.rows:
        if r["error"]:
            lines.append(f"| {r['candidate']} | failed: {r['error']} |||||||| ")
            continue
        lines.append(f"| {r['candidate']} | {r['size_mb']:.2f} | {r['ms_per_token']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['perplexity_ratio']:.4f} | {r['top1_agreement']:.4f} | {'yes' if r['accepted'] else 'no'} | "
                     f"{'yes' if r['on_front'] else ''} | {'**yes**' if r['picked'] else ''} |")
    return "\n".join(lines)


def forms_markdown(choice: dict) -> str:
    """The quantize stage's forms: every attempt (weight form x K/V cache) with its selection-split figures."""
    lines = ["### Forms judged on the selection split", "",
             "| form | K/V cache | passed | size (x source) | perplexity ratio | top-1 agreement | decode tokens/s at users | failed |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for a in choice["attempts"]:
        levels = sorted((int(k[len("tokens_per_s_b"):]), v) for k, v in a.items() if k.startswith("tokens_per_s_b"))
        tps = (" / ".join(f"{v:.0f}" for _, v in levels) + " at " + " / ".join(str(b) for b, _ in levels)
               if levels else "")
        kept = a["form"] == choice["chosen"] and a["kv"] == choice["kv"] and a["accepted"]
        share = f" ({a['int8_groups']} groups at 8 bits)" if a.get("int8_share") is not None else ""
        lines.append(f"| {a['form']}{share}{' (kept)' if kept else ''} | {a['kv_label']} | "
                     f"{'yes' if a['accepted'] else '**no**'} | {a.get('size_ratio', float('nan')):.3f} | "
                     f"{a['perplexity_ratio']:.4f} | {a['top1_agreement']:.4f} | "
                     f"{tps} | {a['failed']} |")
    if choice.get("hints"):
        lines += ["", "What the cache cost:"] + [f"- {h}" for h in choice["hints"]]
    return "\n".join(lines)


def summary_tail(search: SearchSummary | None, chain: Chain) -> str:
    """The search's table, or the quantize stage's forms, under the stage table of summary.md."""
    if search is not None:
        return "\n\n" + search_markdown(search)
    choice = chain.quant.choice if chain.quant is not None else None
    return "\n\n" + forms_markdown(choice) if choice is not None else ""
