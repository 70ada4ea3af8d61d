"""`compressor` command line: run the pipeline, check configs, manage the registry, serve."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def cmd_run(args) -> int:
    """Exit codes as `prefect deployment run --watch`: 0 Accepted/Completed, 1 Rejected/Blocked/failed, 2 bad input."""
    from compress.config import load_config
    from flows.errors import is_user_error
    from flows.outcome import RunNotAccepted
    from flows.pipeline import compress_flow

    load_config(args.config, args.set)  # fail fast, before Prefect starts
    t0 = time.perf_counter()
    state = compress_flow(config=args.config, overrides=args.set, return_state=True)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s: {state.name}")
    result = state.result(raise_on_failure=False)
    out = result.outcome if isinstance(result, RunNotAccepted) else result
    if isinstance(out, dict):
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"state": state.name, "seconds": round(time.perf_counter() - t0, 1),
                                                  **out}, indent=1, default=str))
        print(f"MLflow run:  {out['run_id']}  ({out['tracking_uri']})")
        for r in out["registered"]:
            print(f"registered:  {r['name']} version {r['version']} aliases {r['aliases']}")
        print(f"see it:      {out['run_url']}")
    print(f"{state.name}: {state.message}")
    if state.is_completed():
        return 0
    return 2 if isinstance(result, BaseException) and is_user_error(result) else 1


def cmd_config(args) -> int:
    from compress.config import load_config

    cfg = load_config(args.config, args.set)
    if args.action == "show":
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    else:
        print(f"{args.config}: valid (hash {cfg.section_hash()})")
    return 0


def cmd_registry(args) -> int:
    from compress.registry import store as registry
    from compress.config import load_config

    cfg = load_config(args.config, args.set)
    registry.configure(cfg.mlflow.tracking_uri)
    name = args.name or cfg.registry.model_name
    if args.action == "list":
        for v in registry.list_versions(name):
            tags = {k: v.tags[k] for k in sorted(v.tags) if k in ("role", "verdict", "promotion_blocked", "config_hash")
                    and v.tags[k]}
            print(f"{name} v{v.version:>3}  aliases={','.join(v.aliases) or '-':<24} {json.dumps(tags)}")
    elif args.action == "promote":
        before = registry.promote(name, args.version, args.alias, by="compressor registry promote")
        print(f"{name}@{args.alias}: {before} -> {args.version}")
    elif args.action == "rollback":
        to = registry.rollback(name, args.version, args.alias)
        print(f"{name}@{args.alias} -> {to}")
    elif args.action == "compare":
        print(compare_table(name, args.version or "champion", args.other or "candidate"))
    return 0


def _version(name: str, ref: str):
    from compress.registry import store as registry

    if ref.isdigit():
        return registry.get_version(name, ref)
    v = registry.version_for_alias(name, ref)
    if v is None:
        raise registry.RegistryError(f"{name} has no alias {ref!r}; give a version number or an existing alias")
    return v


def compare_table(name: str, a_ref: str, b_ref: str) -> str:
    """Two versions' figures side by side, with b/a ratios: the terminal twin of the UI's model-version Compare."""
    from compress.registry import store as registry

    a, b = _version(name, a_ref), _version(name, b_ref)
    fa, fb = registry.figures(name, a.version), registry.figures(name, b.version)
    keys = sorted(set(fa) | set(fb))
    head = f"{'figure':<40} {'v' + a.version + ' (' + a_ref + ')':>22} {'v' + b.version + ' (' + b_ref + ')':>22} {'ratio':>8}"
    lines = [head, "-" * len(head)]
    for k in ("role", "verdict"):
        lines.append(f"{k:<40} {a.tags.get(k, '-'):>22} {b.tags.get(k, '-'):>22}")
    lines.append(f"{'aliases':<40} {','.join(a.aliases) or '-':>22} {','.join(b.aliases) or '-':>22}")
    for k in keys:
        x, y = _num(fa.get(k)), _num(fb.get(k))
        ratio = f"{y / x:8.3f}" if x not in (None, 0) and y is not None else ""
        fx = f"{x:>22.5g}" if x is not None else f"{'-':>22}"
        fy = f"{y:>22.5g}" if y is not None else f"{'-':>22}"
        lines.append(f"{k:<40} {fx} {fy} {ratio}")
    return "\n".join(lines)


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def cmd_serve(args) -> int:
    from serve.__main__ import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compressor", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--config", "-c", default="configs/default.yaml", help="YAML config (default: %(default)s)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set distill.steps=10 (repeatable)")

    r = sub.add_parser("run", help="run the compression flow")
    common(r)
    r.add_argument("--out", metavar="FILE", help="also write the run's outcome (stages with seconds and figures, the "
                   "verdict, the versions) as JSON to FILE, whatever the verdict")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("config", help="validate or print the resolved config")
    c.add_argument("action", choices=["check", "show"])
    common(c)
    c.set_defaults(fn=cmd_config)

    g = sub.add_parser("registry", help="list versions, promote, roll back")
    g.add_argument("action", choices=["list", "promote", "rollback", "compare"])
    g.add_argument("version", nargs="?",
                   help="version number (promote: required; rollback: default previous; compare: version or alias, "
                        "default champion)")
    g.add_argument("other", nargs="?", help="compare: the second version or alias (default candidate)")
    g.add_argument("--name", help="registered model name (default: registry.model_name of the config)")
    g.add_argument("--alias", default="champion")
    common(g)
    g.set_defaults(fn=cmd_registry)

    from serve.__main__ import add_arguments

    s = sub.add_parser("serve", help="OpenAI-compatible server on models:/NAME@ALIAS (followed live) or a folder")
    add_arguments(s, config_args=False)
    s.add_argument("--config", "-c", default=None, help="YAML config; its serve and mlflow sections are used")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    s.set_defaults(fn=cmd_serve)

    from loadtest import kv_calc

    k = sub.add_parser("kv-calc", help="KV-cache memory for a model shape, context and concurrency (or what fits a budget)")
    kv_calc.add_arguments(k)
    k.set_defaults(fn=kv_calc.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "action", None) == "promote" and not args.version:
        print("compressor registry promote: give the version number to promote", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except Exception as e:
        from flows.errors import is_user_error

        if not is_user_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
