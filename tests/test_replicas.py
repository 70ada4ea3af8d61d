"""Engine replicas on Ray Serve (serve/replicas/deploy.py, docs/scaling.md): a local Ray instance with 2 replicas of the tiny
model behind Ray Serve's HTTP proxy, following an MLflow alias. Real Ray, real processes, the openai client.

One Ray instance for the module (about 15 s to start on 2 cores): outputs equal to the single server's, both
replicas take traffic, a shared prompt prefix stays on one replica, per-replica and merged metrics, 429 +
Retry-After through the proxy, an alias flip reaching both replicas while requests run, and a replica killed
mid-stream: its streams end with an error at once, the other replica's finish, Ray starts a new one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from loadtest.serve_bench import free_port
from serve.api.app import create_app
from serve.api.background import BackgroundServer
from served import serve_cfg
from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.replicas.forwarding import REPLICA_HEADER, metric_value

# Ray is imported by the fixture, not at collection: the rest of the suite runs without its import side effects.
pytestmark = [pytest.mark.timeout(420),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="the ray extra is not installed (pip install -e '.[ray]')")]

NAME = "tiny-replicas"
SYSTEM = ("You are the help desk of a library. Answer in one short sentence, name the shelf, and never invent a "
          "book. Opening hours are nine to five on weekdays and ten to two on Saturdays. ")  # 4 routing blocks


def cfg(**kw) -> ServeConfig:
    kw.setdefault("intra_op_threads", 1)  # as each replica: the same reductions, the same greedy tokens
    return serve_cfg(**kw)


@pytest.fixture(scope="module")
def versions(mlflow_store, tiny_artifact, seed1_artifact, tmp_path_factory):
    """v1 = seed 0 (champion), v2 = seed 1."""
    import mlflow

    from compress.registry import store as registry

    root = tmp_path_factory.mktemp("replicas_mlruns")
    exp = mlflow.create_experiment(f"{NAME}-{time.time_ns()}", artifact_location=root.as_uri())
    out = {}
    for key, folder in (("v1", tiny_artifact), ("v2", seed1_artifact)):
        with mlflow.start_run(experiment_id=exp) as run:
            v = registry.register_folder(folder, NAME, run.info.run_id, {"role": key},
                                         ["champion"] if key == "v1" else [])
        out[key] = str(v.version)
    return out


@pytest.fixture(scope="module")
def refs(tiny_artifact, seed1_artifact):
    engines = {"1": Engine(tiny_artifact, cfg(), start=False), "2": Engine(seed1_artifact, cfg(), start=False)}
    yield engines
    for e in engines.values():
        e.shutdown()


def expected(refs, version: str, prompt: str, n: int) -> str:
    return refs[version].add_request(prompt, SamplingParams.greedy(n, ignore_eos=True)).result(timeout=60).text


@pytest.fixture(scope="module")
def cluster(versions, mlflow_store):
    """2 replicas following models:/NAME@champion behind Ray Serve's proxy on a free port: (url, start-up s)."""
    import ray
    from ray import serve as ray_serve

    from serve.replicas import lifecycle as replicas
    from serve.replicas.spec import ReplicaSpec

    t0 = time.monotonic()
    spec = ReplicaSpec.build(f"models:/{NAME}@champion",
                             cfg(poll_interval_s=0.3, max_batch_size=8, max_waiting=8, port=free_port()),
                             replicas=2, replica_cpus=1, tracking_uri=mlflow_store, health_check_period_s=1.0)
    url = replicas.start(spec)
    replicas.wait_replicas(url, 2, timeout_s=120)
    startup = time.monotonic() - t0
    print(f"\nRay + 2 replicas ready in {startup:.1f} s")
    try:
        yield url
    finally:
        ray_serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single(versions, mlflow_store):
    """The single-process server on the same alias: the reference the replicas must match."""
    app = create_app(f"models:/{NAME}@champion", cfg(), tracking_uri=mlflow_store)
    with BackgroundServer(app) as srv:
        yield srv.url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def replica_list(url: str) -> list[dict]:
    return httpx.get(url + "/replicas", timeout=30).json()["replicas"]


