"""Structured outputs and tool calls (serve/engine/grammar.py, serve/api/structured.py, serve/api/tools.py).

The tiny model has random weights: left free, its text is never JSON. So every schema-valid answer below was
made so by the grammar, and every test that checks validity would fail without the constraint. Over a real
socket with the openai SDK: ``chat.completions.parse`` with pydantic models, ``tools`` with ``tool_choice``
(required, named, auto, none), streamed tool-call deltas, a ``tool`` message round trip, vLLM's
``structured_outputs`` and ``guided_*`` fields, and the 400s that name the field.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

from serve.api.app import create_app
from serve.api.tools import FORMATS, ToolStream, ToolUse, detect_format
from serve.engine.engine import Engine
from serve.engine.grammar import GrammarSpec
from serve.engine.sampling import SamplingError, SamplingParams
from served import http_on, on_socket, serve_cfg, tiny_chat_artifact

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"enum": ["x", "yy"]}, "c": {"type": "string", "maxLength": 8}},
          "required": ["a", "b", "c"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def valid(obj: dict, schema: dict) -> bool:
    """The few keywords the tests' schemas use, checked by hand (no validator dependency)."""
    if set(obj) != set(schema["required"]):
        return False
    for k, sub in schema["properties"].items():
        v = obj[k]
        if "enum" in sub and v not in sub["enum"]:
            return False
        if sub.get("type") == "integer" and not (isinstance(v, int) and sub["minimum"] <= v <= sub["maximum"]):
            return False
        if sub.get("type") == "string" and not (isinstance(v, str) and len(v) <= sub.get("maxLength", 1 << 30)):
            return False
    return True


# ---- the engine -----------------------------------------------------------------------------------
def run_engine(folder, specs, speculative="off", sampled=False, prompt="hello {\"a\": 12, \"b\": \"x\"} world"):
    eng = Engine(folder, serve_cfg(speculative=speculative, speculative_max_rows=4), start=False)
    hs = [eng.add_request(f"{prompt} {i}", SamplingParams(max_tokens=400, temperature=1.0 if sampled else 0.0,
                                                          seed=i, structured=s)) for i, s in enumerate(specs)]
    while eng.has_work():
        eng.step()
        eng.check_invariants()
    return [h.result() for h in hs], eng


def test_every_constrained_answer_is_schema_valid_and_free_rows_are_untouched(tiny_gqa):
    spec = GrammarSpec.json_schema(SCHEMA)
    outs, eng = run_engine(tiny_gqa, [spec, spec, None, spec], sampled=True)
    for o in (outs[0], outs[1], outs[3]):
        assert o.finish_reason == "stop" and valid(json.loads(o.text), SCHEMA), o.text
        assert not re.search(r"[ \n\r\t]{25,}", o.text)  # whitespace between two tokens is bounded (24)
    compact, _ = run_engine(tiny_gqa, [GrammarSpec.json_schema(SCHEMA, compact=True)], sampled=True)
    assert re.fullmatch(r'\{"a": \d+, "b": "(x|yy)", "c": ".*"\}', compact[0].text, flags=re.S), compact[0].text
    assert eng.grammars().compiles == 1  # one schema, compiled once for three requests
    free, _ = run_engine(tiny_gqa, [None], sampled=True)
    # the unconstrained row (seed 2) is the same text as when it runs alone, and it is not JSON
    alone, _ = run_engine(tiny_gqa, [None, None, None], sampled=True)
    assert outs[2].output_ids == alone[2].output_ids
    with pytest.raises(ValueError):
        json.loads(outs[2].text)


def test_choice_regex_and_grammar_kinds(tiny_gqa):
    specs = [GrammarSpec.choice(["yes", "no", "maybe"]), GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}"),
             GrammarSpec("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/\n')]
    outs, _ = run_engine(tiny_gqa, specs)
    assert outs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].text), outs[1].text
    assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", outs[2].text) or outs[2].finish_reason == "length"


