"""Session-wide fixtures: one tiny seeded Llama, its tokenizer, its exported artifact and data splits.

Everything heavy is built once per test session (per pytest-xdist worker: `make test` runs two, each test file on
one of them, so a module fixture is built once too); tests must not mutate these
(copy the model with copy.deepcopy, the artifact with shutil.copytree).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the seed-0 tiny Llama. Read-only."""
    from compress.loading.tiny import build_tiny_llama

    return build_tiny_llama(seed=0)


@pytest.fixture(scope="session")
def tiny_gqa(tiny, tmp_path_factory):
    """The tiny Llama's fp32 gqa artifact (GroupQueryAttention, in-place K/V), built once. Read-only."""
    from compress.export.gqa import build_gqa_artifact

    model, tok = tiny
    out = tmp_path_factory.mktemp("tiny_gqa") / "fp32"
    build_gqa_artifact(model, tok, out)
    return out


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module: the tiny model's ops are too small to split, a second thread
    only adds waiting (3x the CPU time of the distillation tests)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_model(tiny):
    return tiny[0]


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny):
    return tiny[1]


@pytest.fixture(scope="session")
def trained_tiny4(tiny_splits):
    """A 4-layer tiny Llama (seed 1) after 60 Adam steps on the train split, on one torch thread: random weights
    have no structure for pruning to keep, and every layer of this one lowers the loss. Read-only: copy it to
    change it."""
    import torch

    from compress.loading.tiny import build_tiny_llama

    model = build_tiny_llama(seed=1, num_hidden_layers=4)[0].train()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        data = torch.as_tensor(tiny_splits.train, dtype=torch.long)
        for step in range(60):
            x = data[(step * 8) % len(data):][:8]
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(n)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny model saved as a HF folder, as a user would pass model.source."""
    from compress.loading.tiny import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_hf") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_artifact(tiny, tmp_path_factory):
    """Artifact folder (model.onnx, tokenizer, manifest.json) of the tiny model. Read-only."""
    from compress.export.standard import build_artifact

    model, tok = tiny
    out = tmp_path_factory.mktemp("tiny_artifact") / "fp32"
    build_artifact(model, tok, out, exporter="dynamo")
    return out


@pytest.fixture(scope="session")
def seed1_artifact(tmp_path_factory):
    """A second, different tiny model (seed 1), for alias flips and swaps. TorchScript export: ~1 s against ~20 s
    for dynamo. Read-only."""
    from compress.export.standard import build_artifact
    from compress.loading.tiny import build_tiny_llama

    model, tok = build_tiny_llama(seed=1)
    out = tmp_path_factory.mktemp("seed1") / "seed1"
    build_artifact(model, tok, out, exporter="torchscript")
    return out


@pytest.fixture(scope="session")
def tiny_splits(tiny_tokenizer):
    """Train/calib/eval/test blocks of 32 tokens from the embedded corpus, 8 held-out blocks of stdlib code."""
    from compress.corpus.splits import make_splits

    return make_splits(tiny_tokenizer, "embedded", block_size=32, train_blocks=64, calib_blocks=8, selection_blocks=8,
                       test_blocks=8, seed=0, heldout_blocks=8)


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server for the whole session, one per xdist worker (~20 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory):
    """A fresh sqlite MLflow store for the session; sets MLFLOW_TRACKING_URI."""
    import mlflow

    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    uri = f"sqlite:///{db}"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    mlflow.set_tracking_uri(uri)
    yield uri
    if old is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old


@pytest.fixture(scope="session")
def tiny_flow_run(prefect_harness, mlflow_store, tmp_path_factory):
    """The compression flow run once on configs/tiny.yaml; later tests inspect what it left."""
    from flows.pipeline import compress_flow

    work = tmp_path_factory.mktemp("work")
    overrides = [f"workdir={work}"]
    out = compress_flow(config="configs/tiny.yaml", overrides=overrides)
    return {"out": out, "workdir": work, "overrides": overrides}


@pytest.fixture(scope="module")
def http(server):
    """An httpx client on the module's ``server`` fixture (a BackgroundServer), 30 s timeout."""
    from served import http_on

    with http_on(server) as c:
        yield c