def chat(c: openai.OpenAI, user: str, system: str | None = None, n: int = 12, stream: bool = False):
    """(text, replica id) of a greedy chat completion."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    kw = dict(model=NAME, messages=msgs, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        with c.chat.completions.with_streaming_response.create(stream=True, **kw) as r:
            text = "".join((ch.choices[0].delta.content or "") for ch in r.parse() if ch.choices)
            return text, r.headers.get(REPLICA_HEADER)
    raw = c.chat.completions.with_raw_response.create(**kw)
    return raw.parse().choices[0].message.content, raw.headers.get(REPLICA_HEADER)


def test_outputs_equal_the_single_servers(cluster, single):
    multi, one = client(cluster), client(single)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time " * 6]
    for p in prompts:
        a = multi.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
        b = one.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
        assert a.system_fingerprint == b.system_fingerprint == f"{NAME}-v1"
    for user, stream in (("Where are the atlases?", False), ("Is it open on Sunday?", True)):
        assert chat(multi, user, SYSTEM, stream=stream)[0] == chat(one, user, SYSTEM, stream=stream)[0]


def test_concurrent_requests_reach_both_replicas_and_a_shared_prefix_stays_on_one(cluster):
    c = client(cluster)
    before = {r["replica"]: r for r in replica_list(cluster)}
    # Distinct prompts, 8 at once: the least loaded replica takes each new prefix (ties: a hash of the prefix).
    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(lambda i: chat(c, f"Question {i}: which floor has the maps of {i * 7} old towns?"),
                               range(16)))
    by_replica = Counter(rid for _, rid in served)
    assert set(by_replica) == set(before) and min(by_replica.values()) >= 1, by_replica
    # The same system prompt: one user, then five at once. One replica takes them all; the five find the prefix's
    # KV blocks cached there, and the other replica's prefix cache sees none of it.
    mid = {r["replica"]: r for r in replica_list(cluster)}
    shared = [chat(c, "User 0 asks about shelf 0.", SYSTEM)]
    with ThreadPoolExecutor(5) as pool:
        shared += list(pool.map(lambda i: chat(c, f"User {i} asks about shelf {i}.", SYSTEM), range(1, 6)))
    [owner] = {rid for _, rid in shared}
    after = {r["replica"]: r for r in replica_list(cluster)}
    [other] = [rid for rid in after if rid != owner]
    assert after[other]["prefix_cache_queries"] == mid[other]["prefix_cache_queries"]
    hits = after[owner]["prefix_cache_hits"] - mid[owner]["prefix_cache_hits"]
    assert hits >= 5 * 16, hits  # each of the five found at least the first 16-token KV block cached
    routed = {rid: r["requests_routed"] - before[rid]["requests_routed"] for rid, r in after.items()}
    assert routed == {owner: by_replica[owner] + 6, other: by_replica[other]}, routed


def test_metrics_per_replica_and_merged(cluster):
    ids = [r["replica"] for r in replica_list(cluster)]
    per = {rid: httpx.get(f"{cluster}/replicas/{rid}/metrics", timeout=30) for rid in ids}
    assert all(r.status_code == 200 and r.headers[REPLICA_HEADER] == rid for rid, r in per.items())
    merged = httpx.get(cluster + "/metrics", timeout=30).text
    for name in ("vllm:generation_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        parts = [metric_value(r.text, name) for r in per.values()]
        assert metric_value(merged, name) == sum(parts) > 0, (name, parts)
    assert all(metric_value(r.text, "vllm:generation_tokens_total") > 0 for r in per.values())
    assert metric_value(merged, "compressor:served_model_info", version="1") == 2  # two replicas on version 1
    assert metric_value(merged, "compressor:replicas") == 2 == metric_value(merged, "compressor:replicas_scraped")
    assert {rid: metric_value(merged, "compressor:replica_requests_total", replica=rid) > 0 for rid in ids} == \
        dict.fromkeys(ids, True)
    assert metric_value(merged, "compressor:router_decisions_total", decision="affinity") >= 5
    assert httpx.get(f"{cluster}/replicas/nosuchreplica/metrics", timeout=30).status_code == 404
    ready = httpx.get(cluster + "/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["version"] == "1"


def test_queue_full_is_a_429_with_retry_after_through_the_proxy(cluster):
    """Each replica runs 8 and queues 8: 64 long requests at once overflow both, and the engines' 429s reach the
    client through the ingress and Ray's proxy, Retry-After included."""
    def one(i):
        return httpx.post(cluster + "/v1/completions", timeout=120, json={
            "model": NAME, "prompt": f"{i} burst", "max_tokens": 480, "temperature": 0, "ignore_eos": True})

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(one, range(64)))
    codes = Counter(r.status_code for r in answers)
    assert set(codes) == {200, 429}, codes
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 480
    print(f"\n64 at once: {codes[200]} served, {codes[429]} x 429")


