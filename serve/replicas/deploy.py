"""Several engine replicas behind Ray Serve's HTTP proxy: ``compressor serve --replicas N`` (docs/scaling.md).

    compressor serve --model models:/smollm2-135m@champion --replicas 2                       # a local Ray instance
    compressor serve --model models:/smollm2-135m@champion --replicas 4 --ray-address auto    # an existing cluster

Two Ray Serve deployments make one application:

- ``Ingress`` (one replica, no CPU reserved) behind Ray Serve's HTTP proxy: reads each request's body, computes
  its routing key (serve/replicas/forwarding.py) and forwards it to an engine replica through a deployment handle
  whose request router is serve/replicas/router.py (prefix-aware by default). It streams the replica's answer back
  as it comes (SSE included; a stream's headers leave with its first token), answers 429 + Retry-After when Ray's
  queue in front of the replicas is full (the replicas' own 429s pass through unchanged), sends a request whose
  replica died before its first token to another (up to 4 calls; 503 + Retry-After once they are spent), and ends
  a stream with an error event when its replica died mid-stream. A restarted ingress rebuilds the router's prefix
  table from the chains each replica says it served. Its own routes: ``/health``, ``/ready`` (200 once a replica
  has a model), ``/replicas`` (each replica's id, pid, node, model version, requests routed to it, prefix-cache
  hits), ``/replicas/{id}/...`` (any GET route of one replica: ``/replicas/{id}/metrics``, ``.../ready``),
  ``/metrics`` (the replicas' metrics merged, plus the router's), ``/v1/models`` (the version every replica serves;
  a list of versions during a rollout), ``POST /admin/reload`` (sent to every replica).
- ``EngineReplica`` (N replicas, ``--replica-cpus`` each): the single-process server's own app (serve/api/app.py:
  create_app over a ModelManager) run in-process on each forwarded request; each replica has its own engine, KV
  budget, prefix cache, result cache, and alias poller, so a promotion or rollback reaches every replica within
  ``serve.poll_interval_s`` and in-flight requests finish on the model they started on. Ray restarts a replica
  that dies (health checks every ``health_check_period_s``).

Ray is an optional extra (``pip install -e '.[ray]'``): only this module and serve/replicas/router.py import it, and
only ``--replicas`` imports them.
"""

# No `from __future__ import annotations`: Ray Serve's class-based FastAPI views read the annotations
# (``request: Request``) at run time.
import asyncio
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve as ray_serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException

from serve.api.schemas import error_body
from serve.api.streaming import DisconnectAwareStream
from serve.config import ServeConfig
from serve.replicas.forwarding import (REPLICA_HEADER, ForwardedRequest, forwarded, live_replicas,
                                       merge_metrics, metric_value, offer_chains, response_headers, routing_stats,
                                       run_asgi)
from serve.replicas.router import ReplicaRouter
from serve.replicas.spec import ReplicaSpec

log = logging.getLogger(__name__)

APP_NAME = "compressor"
ENGINE = "EngineReplica"
INGRESS = "Ingress"
INFO_PATH = "/_replica"  # answered by EngineReplica itself: who it is and what it serves
CHAINS_PATH = "/_replica/chains"  # ... and the prefix chains it served, newest last (the ingress's table rebuilt)
CHAINS_KEPT = 50_000  # per replica; the router remembers 200_000 over all replicas
RESTORE_WAIT_S = 60.0  # how long a starting ingress waits for the router's first list of replicas
ADMIN_TIMEOUT_S = 10.0  # per-replica calls of /replicas, /metrics, /admin/reload


