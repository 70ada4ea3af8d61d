"""Sampler: greedy, temperature, top-k, top-p, seeds, repetition penalty, validation, stop search."""

from __future__ import annotations

import numpy as np
import pytest

from serve.engine.sampling import SamplingError, SamplingParams, apply_repetition_penalty, find_stop, sample_token


def logits_of(probs):
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def draws(logits, params, n=2000, seed=0):
    rng = np.random.default_rng(seed)
    return np.array([sample_token(logits, params, rng) for _ in range(n)])


def test_greedy_is_argmax_and_ties_take_the_lowest_id():
    lg = np.array([0.1, 3.0, -2.0, 3.0], dtype=np.float32)
    assert sample_token(lg, SamplingParams.greedy(), None) == 1
    assert sample_token(lg, SamplingParams(temperature=0.7, top_k=1), None) == 1  # top_k=1 is greedy


def test_temperature_sampling_follows_the_distribution():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    got = draws(logits_of(p), SamplingParams(temperature=1.0), n=8000)
    freq = np.bincount(got, minlength=4) / len(got)
    assert np.allclose(freq, p, atol=0.03)
    # low temperature sharpens towards the argmax
    cold = draws(logits_of(p), SamplingParams(temperature=0.1), n=500)
    assert (cold == 0).mean() > 0.95


def test_top_k_and_top_p_restrict_the_candidates():
    p = [0.4, 0.3, 0.2, 0.1]
    got = set(draws(logits_of(p), SamplingParams(temperature=1.0, top_k=2)).tolist())
    assert got == {0, 1}
    got = set(draws(logits_of(p), SamplingParams(temperature=1.0, top_p=0.65)).tolist())
    assert got == {0, 1}  # 0.4 + 0.3 is the smallest set reaching 0.65
    got = set(draws(logits_of(p), SamplingParams(temperature=1.0, top_p=0.4)).tolist())
    assert got == {0}
    got = set(draws(logits_of(p), SamplingParams(temperature=1.0, top_k=3, top_p=0.99)).tolist())
    assert got == {0, 1, 2}


def test_seed_makes_sampling_reproducible():
    lg = np.random.default_rng(1).normal(size=500).astype(np.float32)
    params = SamplingParams(temperature=1.3, top_p=0.95, seed=1234)

    def run(p):
        rng = p.make_generator()
        return [sample_token(lg, p, rng) for _ in range(50)]

    assert run(params) == run(params)
    other = run(SamplingParams(temperature=1.3, top_p=0.95, seed=99))
    assert other != run(params)


def test_repetition_penalty():
    lg = np.array([2.0, 1.9, -1.0, -1.2], dtype=np.float32)
    out = apply_repetition_penalty(lg, [0, 2], 2.0)
    assert np.allclose(out, [1.0, 1.9, -2.0, -1.2])
    assert np.allclose(lg, [2.0, 1.9, -1.0, -1.2])  # input untouched
    assert sample_token(lg, SamplingParams.greedy(repetition_penalty=2.0), None, token_ids=[0]) == 1
    assert sample_token(lg, SamplingParams.greedy(), None, token_ids=[0]) == 0


@pytest.mark.parametrize("kw,match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"seed": -3}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_validation_errors(kw, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kw).validate()


def test_single_stop_string_is_accepted():
    assert SamplingParams(stop="END").validate().stop == ["END"]


def test_find_stop():
    assert find_stop("hello world", ["wor"]) == 6
    assert find_stop("hello world", ["xyz", "lo", "wor"]) == 3
    assert find_stop("hello world", ["xyz"]) == -1
    # start: only matches ending at/after start are looked for, including ones straddling it
    assert find_stop("abcabc", ["abc"], start=4) == 3
    assert find_stop("abcabc", ["bc"], start=2) == 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=1000),
                                    SamplingParams(temperature=1.6), SamplingParams(temperature=1.0, top_k=40)])
def test_the_head_draw_is_the_full_sorts_token_with_the_same_draws(params):
    """sample_token sorts only the most likely tokens where the one draw lands among them (serve/engine/sampling.py
    draw_from_head) and rewinds the generator for the full sort otherwise: 600 rows, flat and peaky, give the full
    path's token and leave the generator where it leaves it."""
    from serve.engine.sampling import draw, draw_from_head, token_distribution

    gen = np.random.default_rng(7)
    heads = 0
    for i in range(600):
        lg = (gen.normal(size=4096) * gen.uniform(0.5, 8)).astype(np.float32)
        a, b = np.random.default_rng(i), np.random.default_rng(i)
        heads += draw_from_head(lg, params, np.random.default_rng(i)) is not None
        assert sample_token(lg, params, a) == draw(*token_distribution(lg, params), b)
        assert a.random() == b.random()
    if params.top_k == 40:  # few candidates: the full path, which sorts only them
        assert heads == 0
    else:
        assert heads > 300  # the head path is taken (most rows), not only the fallback