def test_an_alias_flip_reaches_both_replicas_without_dropping_requests(cluster, versions, refs):
    from compress.registry import store as registry
    from flows.deploy import served_version
    from serve.replicas import lifecycle as replicas

    n, results, stop, done = 48, [], threading.Event(), threading.Condition()

    def traffic(worker: int):
        i = 0
        while not stop.is_set():
            prompt, started = f"flip {worker}.{i}", time.monotonic()
            r = httpx.post(cluster + "/v1/completions", timeout=60, json={
                "model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True})
            with done:
                results.append((worker, started, prompt, r.status_code, r.text))
                done.notify_all()
            i += 1

    def each_worker_finished_one_started_after(t: float) -> None:
        with done:
            assert done.wait_for(lambda: {w for w, started, *_ in results if started > t} == {0, 1, 2}, 120)

    threads = [threading.Thread(target=traffic, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    each_worker_finished_one_started_after(0.0)  # traffic on version 1 before the flip
    t0 = time.monotonic()
    registry.set_alias(NAME, "champion", versions["v2"])
    infos = replicas.wait_replicas(cluster, 2, timeout_s=60, version="2")
    print(f"\nalias moved -> both replicas on version 2 in {time.monotonic() - t0:.2f} s")
    assert all(r["swaps"] >= 1 for r in infos)
    each_worker_finished_one_started_after(time.monotonic())  # and on version 2 after it
    stop.set()
    for t in threads:
        t.join(60)
    served = Counter()
    for _, _, prompt, status, text in results:  # every request finished, on the model it started on
        assert status == 200, text
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        version = events[0]["system_fingerprint"].rsplit("-v", 1)[1]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected(refs, version, prompt, n)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        served[version] += 1
    assert served["1"] >= 1 and served["2"] >= 1, served
    assert served_version(cluster, NAME) == "2"  # what a deploy waits for: every replica on it
    out = client(cluster).completions.create(model=NAME, prompt="after the flip", max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert out.system_fingerprint == f"{NAME}-v2" and out.choices[0].text == expected(refs, "2", "after the flip", 8)
    registry.set_alias(NAME, "champion", versions["v1"])  # a rollback reaches both as well
    replicas.wait_replicas(cluster, 2, timeout_s=60, version="1")


def test_a_client_that_goes_away_cancels_its_request_on_the_replica(cluster):
    def cancelled() -> float:
        return metric_value(httpx.get(cluster + "/metrics", timeout=30).text, "vllm:request_success_total",
                            finished_reason="cancelled")

    before = cancelled()
    body = {"model": NAME, "prompt": "leave early", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", cluster + "/v1/completions", json=body, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
    assert json.loads(first[6:])["choices"]
    deadline = time.monotonic() + 20
    while cancelled() < before + 1:
        assert time.monotonic() < deadline, "the replica kept generating for a client that had gone"
        time.sleep(0.1)
    text = httpx.get(cluster + "/metrics", timeout=30).text
    assert metric_value(text, "vllm:num_requests_running") == 0


def test_a_killed_replica_is_replaced_and_no_request_hangs(cluster):
    """Streams on both replicas; one replica's process is frozen (so its streams are provably mid-run) and killed.
    Its streams end with an error event within seconds, the other's finish whole, Ray starts a replacement."""
    from serve.replicas import lifecycle as replicas

    before = {r["replica"]: r for r in replica_list(cluster)}
    n, streams, started = 400, {}, threading.Semaphore(0)

    def stream(i: int):
        rec = streams[i] = {"replica": None, "events": [], "error": None, "end": None}
        body = {"model": NAME, "prompt": f"kill {i}", "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", cluster + "/v1/completions", json=body, timeout=60) as r:
                rec["replica"] = r.headers.get(REPLICA_HEADER)
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        rec["events"].append(json.loads(line[6:]))
                        if len(rec["events"]) == 1:
                            started.release()
        except httpx.HTTPError as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        finally:
            rec["end"] = time.monotonic()
            if not rec["events"]:
                started.release()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60)
    on = Counter(rec["replica"] for rec in streams.values() if rec["end"] is None)
    victim = on.most_common(1)[0][0]
    pid = before[victim]["pid"]
    os.kill(pid, signal.SIGSTOP)  # frozen: its streams cannot finish before the kill
    time.sleep(0.5)
    mine = [rec for rec in streams.values() if rec["replica"] == victim and rec["end"] is None]
    assert mine
    # Requests with the frozen replica's prompts, which the router sends to it (the same routing key): they wait
    # there, unanswered, until the kill; each then goes again to the survivor (serve/replicas/deploy.Ingress._open).
    again = [i for i, rec in streams.items() if rec["replica"] == victim]
    body = {"model": NAME, "max_tokens": 4, "temperature": 0}
    pool = ThreadPoolExecutor(8)
    pending = [pool.submit(httpx.post, cluster + "/v1/completions", json={**body, "prompt": f"kill {i}"}, timeout=60)
               for i in again]
    time.sleep(1.0)
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    answers = [f.result() for f in pending]
    pool.shutdown()
    assert [r.status_code for r in answers] == [200] * len(again), [r.text[:200] for r in answers]
    assert {r.headers.get(REPLICA_HEADER) for r in answers} != {victim}
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a stream hung after its replica was killed"
    for rec in streams.values():
        done = any((e.get("usage") or {}).get("completion_tokens") == n for e in rec["events"]) and \
            any(c["finish_reason"] == "length" for e in rec["events"] for c in e.get("choices", []))
        if any(rec is m for m in mine):
            assert not done and rec["end"] - t_kill < 20, rec["end"] - t_kill
            assert rec["error"] or rec["events"][-1].get("error", {}).get("code") == "replica_failed", rec["events"][-1]
        else:
            assert done and not rec["error"], rec
    print(f"\nkilled replica {victim}: its {len(mine)} streams ended "
          f"{max(rec['end'] for rec in mine) - t_kill:.2f} s after the kill")
    # New requests go to the survivor meanwhile; Ray starts a replacement with a new id.
    assert chat(client(cluster), "still there?")[1] != victim
    t0 = time.monotonic()
    infos = replicas.wait_replicas(cluster, 2, timeout_s=120)
    assert victim not in {r["replica"] for r in infos}
    print(f"replacement ready {time.monotonic() - t0:.1f} s after the first request that followed")
    with ThreadPoolExecutor(8) as pool:
        after = list(pool.map(lambda i: chat(client(cluster), f"after {i}: which floor has the maps?"), range(8)))
    assert all(text for text, _ in after) and len({rid for _, rid in after}) == 2


def test_a_restarted_ingress_rebuilds_its_prefix_table_from_the_replicas(cluster):
    """The ingress's process is killed; Ray starts a new one, whose router asks the replicas which prefix chains they
    served. Conversations seen before the kill go to the same replica, routed by affinity, not as new prefixes."""
    c = client(cluster)
    systems = [f"Desk {k}: " + SYSTEM for k in range(4)]
    placed = {k: chat(c, "where are the atlases?", system=s_)[1] for k, s_ in enumerate(systems)}
    old = httpx.get(cluster + "/health", timeout=30).json()["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "no new ingress within 120 s"
        try:
            h = httpx.get(cluster + "/health", timeout=5)
            if h.status_code == 200 and h.json()["pid"] != old and h.json()["replicas"] == 2:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    router = {}
    while not router.get("restored"):  # the rebuild runs beside the first requests; wait for it here
        assert time.monotonic() < deadline, router
        router = httpx.get(cluster + "/replicas", timeout=30).json()["router"]
        time.sleep(0.2)
    again = {k: chat(c, "and the maps?", system=s_)[1] for k, s_ in enumerate(systems)}
    router = httpx.get(cluster + "/replicas", timeout=30).json()["router"]
    assert again == placed, (placed, again)
    assert router.get("affinity") == 4 and not router.get("new_prefix"), router
    text = httpx.get(cluster + "/metrics", timeout=30).text
    from serve.replicas.forwarding import forwarded

    mine = {h for s_ in systems for h in forwarded("POST", "/v1/chat/completions", b"", [], json.dumps(
        {"messages": [{"role": "system", "content": s_}, {"role": "user", "content": "where are the atlases?"}]}
    ).encode()).prefix_hashes}
    assert metric_value(text, "compressor:router_chains_restored_total") == router["restored"] >= len(mine) >= 4


# ---- the parts without Ray: routing key, block hashes, merged metrics ------------------------------------------
def test_routing_text_and_block_hashes():
    from serve.replicas.forwarding import PREFIX_BLOCK_CHARS, forwarded, prefix_hashes, routing_text

    chat_body = json.dumps({"messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}).encode()
    text = routing_text("/v1/chat/completions", chat_body)
    assert text == f"<system>{SYSTEM}\x1e<user>Hi\x1e"
    assert routing_text("/v1/completions", b'{"prompt": ["first", "second"]}') == "first"
    assert routing_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == "1 2 3"
    assert routing_text("/v1/completions", b"not json") is None and routing_text("/metrics", chat_body) is None
    a, _ = prefix_hashes(text)
    assert len(a) == len(text) // PREFIX_BLOCK_CHARS == 3
    x, _ = prefix_hashes(text[:128] + "x" * 70)
    y, _ = prefix_hashes(text[:128] + "y" * 70)
    assert x[:2] == y[:2] == a[:2] and x[2] != y[2] and len(x) == 3  # a chain: equal exactly as long as the text
    assert prefix_hashes("short")[0] == () and prefix_hashes("short")[1] == prefix_hashes("short")[1]
    fwd = forwarded("POST", "/v1/chat/completions", b"", [], chat_body)
    assert fwd.prefix_hashes == a and fwd.target is None
    assert forwarded("GET", "/v1/models", b"", [], b"").prefix_hashes == ()


def test_merged_metrics_sum_counters_average_ratios_and_keep_the_lowest_version():
    from serve.replicas.forwarding import merge_metrics

    def text(gen: int, kv: float, version: int) -> str:  # what prometheus_client writes
        return (f"# HELP vllm:generation_tokens_total Generated tokens.\n"
                f"# TYPE vllm:generation_tokens_total counter\n"
                f'vllm:generation_tokens_total{{model_name="m"}} {gen}\n'
                f"# HELP vllm:generation_tokens_created Generated tokens.\n"
                f"# TYPE vllm:generation_tokens_created gauge\n"
                f'vllm:generation_tokens_created{{model_name="m"}} 1.7e9\n'
                f"# HELP vllm:kv_cache_usage_perc KV in use.\n# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
                f"# HELP compressor:served_model_version v.\n# TYPE compressor:served_model_version gauge\n"
                f'compressor:served_model_version{{model_name="m"}} {version}\n'
                f"# HELP vllm:e2e s.\n# TYPE vllm:e2e histogram\n"
                f'vllm:e2e_bucket{{le="1.0"}} {gen // 10}\nvllm:e2e_bucket{{le="+Inf"}} {gen // 10}\n'
                f"vllm:e2e_count {gen // 10}\nvllm:e2e_sum 2.5\n")

    merged = merge_metrics([text(100, 0.2, 2), text(50, 0.6, 1)])
    assert metric_value(merged, "vllm:generation_tokens_total") == 150
    assert "_created" not in merged and "# TYPE vllm:generation_tokens_total counter" in merged
    assert metric_value(merged, "vllm:kv_cache_usage_perc") == pytest.approx(0.4)
    assert metric_value(merged, "compressor:served_model_version") == 1
    assert metric_value(merged, "vllm:e2e_bucket", le="+Inf") == 15 and metric_value(merged, "vllm:e2e_sum") == 5.0


def test_the_prefix_imbalance_defaults_to_a_quarter_of_a_batch():
    from serve.replicas.spec import ReplicaSpec, default_imbalance

    assert [default_imbalance(cfg(max_batch_size=b)) for b in (8, 32, 64, 256)] == [8, 8, 16, 64]


def test_one_replica_spec_resolves_every_default_and_refuses_bad_args_by_name():
    """The spec is built once, from the command line or a Serve config file's args: each replica's threads follow
    its CPUs, the imbalance follows the batch; what is wrong is named (serve.config.ConfigError)."""
    from serve.config import ConfigError
    from serve.replicas.spec import ReplicaSpec

    spec = ReplicaSpec.from_application_args({"model": "models:/m@champion", "replicas": 2, "replica_cpus": 3,
                                              "serve": {"max_batch_size": 64, "intra_op_threads": 0}})
    assert (spec.replicas, spec.replica_cpus, spec.serve_cfg.intra_op_threads, spec.imbalance) == (2, 3.0, 3, 16)
    assert spec.routing == "prefix" and spec.admin_token is None
    with pytest.raises(ConfigError, match=r"unknown \['replica'\]"):
        ReplicaSpec.from_application_args({"model": "m", "replica": 2})
    with pytest.raises(ConfigError, match="model is required"):
        ReplicaSpec.from_application_args({"replicas": 2})
    with pytest.raises(ConfigError, match="routing 'random': use one of"):
        ReplicaSpec.build("m", cfg(), replicas=1, routing="random")


def test_ray_is_imported_only_by_the_replica_entry_point():
    import subprocess
    import sys

    code = ("import sys, serve.__main__, serve.api.app, serve.replicas.forwarding; assert 'ray' not in sys.modules, 'ray'; "
            "import serve.replicas.spec; assert 'ray' not in sys.modules, 'ray (spec)'; "
            "import serve.replicas.deploy, serve.replicas.lifecycle; print(sorted(m for m in ('torch', 'transformers', 'compress') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"  # a replica process carries no torch