# ---- the engine replica ----------------------------------------------------------------------------------
class EngineReplica:
    """One engine: the single-process server's app and model manager, driven per forwarded request."""

    def __init__(self, model: str, serve_cfg: dict, tracking_uri: str | None, served_name: str | None,
                 admin_token: str | None):
        from serve.api.app import create_app
        from serve.registry.resolver import ModelSourceError
        from serve.registry.source import ModelManager

        cfg = ServeConfig(**serve_cfg)
        ctx = ray_serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.manager = ModelManager(model, cfg, tracking_uri=tracking_uri, served_name=served_name)
        self.app = create_app(self.manager, cfg, admin_token=admin_token)
        try:
            self.manager.load_initial()
        except ModelSourceError as e:
            # As the single server: answer 503 model_not_ready and keep trying every poll interval.
            log.warning("replica %s: %s; retrying every %.0f s", self.replica_id, e, cfg.poll_interval_s)
            threading.Thread(target=self.manager.load_until_ready, name="first-load", daemon=True).start()
        self.manager.start_polling()
        self._header = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        self._chains: OrderedDict[bytes, None] = OrderedDict()  # routing chains of the requests it took
        log.info("replica %s (pid %d) serving %s", self.replica_id, os.getpid(), model)

    def info(self) -> dict:
        lm = self.manager.current
        text = self.app.state.metrics.render().decode()
        return {"replica": self.replica_id, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ready": lm is not None, "model": lm.name if lm else None, "version": lm.version if lm else None,
                "alias": lm.alias if lm else None, "error": self.manager.last_error,
                "swaps": self.manager.num_swaps, "alias_polls": self.manager.num_polls,
                "prefix_cache_queries": metric_value(text, "vllm:prefix_cache_queries_total"),
                "prefix_cache_hits": metric_value(text, "vllm:prefix_cache_hits_total"),
                "generation_tokens": metric_value(text, "vllm:generation_tokens_total")}

    async def __call__(self, req: ForwardedRequest) -> AsyncIterator[list[dict]]:
        if req.target is not None and req.target != self.replica_id:
            yield _json_messages(404, error_body(f"replica {req.target} is gone", "not_found_error",
                                                 code="replica_gone"), self._header)
            return
        if req.path == INFO_PATH:
            yield _json_messages(200, await asyncio.to_thread(self.info), self._header)
            return
        if req.path == CHAINS_PATH:
            yield _json_messages(200, {"replica": self.replica_id, "chains": [h.hex() for h in self._chains]},
                                 self._header)
            return
        if req.prefix_hashes:
            for h in req.prefix_hashes:
                self._chains[h] = None
                self._chains.move_to_end(h)
            while len(self._chains) > CHAINS_KEPT:
                self._chains.popitem(last=False)
        async for batch in run_asgi(self.app, req, self._header):
            yield batch

    def check_health(self) -> None:
        lm = self.manager.current
        if lm is not None and not lm.closed and not lm.engine.running:
            raise RuntimeError(f"replica {self.replica_id}: the engine's step loop stopped")

    def __del__(self):
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.shutdown()


def _json_messages(status: int, body, extra_headers=()) -> list[dict]:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
               *extra_headers]
    return [{"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": data, "more_body": False}]


# ---- the ingress --------------------------------------------------------------------------------------
# No docs routes of its own: /docs and /openapi.json go to a replica, as every other path.
ingress_app = FastAPI(title="compressor replicas (Ray Serve ingress)", docs_url=None, redoc_url=None, openapi_url=None)

# What the ingress counts itself (the router's counters are in serve/replicas/forwarding.py).
_ERRORS: dict[str, int] = {}
# A request whose replica failed before answering goes again (Ingress._open): 4 calls over ~1.75 s, enough for Ray to
# drop a killed replica from the router's choices.
OPEN_TRIES = 4
RETRY_DELAYS_S = (0.25, 0.5, 1.0)


async def _until_first_body(gen) -> list[dict]:
    """The replica's messages up to its first body bytes (or the end): a stream's response start comes before its
    first token, and until that token nothing need reach the client, so the request can still go elsewhere."""
    batch = list(await gen.__anext__())
    while not any(m["type"] == "http.response.body" and (m.get("body") or not m.get("more_body", False))
                  for m in batch):
        try:
            batch += await gen.__anext__()
        except StopAsyncIteration:
            break
    return batch


def _error(status: int, message: str, type_: str, code: str, retry_after: int | None = None) -> JSONResponse:
    _ERRORS[code] = _ERRORS.get(code, 0) + 1
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(message, type_, code=code), status, headers=headers)


