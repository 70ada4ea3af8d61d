"""The HTTP server over a real socket on the tiny artifact: the official openai client, SSE streaming,
result cache, metrics, backpressure (429), bad input (4xx naming the field), disconnects, admin."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from serve.__main__ import main
from serve.api.app import create_app
from serve.api.background import BackgroundServer
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.runners.onnx_session import CPU
from step_gate import held_steps, seen_cancels
from served import on_socket, serve_cfg

pytestmark = pytest.mark.timeout(120)

TOKEN = "t0ken-for-tests"
MODEL = "tiny-chat"  # served under its own name, not the folder's
VLLM_NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
              "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:e2e_request_latency_seconds_bucket", "vllm:num_preemptions_total"]


cfg = serve_cfg


@pytest.fixture(scope="module")
def server(tiny_artifact):
    app = create_app(str(tiny_artifact), cfg(max_batch_size=4, result_cache_size=64), served_name=MODEL,
                     admin_token=TOKEN)
    with on_socket(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def ref(tiny_artifact):
    """The engine alone (no HTTP): what the server must reproduce."""
    eng = Engine(tiny_artifact, cfg(), start=False)
    yield eng
    eng.shutdown()


def engine_output(ref: Engine, prompt, params: SamplingParams):
    return ref.add_request(prompt, params).result(timeout=60)


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (labels: a substring of the label set)."""
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and labels in (m.group(1) or ""):
            return float(m.group(2))
    raise AssertionError(f"{name} {labels} not in /metrics")


def engine_of_steps(http) -> float:
    return metric(http.get("/metrics").text, "compressor:engine_steps_total")


def engine_of(server):
    return server.app.state.manager.current.engine


