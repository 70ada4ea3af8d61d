"""lm-evaluation-harness as a real evaluation client (issue 16): its ``local-completions`` model scores the served
tiny model over a socket, loglikelihood (echo + logprobs) and generate_until, on a local task
(tests/data/lm_eval_task, no hub download); its loglikelihoods match lm-eval's HF backend on the same weights
(the tiny model's torch folder) within 1e-3 nats per choice (docs/evaluation.md says why). Needs the ``eval``
extra (``pip install -e '.[eval]'``); skipped without it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from serve.api.app import create_app  # noqa: E402
from serve.api.background import BackgroundServer  # noqa: E402
from serve.config import ServeConfig  # noqa: E402
from serve.runners.onnx_session import CPU

pytestmark = pytest.mark.timeout(300)

TASK_DIR = Path(__file__).parent / "data" / "lm_eval_task"
TOL = 1e-3  # nats, per choice's summed loglikelihood (docs/evaluation.md, "Tolerance")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The task YAMLs with data_files made absolute (lm-eval resolves them against the working directory)."""
    out = tmp_path_factory.mktemp("lm_eval_task")
    data = TASK_DIR / "tiny_mc.jsonl"
    for name in ("tiny_mc.yaml", "tiny_gen.yaml"):
        text = (TASK_DIR / name).read_text().replace("tests/data/lm_eval_task/tiny_mc.jsonl", str(data))
        (out / name).write_text(text)
    return out


@pytest.fixture(scope="module")
def hf_dir(tiny_model_dir, tiny_artifact, tmp_path_factory):
    """The tiny model's HF folder with the artifact's tokenizer files (one tokenizer for both backends)."""
    out = tmp_path_factory.mktemp("tiny_hf_tok") / "model"
    shutil.copytree(tiny_model_dir, out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_artifact / f, out / f)
    return out


def evaluate(model: str, model_args: str, task_dir: Path, tasks: list[str]) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                   task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                   batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def loglikelihoods(res: dict, task: str) -> np.ndarray:
    """[items, choices] summed loglikelihood of each choice given the context."""
    return np.array([[r[0][0] for r in s["resps"]] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"])],
                    dtype=np.float64).reshape(len(res["samples"][task]), -1)


def test_lm_eval_local_completions_matches_its_hf_backend(tiny_artifact, hf_dir, task_dir):
    app = create_app(str(tiny_artifact), ServeConfig(providers=[CPU], kv_memory_mb=8, max_batch_size=4),
                     served_name="tiny", admin_token=None)
    with BackgroundServer(app) as srv:
        served = evaluate("local-completions",
                          f"base_url={srv.url}/v1/completions,model=tiny,tokenizer_backend=huggingface,"
                          f"tokenizer={tiny_artifact},num_concurrent=1,max_retries=1,max_length=512",
                          task_dir, ["tiny_mc", "tiny_gen"])
    hf = evaluate("hf", f"pretrained={hf_dir},dtype=float32,device=cpu,max_length=512", task_dir,
                  ["tiny_mc", "tiny_gen"])
    ll_s, ll_h = loglikelihoods(served, "tiny_mc"), loglikelihoods(hf, "tiny_mc")
    assert ll_s.shape == (8, 4) and np.isfinite(ll_s).all()
    np.testing.assert_allclose(ll_s, ll_h, atol=TOL, rtol=0)
    assert served["results"]["tiny_mc"]["acc,none"] == hf["results"]["tiny_mc"]["acc,none"]
    # generate_until ran through the server: one greedy generation per item, as the HF backend's
    gen_s = [s["resps"][0][0] for s in sorted(served["samples"]["tiny_gen"], key=lambda s: s["doc_id"])]
    gen_h = [s["resps"][0][0] for s in sorted(hf["samples"]["tiny_gen"], key=lambda s: s["doc_id"])]
    assert len(gen_s) == 8 and gen_s == gen_h