@ray_serve.ingress(ingress_app)
class Ingress:
    def __init__(self, engine, max_request_bytes: int = 1_048_576, retry_after_s: int = 1):
        self.max_request_bytes, self.retry_after_s = max_request_bytes, retry_after_s
        # .options() initializes the handle: its router starts following the replicas now, not at the first request.
        self.engine = engine.options(stream=True)
        ctx = ray_serve.get_replica_context()
        self._key = (ctx.app_name, engine.deployment_name)
        # The router's prefix table starts empty in a new ingress process: the replicas say what they hold.
        # Ray Serve (2.60) runs this constructor on the replica's event loop, which the rebuild then runs on.
        try:
            self._restoring = asyncio.get_running_loop().create_task(self._restore_routes())
        except RuntimeError:  # no loop here (another Ray Serve): conversations route as new prefixes instead
            log.warning("no event loop in the ingress's constructor: the prefix table is not rebuilt")
            self._restoring = None

    async def _restore_routes(self) -> int:
        """Ask every replica for the prefix chains it served and offer them to the router (serve/replicas/router.py);
        returns how many were offered. A replica that does not answer is skipped: its prefixes route as new."""
        deadline = time.monotonic() + RESTORE_WAIT_S
        while not self.replica_ids():
            if time.monotonic() > deadline:
                log.warning("no replica to restore the prefix table from within %.0f s", RESTORE_WAIT_S)
                return 0
            await asyncio.sleep(0.2)
        chains = []
        for rid, status, _, body in await self._each_replica("GET", CHAINS_PATH):
            if status == 200:
                chains += [(bytes.fromhex(h), rid) for h in json.loads(body)["chains"]]
            else:
                log.warning("replica %s did not list its prefix chains: %s", rid, body[:200])
        offer_chains(self._key, chains)
        log.info("prefix table: %d chains offered by %d replicas", len(chains), len(self.replica_ids()))
        return len(chains)

    # -- forwarding -------------------------------------------------------------------------------------
    async def _open(self, fwd: ForwardedRequest):
        """(the replica's call, its first batch of ASGI messages), or (None, an error response).

        The first batch reaches up to the first body bytes: a stream's headers go out with its first token, so a
        stream whose replica fails before that has sent the client nothing either.
        A replica that fails before its first batch has sent the client nothing, so the request goes again, to the
        replica the router picks then (Ray drops a dead one from its choices): up to OPEN_TRIES calls, spaced
        RETRY_DELAYS_S apart, before the client gets a 503. A request for one named replica is not retried."""
        tries = 1 if fwd.target else OPEN_TRIES
        for attempt in range(tries):
            gen = self.engine.remote(fwd)
            try:
                return gen, await _until_first_body(gen)
            except asyncio.CancelledError:  # the client went away before the first byte
                gen.cancel()
                raise
            except BackPressureError as e:
                return None, _error(429, f"every replica's queue is full: {e}", "rate_limit_error", "queue_full",
                                    self.retry_after_s)
            except StopAsyncIteration:
                return None, _error(502, "the replica answered nothing", "server_error", "replica_failed",
                                    self.retry_after_s)
            except (ray.exceptions.RayError, DeploymentUnavailableError, RayServeException) as e:
                log.warning("request to a replica failed (try %d of %d): %s: %s", attempt + 1, tries,
                            type(e).__name__, e)
                if attempt + 1 < tries:
                    _ERRORS["replica_failed_retried"] = _ERRORS.get("replica_failed_retried", 0) + 1
                    await asyncio.sleep(RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)])
                    continue
                return None, _error(503, f"the replica serving this request failed ({type(e).__name__}); retry",
                                    "service_unavailable", "replica_failed", self.retry_after_s)

    async def _forward(self, fwd: ForwardedRequest):
        gen, first = await self._open(fwd)
        if gen is None:
            return first
        start, bodies = first[0], first[1:]
        status, headers = start["status"], response_headers(start.get("headers", []))
        if bodies and not bodies[-1].get("more_body", False):  # the whole answer is here (every JSON answer)
            return Response(b"".join(m.get("body", b"") for m in bodies), status, headers=headers)
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return DisconnectAwareStream(self._rest(gen, bodies, sse), status_code=status, headers=headers)

    async def _rest(self, gen, bodies: list[dict], sse: bool) -> AsyncIterator[bytes]:
        finished = False
        try:
            for m in bodies:
                yield m.get("body", b"")
            while True:
                try:
                    batch = await gen.__anext__()
                except StopAsyncIteration:
                    finished = True
                    return
                for m in batch:
                    if m["type"] == "http.response.body":
                        yield m.get("body", b"")
        except (ray.exceptions.RayError, RayServeException) as e:
            finished = True
            _ERRORS["replica_failed_mid_stream"] = _ERRORS.get("replica_failed_mid_stream", 0) + 1
            log.warning("a replica failed mid-stream: %s: %s", type(e).__name__, e)
            if not sse:
                raise  # the connection is cut: a client cannot take a half JSON body for a whole one
            err = error_body(f"the replica serving this stream failed ({type(e).__name__}); retry",
                             "service_unavailable", code="replica_failed")
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            if not finished:
                gen.cancel()  # the client went away: the replica's app sees a disconnect and cancels the request

    async def _call_replica(self, rid: str, method: str, path: str, headers=(), body: bytes = b""):
        """(status, headers, body) of one replica's answer, or (None, None, error text)."""
        fwd = ForwardedRequest(method, path, b"", list(headers), body, target=rid)
        try:
            gen = self.engine.remote(fwd)
            chunks, status, hdrs = [], None, None
            async def collect():
                nonlocal status, hdrs
                async for batch in gen:
                    for m in batch:
                        if m["type"] == "http.response.start":
                            status, hdrs = m["status"], response_headers(m.get("headers", []))
                        else:
                            chunks.append(m.get("body", b""))
            await asyncio.wait_for(collect(), ADMIN_TIMEOUT_S)
            return status, hdrs, b"".join(chunks)
        except (asyncio.TimeoutError, ray.exceptions.RayError, RayServeException) as e:
            return None, None, f"{type(e).__name__}: {e}".encode()

    async def _each_replica(self, method: str, path: str, headers=(), body: bytes = b"") -> list[tuple]:
        """(replica id, status, headers, body) of every replica, one after the other: calls made while serving
        one request share its internal request id, and Ray's router matches replicas to pending requests by that
        id, so two at once would wait on each other."""
        out = []
        for rid in self.replica_ids():
            out.append((rid, *await self._call_replica(rid, method, path, headers, body)))
        return out

    def replica_ids(self) -> list[str]:
        return live_replicas(self._key)

    # -- the ingress's own routes ------------------------------------------------------------------------
    @ingress_app.get("/health")
    async def health(self):
        return {"status": "ok", "replicas": len(self.replica_ids()), "pid": os.getpid()}

    @ingress_app.get("/ready")
    async def ready(self):
        infos = await self._infos()
        ok = [i for i in infos if i.get("ready")]
        body = {"status": "ready" if ok else "loading", "replicas": infos}
        if ok:
            versions = sorted({str(i["version"]) for i in ok})
            body.update(model=ok[0]["model"], version=versions[0] if len(versions) == 1 else versions)
            return body
        return JSONResponse(body, 503, headers={"Retry-After": str(self.retry_after_s)})

    async def _infos(self) -> list[dict]:
        stats = routing_stats(self._key)
        out = []
        for rid, status, _, body in await self._each_replica("GET", INFO_PATH):
            info = json.loads(body) if status == 200 else {"replica": rid, "ready": False,
                                                           "error": body.decode(errors="replace")}
            info["requests_routed"] = stats.get(f"routed:{rid}", 0)
            out.append(info)
        return out

    @ingress_app.get("/replicas")
    async def replicas(self):
        return {"replicas": await self._infos(), "router": dict(routing_stats(self._key))}

    @ingress_app.get("/replicas/{rid}/{path:path}")
    async def one_replica(self, rid: str, path: str, request: Request):
        status, headers, body = await self._call_replica(rid, "GET", "/" + path, request.headers.raw)
        if status is None:
            return _error(503, f"replica {rid}: {body.decode(errors='replace')}", "service_unavailable",
                          "replica_failed", self.retry_after_s)
        return Response(body, status, headers=headers)

    @ingress_app.get("/metrics")
    async def metrics(self):
        answers = await self._each_replica("GET", "/metrics")
        texts = [body.decode() for _, status, _, body in answers if status == 200]
        stats = routing_stats(self._key)
        lines = [merge_metrics(texts).rstrip("\n"),
                 "# HELP compressor:replicas Engine replicas the router routes to.", "# TYPE compressor:replicas gauge",
                 f"compressor:replicas {len(answers)}",
                 "# HELP compressor:replicas_scraped Replicas whose /metrics answered this scrape.",
                 "# TYPE compressor:replicas_scraped gauge", f"compressor:replicas_scraped {len(texts)}",
                 "# HELP compressor:replica_requests Requests the router sent to each replica.",
                 "# TYPE compressor:replica_requests counter"]
        for k, n in sorted(stats.items()):
            if k.startswith("routed:"):
                lines.append(f'compressor:replica_requests_total{{replica="{k[7:]}"}} {n}')
        lines += ["# HELP compressor:router_decisions Prefix routing decisions (affinity: to the replica holding "
                  "the prefix; imbalanced: away from it, too busy; new_prefix; no_prefix).",
                  "# TYPE compressor:router_decisions counter"]
        for k in ("affinity", "imbalanced", "new_prefix", "no_prefix"):
            lines.append(f'compressor:router_decisions_total{{decision="{k}"}} {stats.get(k, 0)}')
        lines += ["# HELP compressor:router_chains_restored Prefix chains the router learnt from the replicas when "
                  "this ingress started.", "# TYPE compressor:router_chains_restored counter",
                  f"compressor:router_chains_restored_total {stats.get('restored', 0)}"]
        lines += ["# HELP compressor:ingress_errors Answers the ingress made itself, by code.",
                  "# TYPE compressor:ingress_errors counter"]
        for k, n in sorted(_ERRORS.items()):
            lines.append(f'compressor:ingress_errors_total{{code="{k}"}} {n}')
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    @ingress_app.get("/v1/models")
    async def models(self):
        """The model every replica serves: one version when they agree; during a rollout ``version`` lists the
        versions served (``replica_versions`` says which replica serves which), so a deploy that waits for a
        version (flows/deploy.py) waits until every replica serves it."""
        cards: dict[str, list[tuple[str, dict]]] = {}
        for rid, status, _, body in await self._each_replica("GET", "/v1/models"):
            if status == 200:
                for card in json.loads(body).get("data", []):
                    cards.setdefault(card["id"], []).append((rid, card))
        if not cards:
            return {"object": "list", "data": []}
        data = []
        for held in cards.values():
            card = dict(held[0][1])
            if len({(c.get("version"), c.get("artifact_sha256")) for _, c in held}) > 1:
                card["version"] = sorted({str(c.get("version")) for _, c in held})
                card["artifact_sha256"] = None
            card["replica_versions"] = {rid: c.get("version") for rid, c in held}
            data.append(card)
        return {"object": "list", "data": data}

    @ingress_app.post("/admin/reload")
    async def admin_reload(self, request: Request):
        body = await request.body()
        answers = await self._each_replica("POST", "/admin/reload", request.headers.raw, body)
        out = {rid: (json.loads(b) if s is not None and b else {"error": b.decode(errors="replace")})
               for rid, s, _, b in answers}
        statuses = {s for _, s, _, _ in answers}
        status = statuses.pop() if len(statuses) == 1 and None not in statuses else 500
        return JSONResponse({"replicas": out}, status)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def forward(self, path: str, request: Request):
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_request_bytes:
                return _error(413, f"request body larger than {self.max_request_bytes} bytes",
                              "invalid_request_error", "request_too_large")
        fwd = forwarded(request.method, "/" + path, request.url.query.encode(), request.headers.raw, body)
        return await self._forward(fwd)