def test_a_schema_that_cannot_finish_in_max_tokens_ends_with_length(tiny_gqa):
    eng = Engine(tiny_gqa, serve_cfg(), start=False)
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 50}}, "required": ["s"]}
    out = eng.add_request("x", SamplingParams.greedy(8, structured=GrammarSpec.json_schema(schema, compact=True)))
    eng.run_until_done()
    r = out.result()
    assert r.finish_reason == "length" and len(r.output_ids) == 8 and r.text.startswith('{"s": "')


@pytest.mark.parametrize("speculative", ["prompt_lookup"])
def test_drafts_on_constrained_rows_keep_greedy_text(tiny_gqa, speculative):
    """Prompt lookup proposes the prompt's own JSON; the grammar masks each drafted position under the state after
    the drafts before it, so greedy text is token for token what decoding without drafts gives."""
    specs = [GrammarSpec.json_schema(SCHEMA), GrammarSpec.json_schema({"type": "object"}), None]
    prompt = '{"a": 12, "b": "x", "c": "abc"} {"a": 12, "b": "x", "c": "abc"}'
    plain, _ = run_engine(tiny_gqa, specs, prompt=prompt)
    drafted, eng = run_engine(tiny_gqa, specs, speculative=speculative, prompt=prompt)
    assert [o.output_ids for o in drafted] == [o.output_ids for o in plain]
    assert eng.stats().spec_drafts > 0 and eng.stats().spec_accepted_tokens > 0


def test_mask_drafts_leaves_the_state_and_refuses_a_forbidden_draft(tiny_gqa):
    eng = Engine(tiny_gqa, serve_cfg(), start=False)
    tok = eng.tokenizer
    g = eng.grammars().matcher(GrammarSpec.choice(["yes", "no"]))
    vocab = eng.runner.vocab_size
    before = g.allowed().copy()
    yes = tok.encode("yes", add_special_tokens=False).ids
    bad = tok.encode("z", add_special_tokens=False).ids[0]
    masked = g.mask_drafts(np.zeros((3, vocab), np.float32), [yes[0], bad])
    assert np.array_equal(g.allowed(), before)  # the state is where it was
    assert np.isfinite(masked[0, yes[0]]) and not np.isfinite(masked[1, bad])  # the bad draft can never stand


def test_greedy_choose_is_the_masked_argmax_with_or_without_the_mask(tiny_gqa):
    """choose() checks the model's own argmax before paying for a mask; on 200 random rows (some argmaxes allowed,
    most refused) it picks what the argmax of the masked logits picks."""
    eng = Engine(tiny_gqa, serve_cfg(), start=False)
    g = eng.grammars().matcher(GrammarSpec.json_schema(SCHEMA))
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(200):
        lg = rng.normal(size=eng.runner.vocab_size).astype(np.float32)
        allowed = np.flatnonzero(g.allowed())
        if rng.random() < 0.5:  # half the rows: make an allowed token the model's own argmax
            lg[rng.choice(allowed)] = 50.0
        want = int(np.argmax(g.mask(lg)))
        got = g.choose(lg, lambda x: int(np.argmax(x)), greedy=True)
        hits += int(np.argmax(lg)) == got
        assert got == want
        if g.finished:
            break
        assert g.accept(got)
    assert hits > 0  # the unmasked path was taken


def test_sampled_choose_without_truncation_draws_from_the_masked_distribution(tiny_gqa):
    """Draw from p, keep an allowed token, else draw from the masked p: 20,000 draws in one grammar state follow
    p(t) / A over the allowed tokens (A: their mass), as drawing from the masked logits does."""
    from serve.engine.sampling import draw, token_distribution

    eng = Engine(tiny_gqa, serve_cfg(), start=False)
    g = eng.grammars().matcher(GrammarSpec.choice(["ab", "b", "c", "dd"]))
    params = SamplingParams(temperature=1.0)
    vocab = eng.runner.vocab_size
    allowed = np.flatnonzero(g.allowed())
    lg = np.zeros(vocab, np.float32)
    lg[allowed] = np.log([0.1, 0.05, 0.02, 0.03][:len(allowed)] + [0.01] * max(0, len(allowed) - 4))
    lg[np.setdiff1d(np.arange(vocab), allowed)[:40]] = 2.0  # the grammar refuses most of the mass
    p = np.exp(lg - lg.max())
    p /= p.sum()
    want = p[allowed] / p[allowed].sum()
    rng = np.random.default_rng(0)
    n = 20000
    got = np.bincount([g.choose(lg, lambda x: draw(*token_distribution(x, params), rng), False, True)
                       for _ in range(n)], minlength=vocab)
    assert got[np.setdiff1d(np.arange(vocab), allowed)].sum() == 0
    assert np.abs(got[allowed] / n - want).max() < 0.01, (got[allowed] / n, want)


