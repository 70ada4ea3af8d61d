"""Result cache: which requests are cached, what the key covers, LRU bound, clearing."""

from __future__ import annotations

import dataclasses

import pytest

from serve.api.result_cache import CachedResult, ResultCache, cache_key, is_deterministic
from serve.engine.grammar import GrammarSpec
from serve.engine.sampling import SamplingParams


def res(text="abc", ids=(5, 6, 7), finish="length", prompt_tokens=3) -> CachedResult:
    return CachedResult(text, tuple(ids), finish, prompt_tokens)


def test_only_deterministic_requests_have_a_key():
    assert is_deterministic(SamplingParams.greedy(8))
    assert is_deterministic(SamplingParams(temperature=0.7, top_k=1))  # top_k 1 is greedy
    assert is_deterministic(SamplingParams(temperature=0.7, seed=3))
    assert not is_deterministic(SamplingParams(temperature=0.7))
    assert cache_key("m:1:1", [1, 2], SamplingParams(temperature=0.7)) is None
    assert cache_key("m:1:1", [1, 2], SamplingParams.greedy(8)) is not None


def test_key_covers_model_prompt_and_every_sampling_field():
    base = SamplingParams(max_tokens=8, temperature=0.0, seed=None, stop=["x"], stop_token_ids=[9])
    k = cache_key("m:1:1", [1, 2, 3], base)
    assert k == cache_key("m:1:1", [1, 2, 3], dataclasses.replace(base, stop=["x"]))  # equal values, equal key
    assert k == cache_key("m:1:1", (1, 2, 3), dataclasses.replace(base, temperature=0))  # 0 and 0.0 are one request
    assert k != cache_key("m:2:2", [1, 2, 3], base)
    assert k != cache_key("m:1:1", [1, 2, 4], base)
    changed = {"max_tokens": 9, "top_k": 5, "top_p": 0.5, "seed": 1, "repetition_penalty": 1.2, "stop": ["y"],
               "stop_token_ids": [8], "ignore_eos": True, "min_tokens": 2, "min_p": 0.1, "presence_penalty": 0.5,
               "frequency_penalty": 0.5, "logit_bias": {3: 1.0}, "include_stop_str_in_output": True,
               "skip_special_tokens": False, "logprobs": 2, "prompt_logprobs": 1,
               "structured": GrammarSpec.choice(["a", "b"])}
    # Every field of SamplingParams must change the key; a new field without a case here fails this test.
    assert set(changed) | {"temperature"} == {f.name for f in dataclasses.fields(SamplingParams)}
    for name, value in changed.items():
        assert cache_key("m:1:1", [1, 2, 3], dataclasses.replace(base, **{name: value})) != k, name


def test_hits_misses_and_lru_bound():
    cache = ResultCache(2)
    keys = [cache_key("m", [i], SamplingParams.greedy(4)) for i in range(3)]
    assert cache.get(keys[0]) is None and cache.misses == 1
    for i, k in enumerate(keys[:2]):
        assert cache.put(k, res(text=str(i)))
    assert cache.get(keys[0]).text == "0"  # now keys[1] is the least recently used
    cache.put(keys[2], res(text="2"))
    assert len(cache) == 2 and cache.evictions == 1
    assert cache.get(keys[1]) is None
    assert cache.get(keys[0]).text == "0" and cache.get(keys[2]).text == "2"
    assert (cache.hits, cache.misses) == (3, 2)


def test_unfinished_answers_and_nondeterministic_requests_are_not_stored():
    cache = ResultCache(4)
    k = cache_key("m", [1], SamplingParams.greedy(4))
    assert not cache.put(k, res(finish="cancelled"))
    assert not cache.put(k, res(finish="error"))
    assert not cache.put(None, res())
    assert len(cache) == 0
    assert cache.put(k, res(finish="stop"))
    assert cache.get(k).completion_tokens == 3


def test_clear_and_disabled_cache():
    cache = ResultCache(4)
    k = cache_key("m", [1], SamplingParams.greedy(4))
    cache.put(k, res())
    cache.clear()
    assert len(cache) == 0 and cache.get(k) is None and cache.clears == 1
    off = ResultCache(0)
    assert not off.enabled and not off.put(k, res()) and off.get(k) is None
    assert off.misses == 0  # a disabled cache is not consulted at all
    with pytest.raises(ValueError, match="result_cache_size"):
        ResultCache(-1)