def wait_for(cond, timeout=60.0, what="condition"):
    """Poll ``cond``; the timeout only matters if something hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# ---- the basics --------------------------------------------------------------------------------
def test_health_ready_and_models(http, tiny_artifact):
    assert http.get("/health").json() == {"status": "ok"}
    r = http.get("/ready")
    assert r.status_code == 200 and r.json()["model"] == MODEL
    data = http.get("/v1/models").json()["data"]
    assert len(data) == 1
    m = data[0]
    assert (m["id"], m["object"], m["owned_by"], m["version"]) == (MODEL, "model", "compressor", None)
    assert m["max_model_len"] == 512
    assert http.get(f"/v1/models/{MODEL}").json() == m
    assert http.get("/v1/models/other").status_code == 404


def test_completion_equals_engine_greedy(client, ref, tiny_artifact):
    prompt = "The quick brown fox"
    out = engine_output(ref, prompt, SamplingParams.greedy(12))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == out.text and out.text
    assert r.choices[0].finish_reason == out.finish_reason == "length"
    assert r.usage.prompt_tokens == len(out.prompt_ids) == len(ref.encode(prompt))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == len(out.prompt_ids) + 12
    # Token ids as the prompt give the same answer.
    r2 = client.completions.create(model=MODEL, prompt=out.prompt_ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == out.text


def test_chat_uses_the_artifacts_template(client, ref, tiny_artifact):
    from jinja2 import Template

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    rendered = Template(ref.manifest["chat_template"]).render(messages=messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = ref.tokenizer.encode(rendered, add_special_tokens=False).ids
    out = engine_output(ref, ids, SamplingParams.greedy(10))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == out.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(out.output_ids))


def test_streaming_completion_and_chat(client, ref, tiny_artifact):
    prompt = "Once upon a time"
    out = engine_output(ref, prompt, SamplingParams.greedy(20))
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(out.prompt_ids)

    msgs = [{"role": "user", "content": "Tell a story."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=15, seed=7,
                                          temperature=0.9)
    streamed = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=15, seed=7,
                                                   temperature=0.9, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in streamed)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_sse_wire_format_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "stream": True,
                                                              "ignore_eos": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_match_their_solo_outputs(server, ref):
    prompts = ["alpha beta", "gamma delta epsilon", "zeta", "eta theta iota kappa lambda"]
    want = [engine_output(ref, p, SamplingParams.greedy(16 + 4 * i, ignore_eos=True)).text
            for i, p in enumerate(prompts)]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            rs = await asyncio.gather(*[
                c.post("/v1/completions", json={"prompt": p, "max_tokens": 16 + 4 * i, "temperature": 0,
                                                "ignore_eos": True}) for i, p in enumerate(prompts)])
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(run()) == want


# ---- result cache ------------------------------------------------------------------------------
def test_repeated_deterministic_request_is_served_from_the_cache(http):
    def hits():
        return metric(http.get("/metrics").text, "compressor:result_cache_hits_total")

    body = {"prompt": "cache me if you can", "max_tokens": 9, "temperature": 0}
    h0 = hits()
    r1 = http.post("/v1/completions", json=body)
    assert r1.headers["x-result-cache"] == "miss" and hits() == h0
    steps = engine_of_steps(http)
    r2 = http.post("/v1/completions", json=body)
    assert r2.headers["x-result-cache"] == "hit" and hits() == h0 + 1
    assert r2.json()["choices"] == r1.json()["choices"] and r2.json()["usage"] == r1.json()["usage"]
    assert engine_of_steps(http) == steps  # the model did not run
    # A streamed repeat is answered from the cache too, with the same text.
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.headers["x-result-cache"] == "hit"
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {"))
    assert text == r1.json()["choices"][0]["text"] and hits() == h0 + 2
    # A sampled request without a seed is never cached; one with a seed is.
    r3 = http.post("/v1/completions", json={**body, "temperature": 0.8})
    assert r3.headers["x-result-cache"] == "off"
    s1 = http.post("/v1/completions", json={**body, "temperature": 0.8, "seed": 11})
    s2 = http.post("/v1/completions", json={**body, "temperature": 0.8, "seed": 11})
    assert (s1.headers["x-result-cache"], s2.headers["x-result-cache"]) == ("miss", "hit")
    assert s1.json()["choices"][0]["text"] == s2.json()["choices"][0]["text"]
    # Any sampling field changes the key.
    r4 = http.post("/v1/completions", json={**body, "max_tokens": 8})
    assert r4.headers["x-result-cache"] == "miss"


# ---- bad input ---------------------------------------------------------------------------------
def test_context_overflow_is_400_naming_the_limit(http, client, tiny_artifact):
    r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 600})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "context of 512 tokens" in err["message"] and "600" in err["message"]
    with pytest.raises(openai.BadRequestError, match="512"):
        client.completions.create(model=MODEL, prompt="x " * 300, max_tokens=300)


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "hi", "temperature": "hot"}, 422, "temperature"),
    ({"prompt": "hi", "temperature": 3}, 422, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, 422, "max_tokens"),
    ({"prompt": "hi", "top_p": 0}, 422, "top_p"),
    ({"prompt": "hi", "n": 0}, 422, "n"),
    ({"prompt": "hi", "stop": 5}, 422, "stop"),
    ({"max_tokens": 4}, 422, "prompt"),
    ({"prompt": ["a", ""]}, 422, "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
])
def test_bad_fields_are_named(http, body, status, param):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_bad_chat_and_malformed_bodies(http):
    r = http.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages"
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages.0.role"
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http.post("/v1/completions", content=b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    big = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    r = http.post("/v1/completions", content=big)
    assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]["message"]
    assert http.get("/v1/nothing").status_code == 404


# ---- disconnects, metrics ------------------------------------------------------------------------
def test_disconnect_mid_stream_cancels_and_frees_blocks(server, http):
    eng = engine_of(server)
    cancelled0 = eng.stats().finish_reasons.get("cancelled", 0)
    # The second step is held until the server has seen the client go: else the rest of the 480 tokens
    # (0.15 s on a quiet machine) may be generated before the disconnect is noticed ("length", not
    # "cancelled"). Greedy, and a prompt whose first token has text of its own, so the first event is
    # sent by the first step (a token that is a partial UTF-8 character sends nothing yet).
    with held_steps(eng, after=1) as hold, seen_cancels(eng) as cancels:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={
                    "prompt": "a long story, told slowly", "max_tokens": 480, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                hold.wait_held()
                st = eng.stats()
                assert st.num_running == 1 and st.kv_blocks_used > 0
            # leaving the block closes the connection mid-stream
        cancels.wait(1)  # the server noticed while the request was still running
    wait_for(lambda: eng.stats().num_running == 0 and eng.stats().kv_blocks_used == 0, what="blocks freed")
    st = eng.stats()
    assert st.finish_reasons.get("cancelled", 0) == cancelled0 + 1  # cancelled, not run to the end
    assert st.kv_blocks_free == st.kv_blocks_total
    text = http.get("/metrics").text
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(text, "vllm:num_requests_running") == 0.0
    # the high-water mark remembers the stream's blocks after they were freed
    assert metric(text, "compressor:kv_cache_usage_peak_perc") >= st.kv_usage_peak_pct / 100 > 0


def test_disconnect_while_waiting_for_a_whole_completion_cancels_it(server):
    eng = engine_of(server)
    cancelled0 = eng.stats().finish_reasons.get("cancelled", 0)
    body = {"prompt": "no stream, no patience", "max_tokens": 480, "ignore_eos": True}

    async def impatient_client():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            post = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.to_thread(hold.wait_held)  # the request is in the engine, its first step held
            # The client waits 0.15 s for an answer (its read timeout): none can come while the step is
            # held. A real read timeout could also fire before the server has even read the body.
            finished, _ = await asyncio.wait({post}, timeout=0.15)
            assert not finished, "the server answered a request whose steps were held"
            post.cancel()  # the client gives up: httpx closes the connection
            with pytest.raises(asyncio.CancelledError):
                await post

    with held_steps(eng) as hold, seen_cancels(eng) as cancels:
        asyncio.run(impatient_client())
        cancels.wait(1)  # the server noticed the disconnect while the request was still running
    wait_for(lambda: eng.stats().finish_reasons.get("cancelled", 0) == cancelled0 + 1, what="the cancel")
    wait_for(lambda: eng.stats().num_running == 0, what="the request to end")
    assert eng.stats().num_running == 0 and eng.stats().kv_blocks_used == 0


def test_metrics_have_vllm_names_and_real_numbers(http):
    http.post("/v1/completions", json={"prompt": "metrics please", "max_tokens": 6, "temperature": 0.5})
    text = http.get("/metrics").text
    for name in VLLM_NAMES:
        assert re.search(rf"^{re.escape(name)}[{{ ]", text, re.M), name
    assert metric(text, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric(text, "vllm:inter_token_latency_seconds_count") >= 5
    assert metric(text, "vllm:e2e_request_latency_seconds_count") >= 1
    assert metric(text, "vllm:generation_tokens_total") >= 6
    assert 0 < metric(text, "compressor:batch_fill_ratio") <= 1
    assert metric(text, "compressor:served_model_info") == 1
    assert metric(text, "compressor:http_requests_total", 'endpoint="/v1/completions",status="200"') >= 1


def test_per_request_phase_and_token_histograms(http):
    """vLLM v1's per-finished-request histograms: one observation per request, token sums as usage reports."""
    hists = ["vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
             "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
             "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:e2e_request_latency_seconds"]

    def idle():
        t = http.get("/metrics").text
        return metric(t, "vllm:num_requests_running") + metric(t, "vllm:num_requests_waiting") == 0

    def read():
        t = http.get("/metrics").text
        return {(h, k): metric(t, f"{h}_{k}") for h in hists for k in ("count", "sum")}

    wait_for(idle, what="earlier requests to finish")
    before = read()
    prompts = [("phase histograms " * (i + 1)).strip() for i in range(3)]
    usages = []
    for i, p in enumerate(prompts):
        r = http.post("/v1/completions", json={"prompt": p, "max_tokens": 3 + 2 * i, "temperature": 0,
                                               "ignore_eos": True})
        assert r.status_code == 200 and r.headers["x-result-cache"] == "miss"
        usages.append(r.json()["usage"])
    after = read()
    d = {k: after[k] - before[k] for k in after}
    for h in hists:
        assert d[(h, "count")] == len(prompts), h
    assert d[("vllm:request_prompt_tokens", "sum")] == sum(u["prompt_tokens"] for u in usages)
    assert d[("vllm:request_generation_tokens", "sum")] == sum(u["completion_tokens"] for u in usages) == 3 + 5 + 7
    phases = [d[(f"vllm:request_{p}_time_seconds", "sum")] for p in ("queue", "prefill", "decode")]
    assert all(x >= 0 for x in phases) and d[("vllm:request_inference_time_seconds", "sum")] >= 0
    assert sum(phases) <= d[("vllm:e2e_request_latency_seconds", "sum")] + 1e-6


