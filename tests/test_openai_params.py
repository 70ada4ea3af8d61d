"""The OpenAI/vLLM request parameters (issue 16): each one is honoured (checked against an independent
reference: a numpy log-softmax of the ONNX model's logits run here without the engine, a hand-computed
penalty, the greedy output) or refused with a 400 naming it. Plus /tokenize, /detokenize, /version,
the chat role chunk sent with the first token, and vLLM's ``abort`` finish reason."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from serve.api.app import create_app
from serve.config import ServeConfig
from serve.runners.onnx_session import CPU
from served import http_on, on_socket
from serve.engine.sampling import (SamplingError, SamplingParams, apply_frequency_presence_penalties, process_logits,
                            sample_token, token_logprobs)

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"
EOS = 2  # the tiny artifact's eos_token_ids == [2] ("<|im_end|>")


@pytest.fixture(scope="module")
def server(tiny_artifact):
    app = create_app(str(tiny_artifact), ServeConfig(providers=[CPU], kv_memory_mb=8, max_batch_size=4,
                                                     result_cache_size=64), served_name=MODEL, admin_token=None)
    with on_socket(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with http_on(server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


# ---- the independent reference: the ONNX graph run here, whole sequence, no KV cache ----------------
@pytest.fixture(scope="module")
def onnx_ref(tiny_artifact):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tiny_artifact / "model.onnx"), providers=["CPUExecutionProvider"])

    def logits(ids) -> np.ndarray:
        """[len(ids), vocab] logits of the full sequence (empty past)."""
        n = len(ids)
        feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n, dtype=np.int64)[None]}
        for inp in sess.get_inputs()[3:]:
            feed[inp.name] = np.zeros((1, inp.shape[1], 0, inp.shape[3]), np.float32)
        return sess.run(["logits"], feed)[0][0].astype(np.float64)

    return logits


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def greedy_ref(onnx_ref, prompt, n, freq=0.0, pres=0.0, bias=None):
    """Greedy decoding by hand: logit - freq * count - presence * seen over the output, + bias."""
    ids, out = list(prompt), []
    for _ in range(n):
        lg = onnx_ref(ids)[-1].copy()
        for t, b in (bias or {}).items():
            lg[t] += b
        for t in set(out):
            lg[t] -= freq * out.count(t) + pres
        tok = int(np.argmax(lg))
        out.append(tok)
        ids.append(tok)
    return out


def tokenize(http, **body) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


PROMPT_IDS = [5, 77, 123, 9, 300, 41, 17, 250]


# ---- the sampler, by hand ------------------------------------------------------------------------
def test_frequency_and_presence_penalties_hand_computed():
    lg = np.array([1.0, 2.0, 3.0, 4.0, 0.5], np.float32)
    # prompt [0, 3], output [1, 1, 2]: only the output counts (OpenAI/vLLM rule)
    got = process_logits(lg, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [0, 3, 1, 1, 2],
                         prompt_len=2)
    np.testing.assert_allclose(got, [1.0, 2.0 - 2 * 0.5 - 0.25, 3.0 - 0.5 - 0.25, 4.0, 0.5], rtol=1e-6)
    np.testing.assert_allclose(apply_frequency_presence_penalties(lg, [4], -1.0, 0.0), [1, 2, 3, 4, 1.5])
    # repetition (prompt + output, HF rule) then frequency: token 3 (in the prompt) 4 / 2 = 2
    got = process_logits(lg, SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), [3, 1], prompt_len=1)
    np.testing.assert_allclose(got, [1.0, 2.0 / 2 - 1.0, 3.0, 2.0, 0.5], rtol=1e-6)


def test_logit_bias_min_tokens_and_min_p_hand_computed():
    lg = np.array([0.0, 1.0, 2.0, 3.0], np.float32)
    assert sample_token(lg, SamplingParams.greedy(logit_bias={0: 3.5}), None) == 0
    # min_tokens: stop id 3 is masked while fewer than 2 tokens were generated
    p = SamplingParams.greedy(min_tokens=2)
    assert sample_token(lg, p, None, [9, 9, 1], prompt_len=2, stop_ids=[3]) == 2
    assert sample_token(lg, p, None, [9, 9, 1, 2], prompt_len=2, stop_ids=[3]) == 3
    # min_p 0.35 keeps p >= 0.35 * 0.5: tokens 0 and 1 of [0.5, 0.3, 0.15, 0.05]
    probs = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    rng = np.random.default_rng(0)
    drawn = {sample_token(probs, SamplingParams(temperature=1.0, min_p=0.35), rng) for _ in range(400)}
    assert drawn == {0, 1}
    for bad in (dict(min_p=1.5), dict(presence_penalty=3), dict(logit_bias={1: 200}), dict(min_tokens=99),
                dict(logprobs=21)):
        with pytest.raises(SamplingError, match=next(iter(bad))):
            SamplingParams(max_tokens=16, **bad).validate()


def test_token_logprobs_is_the_log_softmax_and_its_top_k():
    lg = np.array([2.0, -1.0, 0.5, 2.0, 3.0])
    ref = log_softmax(lg)
    lp, top = token_logprobs(lg, 2, 3)
    assert lp == pytest.approx(ref[2])
    assert [t for t, _ in top] == [4, 0, 3]  # ties by id
    np.testing.assert_allclose([v for _, v in top], ref[[4, 0, 3]])


# ---- every parameter: honoured or refused (400 naming it) --------------------------------------------
REFUSED = [
    ("completions", {"n": 65}, "n"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    # constraints (tests/test_structured.py has what they do): what stays refused
    ("completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("completions", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("completions", {"structural_tag": {"a": 1}}, "structural_tag"),
    ("completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("completions", {"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ("completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("completions", {"bad_words": ["x"]}, "bad_words"),
    ("completions", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ("chat", {"n": 65}, "n"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),  # without tools
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"add_special_tokens": True}, "add_special_tokens"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
]


@pytest.mark.parametrize("route,extra,param", REFUSED, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(REFUSED)])
def test_unsupported_parameters_are_400_naming_them(http, route, extra, param):
    if route == "chat":
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
        r = http.post("/v1/chat/completions", json=body)
    else:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_harmless_values_of_unsupported_parameters_are_accepted(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "n": 1,
            "response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "logprobs": False}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def completion(http, **body) -> dict:
    body.setdefault("temperature", 0)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(http, **body) -> dict:
    body.setdefault("temperature", 0)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_logprobs_completions_match_the_onnx_log_softmax(http, onnx_ref, tiny_artifact):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_artifact / "tokenizer.json"))
    out = completion(http, prompt=PROMPT_IDS, max_tokens=6, logprobs=3, ignore_eos=True)
    lp = out["choices"][0]["logprobs"]
    ids = greedy_ref(onnx_ref, PROMPT_IDS, 6)
    ref = log_softmax(onnx_ref(PROMPT_IDS + ids))[len(PROMPT_IDS) - 1:-1]  # row i predicts output token i
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    np.testing.assert_allclose(lp["token_logprobs"], [ref[i, t] for i, t in enumerate(ids)], atol=1e-4)
    for i, top in enumerate(lp["top_logprobs"]):
        best = np.argsort(-ref[i], kind="stable")[:3]
        want = {tok.decode([int(t)], skip_special_tokens=False): ref[i, t] for t in best}
        assert set(want) <= set(top) and len(top) <= 4  # the top 3 and the chosen token
        np.testing.assert_allclose([top[k] for k in want], list(want.values()), atol=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    # sampled (seeded) tokens get the raw log-prob of the token that was drawn
    out = completion(http, prompt=PROMPT_IDS, max_tokens=4, logprobs=0, temperature=1.5, seed=3, ignore_eos=True)
    lp = out["choices"][0]["logprobs"]
    drawn = tokenize(http, prompt=out["choices"][0]["text"], add_special_tokens=False)
    assert len(lp["token_logprobs"]) == 4
    if len(drawn) == 4:  # the text re-tokenizes to the same ids (not guaranteed for arbitrary byte tokens)
        ref = log_softmax(onnx_ref(PROMPT_IDS + drawn))[len(PROMPT_IDS) - 1:-1]
        np.testing.assert_allclose(lp["token_logprobs"], [ref[i, t] for i, t in enumerate(drawn)], atol=1e-4)


def test_echo_logprobs_cover_the_prompt_as_the_onnx_log_softmax(http, onnx_ref, tiny_artifact):
    """echo + logprobs (what lm-eval's local-completions sends for loglikelihood): the prompt's tokens with
    the log-softmax of the previous position's logits (null for the first), then the generated ones; max_tokens 0
    gives the prompt alone; a prefix-cache hit is not taken (the same prompt twice gives the same figures);
    streamed, the echo chunk carries the prompt's log-probs."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_artifact / "tokenizer.json"))
    prompt = PROMPT_IDS * 3  # 24 tokens: full prefix-cache blocks on the second request
    ids = greedy_ref(onnx_ref, prompt, 3)
    ref = log_softmax(onnx_ref(prompt + ids))  # row i predicts token i + 1
    for _ in range(2):
        out = completion(http, prompt=prompt, max_tokens=3, logprobs=2, echo=True, ignore_eos=True)
        ch = out["choices"][0]
        lp = ch["logprobs"]
        seq = prompt + ids
        assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in seq]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:], [ref[i - 1, t] for i, t in enumerate(seq) if i],
                                   atol=1e-4)
        for i in range(1, len(seq)):
            best = np.argsort(-ref[i - 1], kind="stable")[:2]
            want = {tok.decode([int(t)], skip_special_tokens=False): ref[i - 1, t] for t in best}
            assert set(want) <= set(lp["top_logprobs"][i]) and len(lp["top_logprobs"][i]) <= 3
        assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
        assert ch["text"] == tok.decode(prompt, skip_special_tokens=True) + tok.decode(ids, skip_special_tokens=True)
        assert out["usage"]["completion_tokens"] == 3
    # max_tokens 0: the prompt's log-probs alone
    out = completion(http, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) and out["usage"]["completion_tokens"] == 0
    np.testing.assert_allclose(lp["token_logprobs"][1:], [ref[i - 1, t] for i, t in enumerate(prompt) if i],
                               atol=1e-4)
    assert out["choices"][0]["finish_reason"] == "length"
    # streamed: the echo chunk carries the prompt's log-probs, then one chunk per token
    body = dict(prompt=prompt, max_tokens=2, logprobs=1, echo=True, temperature=0, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    lps = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert len(lps[0]["tokens"]) == len(prompt) and len(lps) == 3
    np.testing.assert_allclose(lps[0]["token_logprobs"][1:], [ref[i - 1, t] for i, t in enumerate(prompt) if i],
                               atol=1e-4)
    np.testing.assert_allclose([lps[1]["token_logprobs"][0], lps[2]["token_logprobs"][0]],
                               [ref[len(prompt) - 1, ids[0]], ref[len(prompt), ids[1]]], atol=1e-4)
    assert lps[1]["text_offset"][0] == lps[0]["text_offset"][-1] + len(lps[0]["tokens"][-1])
    # max_tokens 0 without echo is refused
    r = http.post("/v1/completions", json=dict(prompt=prompt, max_tokens=0))
    assert r.status_code == 422 and r.json()["error"]["param"] == "max_tokens"


def test_logprobs_chat_match_the_onnx_log_softmax_streamed_and_not(http, client, onnx_ref):
    msgs = [{"role": "user", "content": "Say something."}]
    prompt = tokenize(http, messages=msgs)
    out = chat(http, messages=msgs, max_tokens=5, logprobs=True, top_logprobs=2, ignore_eos=True)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    content = out["choices"][0]["logprobs"]["content"]
    ids = greedy_ref(onnx_ref, prompt, 5)
    ref = log_softmax(onnx_ref(prompt + ids))[len(prompt) - 1:-1]
    np.testing.assert_allclose([c["logprob"] for c in content], [ref[i, t] for i, t in enumerate(ids)], atol=1e-4)
    for i, c in enumerate(content):
        assert len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode())
        np.testing.assert_allclose([t["logprob"] for t in c["top_logprobs"]], np.sort(ref[i])[::-1][:2], atol=1e-4)
    stream = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [c for ch in stream if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c["logprob"] for c in content], abs=1e-6)
    assert out["choices"][0]["message"]["content"] == "".join(ch.choices[0].delta.content or "" for ch in stream)