def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(tiny_gqa):
    eng = Engine(tiny_gqa, serve_cfg(), start=False)
    with pytest.raises(SamplingError) as e:
        eng.add_request("x", SamplingParams(structured=GrammarSpec("regex", "[a-", "guided_regex")))
    assert e.value.field == "guided_regex" and "does not compile" in str(e.value)


# ---- tool formats -----------------------------------------------------------------------------------
def test_tool_formats_parse_what_their_grammar_forces():
    use = ToolUse(FORMATS["hermes"], [WEATHER, TIME])
    content, calls = use.split('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
                               '</tool_call>')
    assert content == "Let me look." and calls[0]["function"]["name"] == "get_time"
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    assert use.split('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>')[1] == []  # not offered
    assert use.split("<tool_call>\n{broken\n</tool_call>")[1] == []
    # a whole answer that is one call without markers: bare, fenced, or in a template's doubled braces
    for bare in ('{"name": "get_time", "arguments": {"zone": "CET"}}', '```json\n{"name": "get_time", '
                 '"arguments": {"zone": "CET"}}\n```', '{{"name": "get_time", "arguments": {"zone": "CET"}}}'):
        assert use.split(bare)[0] is None and use.split(bare)[1][0]["function"]["name"] == "get_time", bare
    assert use.split('It is {"name": "get_time", "arguments": {}}')[1] == []  # a mention, not a call
    llama = ToolUse(FORMATS["llama3_json"], [WEATHER])
    assert llama.split('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}')[1]
    assert llama.split("The weather is fine.") == ("The weather is fine.", [])
    mistral = ToolUse(FORMATS["mistral"], [TIME])
    assert mistral.split('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]')[1]
    assert detect_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect_format("<|python_tag|>{{ tools }}").name == "llama3_json"
    assert detect_format("<tool_call>{{ tools }}").name == "hermes"
    assert detect_format(None).name == "hermes" and detect_format("x", "mistral").name == "mistral"


def test_tool_stream_sends_text_before_the_call_and_holds_the_call():
    s = ToolStream(ToolUse(FORMATS["hermes"], [TIME]))
    sent = [s.feed(d) for d in ["Sure", ". <tool", "_call>\n{\"name\": \"get_time\", ",
                                "\"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>"]]
    assert "".join(sent) == "Sure. " and sent[1] == ". "  # "<tool" held: it may open a call
    rest, calls = s.finish()
    assert rest == "" and calls[0]["function"]["name"] == "get_time"
    plain = ToolStream(ToolUse(FORMATS["hermes"], [TIME]))
    assert plain.feed("a <b") == "a <b" and plain.finish() == ("", [])
    bare = ToolStream(ToolUse(FORMATS["hermes"], [TIME]))  # may be one bare call: nothing goes out as text
    assert bare.feed(' {"name": "get_time", ') == "" and bare.feed('"arguments": {"zone": "UTC"}}') == ""
    assert bare.finish()[1][0]["function"]["name"] == "get_time"
    json_text = ToolStream(ToolUse(FORMATS["hermes"], [TIME]))  # JSON that is no call: sent whole at the end
    assert json_text.feed('{"a": 1}') == "" and json_text.finish() == ('{"a": 1}', [])


# ---- over the socket, with the openai SDK --------------------------------------------------------
@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    return tiny_chat_artifact(tmp_path_factory)