# ---- admin ---------------------------------------------------------------------------------------
def test_admin_reload_needs_the_token(http):
    assert http.post("/admin/reload").status_code == 401
    assert http.post("/admin/reload", headers={"Authorization": "Bearer wrong"}).status_code == 401
    body = {"prompt": "admin cache", "max_tokens": 4, "temperature": 0}
    http.post("/v1/completions", json=body)
    fp0 = http.post("/v1/completions", json=body).json()["system_fingerprint"]
    r = http.post("/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"}, json={"force": True})
    assert r.status_code == 200 and r.json()["changed"] is True
    after = http.post("/v1/completions", json=body)
    assert after.json()["system_fingerprint"] != fp0  # a new engine generation serves it
    assert after.headers["x-result-cache"] == "miss"  # the reload emptied the cache
    r = http.post("/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"}, json={"force": "maybe"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "force"


# ---- backpressure (its own small server) ---------------------------------------------------------
def test_full_queue_gives_429_and_admin_is_off_without_token(tiny_artifact):
    app = create_app(str(tiny_artifact), cfg(max_batch_size=1, max_waiting=1, max_wait_s=3.0), admin_token=None)
    long = {"prompt": "hold the line", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/admin/reload", headers={"Authorization": "Bearer x"}).status_code == 404
        eng = srv.app.state.manager.current.engine
        # The running request must not finish before the third one arrives; and the second is sent only
        # once the first has left the waiting queue for its (held) first step, else it finds the queue
        # full too (a 429 for the second, not the third, on a loaded machine).
        with held_steps(eng) as hold, c.stream("POST", "/v1/completions", json=long) as a:
            assert a.status_code == 200
            hold.wait_held()
            with c.stream("POST", "/v1/completions", json={**long, "prompt": "second"}) as b:
                assert b.status_code == 200
                wait_for(lambda: (eng.stats().num_running, eng.stats().num_waiting) == (1, 1),
                         what="1 running, 1 waiting")
                r = c.post("/v1/completions", json={"prompt": "third", "max_tokens": 4})
                assert r.status_code == 429
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "queue_full"
        wait_for(lambda: eng.stats().num_running == 0 and eng.stats().num_waiting == 0, what="queue drained")
        assert eng.stats().kv_blocks_used == 0
        assert c.post("/v1/completions", json={"prompt": "third", "max_tokens": 4}).status_code == 200


def test_cli_reports_a_bad_model_clearly(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["--model", "models:/only-a-name"]) == 2
    assert "models:/NAME@ALIAS" in capsys.readouterr().err


def test_chat_without_max_tokens_stops_within_the_context(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
                                                "temperature": 0})
    assert r.status_code == 200
    u = r.json()["usage"]
    assert u["total_tokens"] <= 512 and u["completion_tokens"] >= 1
    if r.json()["choices"][0]["finish_reason"] == "length":
        assert u["total_tokens"] == 512  # it ran to the end of the context, not to some smaller default


def test_python_m_serve_starts_serves_and_stops(tiny_artifact):
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "COMPRESSOR_ADMIN_TOKEN": ""}
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--model", str(tiny_artifact), "--port", str(port),
                             "--set", f"serve.providers=[{CPU}]", "--set", "serve.kv_memory_mb=8",
                             "--log-level", "info"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read().decode()
                return False

        wait_for(ready, timeout=60, what="python -m serve to be ready")
        r = httpx.post(url + "/v1/completions", json={"prompt": "cli", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.post(url + "/admin/reload", timeout=30).status_code == 404  # empty token = admin off
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught: -15 is a clean exit here.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in proc.stdout.read().decode()

