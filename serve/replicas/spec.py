"""What one replicated deployment is: ``ReplicaSpec``, built once from the command line or a Serve config file's
args, with every default resolved (each replica's CPUs and threads, the routing's imbalance). Without Ray: the
Ray application (serve/replicas/deploy.py) and the process that runs it (serve/replicas/lifecycle.py) read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from serve.config import ConfigError, ServeConfig
from serve.replicas.forwarding import POLICIES

# The keys a Serve config file's application args may hold (serve.replicas.deploy:application).
APPLICATION_ARGS = ("model", "replicas", "serve", "tracking_uri", "served_model_name", "routing", "prefix_imbalance",
                    "replica_cpus", "replica_gpus")


def default_imbalance(serve_cfg: ServeConfig) -> int:
    """How many more requests in flight the replica holding a prefix may have than the least loaded one before the
    request goes to the least loaded: a quarter of a batch, at least 8. A whole batch (64) was the default until a
    replica killed under 32 clients showed the survivor keeping every conversation while its replacement idled:
    with a quarter the replacement takes its share, 89-101 output tokens/s against 79
    (docs/reliability.md#replicas-that-die-under-load)."""
    return max(8, serve_cfg.max_batch_size // 4)


def default_replica_cpus(replicas: int) -> int:
    return max(1, (os.cpu_count() or 1) // replicas)


def threads_for(serve_cfg: ServeConfig, cpus: float) -> ServeConfig:
    """onnxruntime's default is one thread per core of the machine: N replicas on one node would each take every
    core. Unless serve.intra_op_threads says otherwise, a replica uses as many threads as it reserves CPUs."""
    if serve_cfg.intra_op_threads == 0:
        return serve_cfg.model_copy(update={"intra_op_threads": max(1, int(cpus))})
    return serve_cfg


@dataclass(frozen=True)
class ReplicaSpec:
    """One replicated deployment, defaults resolved: ``serve_cfg`` is each replica's (its threads set)."""

    model: str
    serve_cfg: ServeConfig
    replicas: int
    replica_cpus: float
    imbalance: int
    tracking_uri: str | None = None
    served_name: str | None = None
    routing: str = "prefix"
    replica_gpus: float = 0
    admin_token: str | None = None
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 10.0

    @classmethod
    def build(cls, model: str, serve_cfg: ServeConfig, *, replicas: int, replica_cpus: float | None = None,
              imbalance: int | None = None, routing: str = "prefix", **rest) -> ReplicaSpec:
        if replicas < 1:
            raise ConfigError(f"replicas {replicas}: at least 1")
        if routing not in POLICIES:
            raise ConfigError(f"routing {routing!r}: use one of {', '.join(POLICIES)}")
        cpus = replica_cpus if replica_cpus is not None else default_replica_cpus(replicas)
        return cls(model=model, serve_cfg=threads_for(serve_cfg, cpus), replicas=replicas, replica_cpus=cpus,
                   imbalance=default_imbalance(serve_cfg) if imbalance is None else imbalance, routing=routing,
                   **rest)

    @classmethod
    def from_application_args(cls, args: dict | None) -> ReplicaSpec:
        """A Serve config file's application args (serve.replicas.deploy:application); the admin token is read
        from the replicas' environment there (``runtime_env``)."""
        args = dict(args or {})
        unknown = sorted(set(args) - set(APPLICATION_ARGS))
        if unknown or "model" not in args:
            raise ConfigError(f"serve.replicas.deploy:application args: unknown {unknown}" if unknown
                              else "serve.replicas.deploy:application args: model is required (models:/NAME@ALIAS or "
                                   "a folder)")
        return cls.build(args["model"], ServeConfig(**(args.get("serve") or {})), replicas=int(args.get("replicas", 1)),
                         replica_cpus=float(args.get("replica_cpus", 1)), imbalance=args.get("prefix_imbalance"),
                         routing=args.get("routing", "prefix"), tracking_uri=args.get("tracking_uri"),
                         served_name=args.get("served_model_name"), replica_gpus=float(args.get("replica_gpus", 0)))
