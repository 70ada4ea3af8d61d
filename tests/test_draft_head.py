"""The champion's drafter (compress/draft/, serve/engine/draft_head.py): the served graph's hidden state is what
the head reads, the exported head drafts what the trained one does, a drafter built on the target's own answers
proposes tokens that stand, greedy text never changes, and a drafter for another model is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compress.draft.settings import DraftConfig
from serve.config import ConfigError, ServeConfig
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.runners.onnx_session import CPU

pytestmark = pytest.mark.timeout(300)


def cfg(**kw) -> ServeConfig:
    return ServeConfig(**{"providers": [CPU], "kv_memory_mb": 8, "enable_prefix_caching": False, **kw})


@pytest.fixture(scope="module")
def tiny_head(tiny_gqa, tmp_path_factory):
    """A drafter of the tiny gqa model, distilled on its own completions (fixed seeds), and those completions."""
    from compress.draft import conversations as conv
    from compress.draft.stage import build_drafter

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("draft")
    settings = DraftConfig(enabled=True, prompts=24, max_tokens=24, users=4, vocab=200, width=128, steps=3,
                           tokens=256 * 120, held_out=0.2)
    result = build_drafter(tiny_gqa, folder / "head", settings, cache=folder / "convs.npz", progress=False)
    return result, conv.load(folder / "convs.npz")


def test_the_hidden_output_is_what_the_lm_head_reads(tiny_gqa):
    """logits = hidden @ the head matrix read back from the graph (fp32 graph: to float rounding)."""
    from compress.draft.target import head_matrix
    from serve.runners.protocol import RunRow

    manifest = json.loads((tiny_gqa / "manifest.json").read_text())
    eng = Engine(tiny_gqa, cfg(), start=False, hidden_sink=lambda *a: None)
    W = head_matrix(tiny_gqa, manifest, np.arange(int(manifest["vocab_size"])))
    logits = eng.runner.execute([RunRow("a", [0, 1], 0, [5, 9, 14, 3, 7], True, True)])[0]
    hidden = eng.runner.last_hidden[0]
    assert hidden.shape == (5, int(manifest["hidden_size"]))
    np.testing.assert_allclose(hidden @ W, logits, atol=2e-4 * float(np.abs(logits).max()))


def test_the_exported_head_drafts_what_the_torch_head_drafts(tmp_path):
    import onnxruntime as ort

    from compress.draft.graph import export_head
    from compress.draft.head import HeadNet

    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    H, V, full, steps = 64, 40, 300, 3
    net = HeadNet(rng.normal(size=(H, V)).astype(np.float32), 96, 2.0)
    with torch.no_grad():
        net.fc2.weight.normal_(0, 0.3)
    vocab_ids = np.sort(rng.choice(full, V, replace=False)).astype(np.int64)
    to_index = np.full(full, V)
    to_index[vocab_ids] = np.arange(V)
    session = ort.InferenceSession(str(export_head(net, vocab_ids, full, steps, tmp_path / "draft.onnx")),
                                   providers=[CPU])
    hidden = rng.normal(size=(16, H)).astype(np.float32) * 3
    tokens = np.concatenate([vocab_ids[:12], [0, 1, 2, 3]])  # the last four may lie outside the vocabulary
    got = session.run(["draft_ids"], {"hidden": hidden, "token": tokens})[0]
    want, h, idx = [], torch.from_numpy(hidden), torch.from_numpy(to_index[tokens])
    with torch.no_grad():
        for _ in range(steps):
            h, logits = net.step(h, idx)
            idx = logits.argmax(-1)
            want.append(vocab_ids[idx.numpy()])
    # 8-bit weights and int8 activations: a near tie may go the other way, not more than that
    assert got.shape == (16, steps)
    assert np.mean(got == np.stack(want, 1)) >= 0.9


def test_a_drafter_built_on_the_target_drafts_tokens_that_stand_and_keeps_greedy_text(tiny_gqa, tiny_head):
    result, convs = tiny_head
    assert result.path.joinpath("draft.onnx").is_file() and result.answer_tokens > 300
    assert 0 < result.vocab_coverage <= 1 and len(result.rate_by_position) == 3
    prompts = [c.ids[:c.start].tolist() for c in convs[:6]]
    outs = {}
    for spec in ("off", str(result.path)):
        eng = Engine(tiny_gqa, cfg(speculative=spec), start=False)
        outs[spec] = []
        for p in prompts:  # one user at a time: speculation runs in steps of one row (speculative_max_rows)
            handle = eng.add_request(p, SamplingParams.greedy(24))
            while eng.has_work():
                eng.step()
                eng.check_invariants()
            outs[spec].append(handle.result().output_ids)
        counters = eng.drafter.counters if eng.drafter else None
    assert outs["off"] == outs[str(result.path)]
    # the head learned these answers: drafts were made from the observed hidden states and some stood
    assert counters.drafts > 0 and counters.accepted_tokens > 0


def test_a_drafter_of_another_model_or_layout_is_refused(tiny_gqa, tiny_head, tiny_artifact, tmp_path):
    import shutil

    from compress.draft.stage import DraftError, build_drafter

    result, _ = tiny_head
    other = tmp_path / "other"
    shutil.copytree(result.path, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["target"]["hidden_size"] += 8
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="serve.speculative.*hidden_size"):
        Engine(tiny_gqa, cfg(speculative=str(other)), start=False)
    with pytest.raises(ConfigError, match="serve.speculative.*'standard'"):
        Engine(tiny_artifact, cfg(speculative=str(result.path)), start=False)
    with pytest.raises(DraftError, match="draft.vocab"):
        build_drafter(tiny_gqa, tmp_path / "x", DraftConfig(vocab=10**7))
    with pytest.raises(DraftError, match="attention layout"):
        build_drafter(tiny_artifact, tmp_path / "y", DraftConfig())


def test_a_trimmed_vocabulary_never_drafts_outside_it_while_the_target_still_emits_those_tokens(tiny_gqa, tmp_path):
    """A head with a 24-token vocabulary: every token it proposes is one of them, the target's greedy answers hold
    tokens outside it, and those answers are the same as without drafting."""
    import onnx
    from onnx import numpy_helper

    from compress.draft import conversations as conv
    from compress.draft.stage import build_drafter

    torch.manual_seed(0)
    settings = DraftConfig(enabled=True, prompts=16, max_tokens=24, users=4, vocab=24, width=64, steps=3,
                           tokens=256 * 40, held_out=0.2)
    result = build_drafter(tiny_gqa, tmp_path / "head", settings, cache=tmp_path / "convs.npz", progress=False)
    graph = onnx.load(str(result.path / "draft.onnx"))
    vocab = set(numpy_helper.to_array(next(i for i in graph.graph.initializer if i.name == "vocab_ids")).tolist())
    assert len(vocab) == 24
    prompts = [c.ids[:c.start].tolist() for c in conv.load(tmp_path / "convs.npz")[:6]]
    outs, drafted = {}, []
    for spec in ("off", str(result.path)):
        eng = Engine(tiny_gqa, cfg(speculative=spec), start=False)
        if eng.drafter is not None:
            propose = eng.drafter.model.propose
            eng.drafter.model.propose = lambda reqs: [drafted.extend(d) or d for d in propose(reqs)]
        outs[spec] = []
        for p in prompts:
            handle = eng.add_request(p, SamplingParams.greedy(24))
            eng.run_until_done()
            outs[spec].append(handle.result().output_ids)
    emitted = {t for out in outs["off"] for t in out}
    assert emitted - vocab, "the target's answers should reach outside the trimmed vocabulary"
    assert drafted and set(drafted) <= vocab
    assert outs["off"] == outs[str(result.path)]


def test_a_failing_head_neither_overrides_nor_pauses_prompt_lookup(tiny_gqa, tiny_head):
    """Beside a head, prompt lookup keeps its own draft length: where the sequence repeats itself its copies are drafted
    and stand as with lookup alone, even when every one of the head's guesses fails."""
    result, _ = tiny_head
    loop = [7, 8, 9, 10, 11] * 6
    accepted = {}
    for spec in ("prompt_lookup", str(result.path)):
        eng = Engine(tiny_gqa, cfg(speculative=spec), start=False)
        eng.drafter.costs = None  # lengths by acceptance alone: the timed costs of a tiny model are noise
        if eng.drafter.model is not None:  # the head proposes a token that never stands
            eng.drafter.model.propose = lambda reqs: [[0] * k for _, _, k in reqs]
        handle = eng.add_request(loop, SamplingParams.greedy(40, ignore_eos=True))
        eng.run_until_done()
        stats = eng.stats()
        accepted[spec] = (handle.result().output_ids, stats.spec_accepted_tokens)
        eng.shutdown()
    assert accepted["prompt_lookup"][0] == accepted[str(result.path)][0]
    assert accepted["prompt_lookup"][1] > 10
    assert accepted[str(result.path)][1] >= 0.8 * accepted["prompt_lookup"][1], accepted