# ---- the application ------------------------------------------------------------------------------------
def build_app(spec: ReplicaSpec):
    """The Ray Serve application: ``ray.serve.run(build_app(spec), name=APP_NAME, route_prefix="/")``."""
    cfg = spec.serve_cfg
    # A replica takes what its engine can hold (a batch, its waiting queue) and some room for admin calls; beyond
    # that the engine answers 429 itself. Ray's own queue in front of the replicas holds as much again.
    max_ongoing = cfg.max_batch_size + cfg.max_waiting + 32
    actor_options: dict = {"num_cpus": spec.replica_cpus}
    if spec.replica_gpus:  # Ray hides the GPUs from an actor that reserves none (CUDA_VISIBLE_DEVICES="")
        actor_options["num_gpus"] = spec.replica_gpus
    if spec.admin_token:
        actor_options["runtime_env"] = {"env_vars": {cfg.admin_token_env: spec.admin_token}}
    engine = ray_serve.deployment(EngineReplica).options(
        name=ENGINE, num_replicas=spec.replicas, ray_actor_options=actor_options, max_ongoing_requests=max_ongoing,
        max_queued_requests=cfg.max_waiting * spec.replicas, health_check_period_s=spec.health_check_period_s,
        health_check_timeout_s=spec.health_check_timeout_s, graceful_shutdown_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=ReplicaRouter,
            request_router_kwargs={"policy": spec.routing, "imbalance": spec.imbalance}))
    ingress = ray_serve.deployment(Ingress).options(name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0},
                                                max_ongoing_requests=4096)
    return ingress.bind(engine.bind(spec.model, cfg.model_dump(mode="json"), spec.tracking_uri, spec.served_name,
                                    spec.admin_token), cfg.max_request_bytes)


def application(args: dict):
    """Ray Serve application builder, for a Serve config file (``serve run`` / ``serve deploy``, KubeRay's RayService):

        applications:
          - name: compressor
            route_prefix: /
            import_path: serve.replicas.deploy:application
            args: {model: "models:/smollm2-135m@champion", replicas: 2, tracking_uri: "http://mlflow.internal:5000",
                   serve: {kv_memory_mb: 2048, poll_interval_s: 10}}

    ``serve`` holds ServeConfig keys (configs/default.yaml's serve section); the HTTP host and port are the config
    file's ``http_options``. The admin token is read from the replicas' environment (``runtime_env``)."""
    return build_app(ReplicaSpec.from_application_args(args))