def test_penalties_and_logit_bias_match_a_hand_decoded_reference(http, onnx_ref, tiny_artifact):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_artifact / "tokenizer.json"))
    for freq, pres in ((1.5, 0.0), (0.0, 2.0), (-0.5, 0.7)):
        out = completion(http, prompt=PROMPT_IDS, max_tokens=8, frequency_penalty=freq, presence_penalty=pres,
                         ignore_eos=True, logprobs=0)
        want = greedy_ref(onnx_ref, PROMPT_IDS, 8, freq=freq, pres=pres)
        assert out["choices"][0]["logprobs"]["tokens"] == [tok.decode([t], skip_special_tokens=False)
                                                           for t in want], (freq, pres)
    assert greedy_ref(onnx_ref, PROMPT_IDS, 8, freq=1.5) != greedy_ref(onnx_ref, PROMPT_IDS, 8)  # it mattered
    out = completion(http, prompt=PROMPT_IDS, max_tokens=4, logit_bias={"300": 100}, ignore_eos=True)
    assert out["choices"][0]["text"] == http.post("/detokenize", json={"tokens": [300] * 4}).json()["prompt"]
    r = http.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"99999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_min_tokens_min_p_and_stop_options(http, onnx_ref):
    first = completion(http, prompt=PROMPT_IDS, max_tokens=6, ignore_eos=True)
    ids = greedy_ref(onnx_ref, PROMPT_IDS, 6)
    # the first greedy token as a stop id ends at once; with min_tokens=3 it cannot come before 3 tokens
    out = completion(http, prompt=PROMPT_IDS, max_tokens=6, stop_token_ids=[ids[0]])
    assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["finish_reason"] == "stop"
    out = completion(http, prompt=PROMPT_IDS, max_tokens=6, stop_token_ids=[ids[0]], min_tokens=3, logprobs=0)
    assert out["usage"]["completion_tokens"] >= 3
    lg = onnx_ref(PROMPT_IDS)[-1]
    lg[ids[0]] = -np.inf
    second = int(np.argmax(lg))  # what the masked first step must pick
    detok = lambda t: http.post("/detokenize", json={"tokens": [t]}).json()["prompt"]  # noqa: E731
    tokens = out["choices"][0]["logprobs"]["tokens"]
    assert tokens[0] == detok(second) and detok(ids[0]) not in tokens[:3]
    # min_p = 1 keeps only the top token: sampling at any temperature is the greedy output
    out = completion(http, prompt=PROMPT_IDS, max_tokens=6, ignore_eos=True, temperature=1.8, min_p=1.0, seed=5)
    assert out["choices"][0]["text"] == first["choices"][0]["text"]
    # stop strings: cut before the stop, or after it with include_stop_str_in_output
    text = first["choices"][0]["text"]
    stop = text[2:4]
    at = text.find(stop)
    assert completion(http, prompt=PROMPT_IDS, max_tokens=6, ignore_eos=True, stop=[stop])["choices"][0]["text"] \
        == text[:at]
    out = completion(http, prompt=PROMPT_IDS, max_tokens=6, ignore_eos=True, stop=[stop],
                     include_stop_str_in_output=True)
    assert out["choices"][0]["text"] == text[:at + len(stop)] and out["choices"][0]["finish_reason"] == "stop"


