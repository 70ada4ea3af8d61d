"""`python -m serve`: run the OpenAI-compatible server on a registry alias or a local artifact folder.

    python -m serve --model models:/smollm2-135m@champion          # follows the alias
    python -m serve --model artifacts/export/<hash>/artifact --port 8001
    python -m serve --model models:/smollm2-135m@champion --replicas 2  # Ray Serve replicas (docs/scaling.md)
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys


def build_parser(prog: str = "python -m serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser, config_args: bool = True) -> None:
    """The serve options, for embedding as a subcommand of another CLI (``config_args=False`` when
    that CLI already defines ``--config`` and ``--set``; ``run`` reads ``args.config`` and ``args.set``)."""
    p.add_argument("--model", "-m", required=True,
                   help="models:/NAME@ALIAS (followed live), models:/NAME/VERSION, or an artifact folder")
    if config_args:
        p.add_argument("--config", "-c", default=None, help="YAML config; its serve and mlflow sections are used")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set serve.max_waiting=8 (repeatable)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id in /v1/models and requests (default: the registered name or folder name)")
    p.add_argument("--host", default=None, help="bind address (default: serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: serve.port, 8000)")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: mlflow.tracking_uri, $MLFLOW_TRACKING_URI, or mlruns/)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from serve.replicas.forwarding import POLICIES  # no Ray here: it is imported only when --replicas is given

    g = p.add_argument_group("replicas on Ray Serve (pip install -e '.[ray]'; docs/scaling.md)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="N engine replicas behind Ray Serve's HTTP proxy instead of this one process")
    g.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster ('auto', or HEAD_IP:6379 after `ray start --head`); default: a "
                        "local Ray instance")
    g.add_argument("--routing", default="prefix", choices=POLICIES,
                   help="which replica takes a request (default %(default)s: the one holding the prompt's prefix)")
    g.add_argument("--replica-cpus", type=float, default=None, metavar="C",
                   help="CPUs Ray reserves for each replica, also its onnxruntime threads when "
                        "serve.intra_op_threads is 0 (default: this machine's cores / N)")
    g.add_argument("--replica-gpus", type=float, default=0, metavar="G",
                   help="GPUs Ray reserves for each replica (default 0; Ray hides the GPUs from a replica without)")
    g.add_argument("--prefix-imbalance", type=int, default=None, metavar="K",
                   help="prefix routing gives way to the least loaded replica when the prefix's replica has K more "
                        "requests in flight (default: a quarter of serve.max_batch_size, at least 8)")


def run(args: argparse.Namespace) -> int:
    """Load the model (fail fast with a clear message), then serve until interrupted."""
    import uvicorn

    from serve.api.app import create_app
    from serve.config import ConfigError, load_serve_config
    from serve.registry.resolver import ModelSourceError
    from serve.registry.source import ModelManager

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, overrides = getattr(args, "config", None), getattr(args, "set", None) or []
        # Only the serve and mlflow sections; the rest of the file is the pipeline's (serve/config.py).
        cfg = load_serve_config(config, overrides)
        serve_cfg = cfg.serve
        if args.host:
            serve_cfg.host = args.host
        if args.port:
            serve_cfg.port = args.port
        if getattr(args, "replicas", None) is not None:
            try:
                from serve.replicas import lifecycle as replicas
            except ImportError as e:
                print(f"error: --replicas needs Ray Serve: pip install -e '.[ray]' ({e})", file=sys.stderr)
                return 2
            return replicas.run(args, cfg, args.tracking_uri or cfg.mlflow.tracking_uri)
        manager = ModelManager(args.model, serve_cfg, tracking_uri=args.tracking_uri or cfg.mlflow.tracking_uri,
                               served_name=args.served_model_name)
        lm = manager.load_initial()
    except (ConfigError, ModelSourceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log = logging.getLogger("serve")
    log.info("serving %s version %s from %s on http://%s:%d", lm.name, lm.version, lm.path, serve_cfg.host,
             serve_cfg.port)
    if serve_cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the API has no authentication (only /admin/* has a token)", serve_cfg.host)
    app = create_app(manager, serve_cfg)
    # What start-up built (tokenizer, routes, schemas, the model's Python objects) lives as long as the process:
    # out of the collector's reach, a full collection during a burst walks only what requests made.
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=serve_cfg.host, port=serve_cfg.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
