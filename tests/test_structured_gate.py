"""The accept gate's structured genre (compress/evaluate/structured.py): a candidate is scored against the baseline on
JSON and tool-call tasks, free and constrained, and a candidate that answers otherwise is rejected naming the check.

Two tiny models of different seeds stand for "the same model" and "a model whose tool calls broke": against itself a
model agrees on every constrained answer; another model's forced calls and JSON objects differ.
"""

from __future__ import annotations

import json

import pytest

from compress.config import AcceptConfig, load_config
from compress.evaluate.gate import accept
from compress.evaluate.structured import (Answers, StructuredEvalError, evaluate_structured, field_agreement, json_in,
                                          load_tasks, structured_figures)

from served import tiny_chat_artifact

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    return tiny_chat_artifact(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def same_tiny(tmp_path_factory):
    return tiny_chat_artifact(tmp_path_factory, 0)


def tasks():
    return load_tasks(["structured"])[:4] + [t for t in load_tasks(["structured"]) if t["kind"] == "tool"][:2]


def test_against_itself_every_constrained_answer_agrees_and_another_model_is_rejected(same_tiny, other_tiny):
    ts = tasks()
    same = evaluate_structured(same_tiny, same_tiny, ts, 96)
    assert same["structured_agreement"] == 1.0 and same["structured_valid_drop"] == 0.0
    assert same["structured_tasks"] == len(ts) and set(same["by_kind"]) == {"extract", "tool"}
    other = evaluate_structured(other_tiny, same_tiny, ts, 96)
    assert other["structured_agreement"] < 0.5 and other["structured_exact_agreement"] < 0.5, other
    base = {"perplexity": 10.0, "structured_valid_share": other["structured_baseline_valid_share"]}
    verdict = accept({"perplexity": 10.0, "top1_agreement": 1.0, **{k: v for k, v in other.items() if k != "by_kind"}},
                     base, AcceptConfig(), "fidelity")
    assert not verdict and any("structured" in r and "min_structured_agreement" in r for r in verdict.reasons)
    row = next(c for c in verdict.checks if c["name"] == "structured_agreement")
    assert row["genre"] == "structured" and row["value"] == other["structured_agreement"] and row["limit"] == 0.5


def test_free_answers_are_scored_by_parsing_and_validating():
    ts = [{"kind": "extract", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
           "messages": []}] * 3
    cand = Answers(['Sure: ```json\n{"a": 1}\n```', '{"a": "x"}', "no"], [[]] * 3, ['{"a": 1}', '{"a": 2}', None])
    base = Answers(['{"a": 1}', '{"a": 2}', '{"a": 3}'], [[]] * 3, ['{"a":1}', '{"a": 3}', '{"a": 4}'])
    f = structured_figures(cand, base, ts)
    assert f["structured_valid_share"] == pytest.approx(1 / 3) and f["structured_baseline_valid_share"] == 1.0
    assert f["structured_valid_drop"] == pytest.approx(2 / 3) and f["structured_agreement"] == pytest.approx(1 / 3)
    assert json_in("text {\"a\": 1} more") == {"a": 1} and json_in("nothing") is None
    # constrained answers field by field: another tool scores 0, one argument of three off scores 3/4
    assert field_agreement(("f", {"x": 1}), ("g", {"x": 1})) == 0.0
    assert field_agreement(("f", {"x": 1, "y": 2, "z": 3}), ("f", {"x": 1, "y": 2, "z": 4})) == 0.75
    assert field_agreement('{"a": 1, "b": 2}', '{"a": 1}') == 0.5 and field_agreement("cut {", "cut {") == 1.0


def test_the_demo_config_runs_the_genre_and_bad_sets_are_named(tmp_path):
    assert load_config("configs/default.yaml").accept.structured_sets == ["structured"]
    with pytest.raises(Exception, match="structured_sets"):
        load_config(None, ["accept.structured_sets=[nope]"])
    bad = tmp_path / "t.jsonl"
    bad.write_text(json.dumps({"kind": "tool", "messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(StructuredEvalError, match="accept.structured_sets"):
        load_tasks([str(bad)])