def test_skip_special_tokens_echo_truncation_and_null_max_tokens(http, tiny_artifact):
    eos_text = http.post("/detokenize", json={"tokens": [EOS]}).json()["prompt"]
    assert eos_text == "<|im_end|>"
    body = dict(prompt=PROMPT_IDS, max_tokens=3, ignore_eos=True, logit_bias={str(EOS): 100})
    assert completion(http, **body)["choices"][0]["text"] == ""
    assert completion(http, **body, skip_special_tokens=False)["choices"][0]["text"] == eos_text * 3
    # echo: the prompt text comes first
    plain = completion(http, prompt="Hello there", max_tokens=4)["choices"][0]["text"]
    assert completion(http, prompt="Hello there", max_tokens=4, echo=True)["choices"][0]["text"] == \
        "Hello there" + plain
    # truncate_prompt_tokens: the last k tokens
    out = completion(http, prompt=PROMPT_IDS, max_tokens=4, truncate_prompt_tokens=3)
    assert out["usage"]["prompt_tokens"] == 3
    assert out["choices"][0]["text"] == completion(http, prompt=PROMPT_IDS[-3:], max_tokens=4)["choices"][0]["text"]
    # max_tokens null: as long as the context allows
    out = completion(http, prompt=PROMPT_IDS, max_tokens=None, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["total_tokens"] == 512
    # add_special_tokens false: no BOS (this model takes none, so the ids are the same as the tokenizer's)
    assert tokenize(http, prompt="Hello", add_special_tokens=False) == tokenize(http, prompt="Hello")


def test_chat_template_options(http):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello wor"}]
    with_gen = tokenize(http, messages=msgs)
    without = tokenize(http, messages=msgs, add_generation_prompt=False)
    assert len(without) < len(with_gen)
    out = chat(http, messages=msgs, max_tokens=2, add_generation_prompt=False)
    assert out["usage"]["prompt_tokens"] == len(without)
    cont = tokenize(http, messages=msgs, add_generation_prompt=False, continue_final_message=True)
    assert http.post("/detokenize", json={"tokens": cont}).json()["prompt"].endswith("assistant\nHello wor")
    out = chat(http, messages=msgs, max_tokens=2, add_generation_prompt=False, continue_final_message=True)
    assert out["usage"]["prompt_tokens"] == len(cont)
    # chat_template_kwargs reach the template (this one uses none: same prompt)
    out = chat(http, messages=msgs, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    assert out["usage"]["prompt_tokens"] == len(with_gen)


# ---- n > 1 and lists of prompts --------------------------------------------------------------------
def test_n_samples_are_the_seeded_single_requests_and_stream_alike(http, client):
    body = dict(prompt="Once upon a time", max_tokens=6, temperature=1.2, seed=11, ignore_eos=True)
    out = completion(http, **body, n=3)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    singles = [completion(http, **{**body, "seed": 11 + j})["choices"][0]["text"] for j in range(3)]
    assert [c["text"] for c in out["choices"]] == singles
    assert len(set(singles)) > 1  # the samples differ
    assert out["usage"]["completion_tokens"] == 18
    assert out["usage"]["prompt_tokens"] == completion(http, **body)["usage"]["prompt_tokens"]
    texts = {}
    for ch in client.completions.create(model=MODEL, stream=True, n=3, **{k: v for k, v in body.items()
                                                                          if k != "ignore_eos"},
                                        extra_body={"ignore_eos": True}):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[j] for j in range(3)] == singles
    msgs = [{"role": "user", "content": "hi"}]
    out = chat(http, messages=msgs, max_tokens=5, temperature=1.0, seed=4, n=2, ignore_eos=True)
    assert [c["message"]["content"] for c in out["choices"]] == [
        chat(http, messages=msgs, max_tokens=5, temperature=1.0, seed=4 + j, ignore_eos=True)["choices"][0]
        ["message"]["content"] for j in range(2)]
    roles = {}
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=1.0, seed=4, n=2,
                                             stream=True):
        for c in ch.choices:
            roles.setdefault(c.index, c.delta.role)
    assert roles == {0: "assistant", 1: "assistant"}


