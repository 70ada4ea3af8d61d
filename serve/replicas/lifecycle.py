"""The process that runs a replicated deployment: start (or join) Ray and Serve's proxy, deploy the application of a
``ReplicaSpec``, wait until its replicas are ready, stop it on SIGINT/SIGTERM (``compressor serve --replicas N``)."""

import argparse
import logging
import os
import signal
import sys
import threading
import time

import ray
from ray import serve as ray_serve

from serve.replicas.deploy import APP_NAME, build_app
from serve.replicas.spec import ReplicaSpec

log = logging.getLogger(__name__)


def start(spec: ReplicaSpec, *, ray_address: str | None = None, app_name: str = APP_NAME) -> str:
    """Start Ray (local) or connect (``ray_address``), start Serve's proxy on serve.host:serve.port and deploy;
    returns the base URL once every replica has loaded (or is retrying the first load)."""
    if not ray.is_initialized():
        if ray_address:
            ray.init(address=ray_address, log_to_driver=False)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, int(spec.replicas * spec.replica_cpus + 0.999)),
                     include_dashboard=False, log_to_driver=False)
    cfg = spec.serve_cfg
    ray_serve.start(http_options={"host": cfg.host, "port": cfg.port})
    ray_serve.run(build_app(spec), name=app_name, route_prefix="/")
    return f"http://{cfg.host}:{cfg.port}"


def run(args: argparse.Namespace, cfg, tracking_uri: str | None) -> int:
    """``--replicas N``: deploy, then wait until interrupted; the application is deleted on the way out."""
    if args.replicas < 1:
        print("error: --replicas must be at least 1", file=sys.stderr)
        return 2
    spec = ReplicaSpec.build(args.model, cfg.serve, replicas=args.replicas, replica_cpus=args.replica_cpus,
                             imbalance=args.prefix_imbalance, routing=args.routing, tracking_uri=tracking_uri,
                             served_name=args.served_model_name, replica_gpus=getattr(args, "replica_gpus", 0) or 0,
                             admin_token=os.environ.get(cfg.serve.admin_token_env) or None)
    url = start(spec, ray_address=args.ray_address)
    log.info("serving %s with %d replicas (routing %s) on %s; per replica: %s/replicas", args.model, args.replicas,
             args.routing, url, url)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    log.info("stopping: deleting the application")
    ray_serve.delete(APP_NAME)
    if not args.ray_address:
        ray_serve.shutdown()
        ray.shutdown()
    return 0


def wait_replicas(url: str, n: int, timeout_s: float = 120.0, version: str | None = None) -> list[dict]:
    """Until ``n`` replicas are ready (on ``version`` when given): their /replicas entries."""
    import httpx

    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url + "/replicas", timeout=30).json()["replicas"]
            ok = [r for r in last if r.get("ready") and (version is None or str(r.get("version")) == version)]
            if len(last) == n and len(ok) == n:
                return last
        except Exception:  # noqa: BLE001 - the proxy starts answering a moment after serve.run returns
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{n} replicas not ready{' on version ' + version if version else ''} within {timeout_s} s: "
                       f"{last}")
