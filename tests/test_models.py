"""Model loading: local folders, tiny sources, clear errors offline."""

import pytest
import torch

from compress.loading.models import ModelError, load_teacher, model_info


def test_local_folder_loads_identical_weights(tiny_model, tiny_model_dir):
    m, tok = load_teacher(str(tiny_model_dir))
    x = torch.tensor([[1, 5, 9, 33]])
    with torch.no_grad():
        assert torch.equal(m(x).logits, tiny_model(x).logits)
    info = model_info(m)
    assert info["num_layers"] == 2 and info["num_kv_heads"] == 2 and info["head_dim"] == 16


def test_uncached_hub_id_fails_with_advice(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="local folder"):
        load_teacher("someone/not-a-cached-model", cache_dir=tmp_path)


def test_bad_paths(tmp_path):
    with pytest.raises(ModelError, match="no such file"):
        load_teacher("./missing-model.gguf", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        load_teacher(str(tmp_path / "empty"), cache_dir=tmp_path)
    with pytest.raises(ModelError, match="tiny"):
        load_teacher("tiny:abc", cache_dir=tmp_path)