def test_a_list_of_prompts_gives_one_choice_per_prompt_and_sample(http):
    ids_out = completion(http, prompt=[PROMPT_IDS, PROMPT_IDS[:4]], max_tokens=3)["choices"]
    assert [c["text"] for c in ids_out] == [completion(http, prompt=p, max_tokens=3)["choices"][0]["text"]
                                            for p in (PROMPT_IDS, PROMPT_IDS[:4])]
    prompts = ["Hello there", "Once upon", "The quick brown fox"]
    out = completion(http, prompt=prompts, max_tokens=5, n=2, logprobs=1)
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for i, p in enumerate(prompts):
        one = completion(http, prompt=p, max_tokens=5, logprobs=1)
        for j in range(2):
            c = out["choices"][2 * i + j]
            assert c["text"] == one["choices"][0]["text"]
            assert c["logprobs"]["token_logprobs"] == pytest.approx(one["choices"][0]["logprobs"]["token_logprobs"],
                                                                    abs=1e-5)
    lens = [completion(http, prompt=p, max_tokens=1)["usage"]["prompt_tokens"] for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(lens)
    echoed = completion(http, prompt=["ab", "cd"], max_tokens=2, echo=True)["choices"]
    assert echoed[0]["text"].startswith("ab") and echoed[1]["text"].startswith("cd")


# ---- endpoints ---------------------------------------------------------------------------------------
def test_tokenize_detokenize_version(http, tiny_artifact):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "The quick brown fox"})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    out = completion(http, prompt="The quick brown fox", max_tokens=1)
    assert out["usage"]["prompt_tokens"] == body["count"]  # the same BOS rule as completions
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "The quick brown fox"}
    strs = http.post("/tokenize", json={"prompt": "fox", "return_token_strs": True}).json()["token_strs"]
    assert isinstance(strs, list) and len(strs) >= 1
    msgs = [{"role": "user", "content": "Name a colour."}]
    assert len(tokenize(http, messages=msgs)) == chat(http, messages=msgs, max_tokens=1)["usage"]["prompt_tokens"]
    assert http.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
    assert http.post("/tokenize", json={}).status_code == 400
    r = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    v = http.get("/version").json()["version"]
    assert isinstance(v, str) and v


# ---- streams ---------------------------------------------------------------------------------------
def test_chat_role_chunk_comes_with_the_first_token(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first.get("content")
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])


def test_a_request_the_server_cancels_ends_with_abort(server, http):
    body = {"prompt": PROMPT_IDS, "max_tokens": 400, "ignore_eos": True, "stream": True}
    engine = server.app.state.manager.current.engine
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        engine.cancel(json.loads(first[6:])["id"])
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