@pytest.fixture(scope="module")
def server(long_tiny):
    app = create_app(str(long_tiny), serve_cfg(max_batch_size=4, result_cache_size=64), served_name=MODEL,
                     admin_token=None)
    with on_socket(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
        yield c


class Reading(BaseModel):
    sensor: Literal["t1", "t2", "t3"]
    value: int = Field(ge=0, le=99)
    ok: bool


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_parse_with_a_pydantic_model_returns_a_parsed_object(client):
    for q in ["Read the sensor.", "Which sensor is hot?", "Report t2."]:
        r = client.chat.completions.parse(model=MODEL, messages=chat(q), response_format=Reading, max_tokens=400)
        got = r.choices[0].message.parsed
        assert isinstance(got, Reading) and r.choices[0].finish_reason == "stop", r.choices[0].message.content


def test_json_object_and_schema_on_completions_too(client):
    r = client.chat.completions.create(model=MODEL, messages=chat("JSON please"), max_tokens=400, seed=3,
                                       temperature=1.0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict), text
    c = client.completions.create(model=MODEL, prompt="data:", max_tokens=400, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "s", "schema": SCHEMA}}})
    assert valid(json.loads(c.choices[0].text), SCHEMA)


def test_vllm_structured_outputs_and_guided_fields(client):
    r = client.completions.create(model=MODEL, prompt="pick:", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert r.choices[0].text in ("red", "green")
    r = client.completions.create(model=MODEL, prompt="code:", max_tokens=10, temperature=0,
                                  extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=chat("j"), max_tokens=400, temperature=0,
                                       extra_body={"guided_json": SCHEMA})
    assert valid(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="j", max_tokens=100, temperature=0, extra_body={
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert re.fullmatch(r'\{"a": \d+, "b": "(x|yy)", "c": ".*"\}', r.choices[0].text, flags=re.S), r.choices[0].text


def test_required_tool_call_validates_streamed_and_not(client):
    for stream in (False, True):
        kw = dict(model=MODEL, messages=chat("Weather in Paris?"), tools=[WEATHER, TIME], tool_choice="required",
                  max_tokens=80, temperature=0)
        if not stream:
            r = client.chat.completions.create(**kw)
            msg, finish = r.choices[0].message, r.choices[0].finish_reason
            calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls]
        else:
            deltas, finish = [], None
            for ch in client.chat.completions.create(**kw, stream=True):
                if ch.choices:
                    d = ch.choices[0].delta
                    deltas += d.tool_calls or []
                    finish = ch.choices[0].finish_reason or finish
            calls = [(d.function.name, d.function.arguments) for d in deltas]
            assert all(d.id and d.type == "function" for d in deltas)
        assert finish == "tool_calls" and len(calls) == 1
        name, args = calls[0]
        schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
        assert valid(json.loads(args), schema), args


def test_named_tool_choice_forces_that_tool(client):
    r = client.chat.completions.create(model=MODEL, messages=chat("time?"), tools=[WEATHER, TIME], max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_auto_and_none_answer_in_text_and_a_tool_message_continues(client):
    """The random model never writes a call by itself: ``auto`` answers in text (no tool_calls, finish not
    tool_calls); then a conversation with an assistant call and the tool's result renders and continues."""
    r = client.chat.completions.create(model=MODEL, messages=chat("hi"), tools=[WEATHER], tool_choice="auto",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    first = client.chat.completions.create(model=MODEL, messages=chat("Weather in Oslo?"), tools=[WEATHER],
                                           tool_choice="required", max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    convo = chat("Weather in Oslo?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}]
    r = client.chat.completions.create(model=MODEL, messages=convo, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens > first.usage.prompt_tokens
    none = client.chat.completions.create(model=MODEL, messages=chat("hi"), tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None
    # tools render into the prompt (the tiny template knows none: a system message), "none" leaves them out
    assert none.usage.prompt_tokens < r.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "n": 2}, "n"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    with http_on(server) as h:
        r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("x"), "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tools_on_completions_are_refused(server):
    with http_on(server) as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
