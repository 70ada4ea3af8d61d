"""Registry identity and naming (issue 30): one teacher is one baseline version across configs (its files'
content digest, not its manifest's), and the champion is named on the version and its source run, moving with
the alias on promote and rollback. A real sqlite MLflow store."""

from __future__ import annotations

import json
import shutil
import time

import mlflow

from compress.registry import store as registry
from compress.artifact import MANIFEST, content_digest, read_manifest, write_manifest
from compress.config import load_config
from tasks.register import register_task


def unique(prefix: str) -> str:
    return f"{prefix}-{time.time_ns()}"


def reexported(src, dst, **fields):
    """The same files under a manifest with other fields (another config's export of the same teacher)."""
    shutil.copytree(src, dst)
    old = json.loads((dst / MANIFEST).read_text())
    old.pop("files"), old.pop("manifest_version")
    write_manifest(dst, {**old, **fields})
    return dst


def test_one_teacher_is_one_baseline_version_across_configs(tiny_artifact, tmp_path, mlflow_store):
    registry.configure(mlflow_store)
    name = unique("ident")
    cfg = load_config(None, [f"registry.model_name={name}"])
    a = reexported(tiny_artifact, tmp_path / "a", config_hash="aaa", export_seconds=1.5)
    b = reexported(tiny_artifact, tmp_path / "b", config_hash="bbb", export_seconds=2.5)
    assert (a / MANIFEST).read_bytes() != (b / MANIFEST).read_bytes()
    assert content_digest(a) == content_digest(b) == content_digest(tiny_artifact)
    with mlflow.start_run() as run:
        first = register_task.fn(cfg.registry.model_name, run.info.run_id, str(a), ["baseline"], {"config_hash": "aaa", "role": "baseline"},
                                 same_config_only=False)
    with mlflow.start_run() as run:
        again = register_task.fn(cfg.registry.model_name, run.info.run_id, str(b), ["baseline"], {"config_hash": "bbb", "role": "baseline"},
                                 metrics={"perplexity": 12.5}, same_config_only=False)
    assert (first.version, again.version, again.reused) == ("1", "1", True)
    assert [v.version for v in registry.list_versions(name)] == ["1"]
    assert registry.figures(name, "1")["perplexity"] == 12.5  # the newer run's figures on the one version
    # Other files are another teacher: a new version.
    c = tmp_path / "c"
    shutil.copytree(tiny_artifact, c)
    (c / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    old = read_manifest(tiny_artifact)
    write_manifest(c, {k: v for k, v in old.items() if k not in ("files", "manifest_version")})
    with mlflow.start_run() as run:
        other = register_task.fn(cfg.registry.model_name, run.info.run_id, str(c), ["baseline"], {"config_hash": "aaa"},
                                 same_config_only=False)
    assert other.version == "2" and registry.version_for_alias(name, "baseline").version == "2"
    # Candidates stay one version per (manifest, config): the same files under another gate are judged apart.
    with mlflow.start_run() as run:
        cand = register_task.fn(cfg.registry.model_name, run.info.run_id, str(a), ["candidate"], {"config_hash": "zzz"})
    assert cand.version == "3" and not cand.reused


def test_the_champion_is_named_from_the_alias_and_its_history(tiny_artifact, mlflow_store):
    """Every label naming the champion follows the alias: moves through this project say who made them, a move made
    by hand (MlflowClient, as the UI does) is recorded by the next rollback or pipeline run, and nothing keeps
    naming a former champion as the current one."""
    import json

    registry.configure(mlflow_store)
    name = unique("champ")
    versions = []
    for i in range(3):
        with mlflow.start_run() as run:
            versions.append(registry.register_folder(tiny_artifact, name, run.info.run_id, {"n": i}))
    v1, v2, v3 = (v.version for v in versions)
    client = mlflow.MlflowClient()

    def label(v):
        mv = client.get_model_version(name, v)
        return mv.tags.get("champion", ""), mv.description or "", client.get_run(mv.run_id).data.tags.get("champion", "")

    def model():
        m = client.get_registered_model(name)
        return m.tags.get("champion"), m.description, [(t["version"], t["by"], t["until"] is None)
                                                        for t in json.loads(m.tags["champion_history"])]

    registry.promote(name, v1, verify=False)
    tag, desc, run_tag = label(v1)
    assert tag.startswith("since ") and desc.startswith("Champion since") and run_tag.startswith(f"version {v1}: champion since")
    assert label(v2) == ("", "", "")
    assert registry.promote(name, v2, verify=False) == v1
    assert label(v2)[0].startswith("since ")
    assert label(v1) == ("", label(v1)[1], "") and label(v1)[1].startswith("Was champion from")
    assert client.get_model_version(name, v1).tags["was_champion"].count(" to ") == 1
    champ, desc, terms = model()
    assert champ == v2 and desc.startswith(f"Champion: version {v2},") and "rollback/on-demand" in desc
    assert terms == [(v1, "promote", False), (v2, "promote", True)]

    client.set_registered_model_alias(name, "champion", v3)  # by hand, as the UI does
    assert registry.rollback(name) == v2  # undoes the hand move: v3's term is recorded first
    champ, desc, terms = model()
    assert champ == v2 and terms[-2:] == [(v3, "by hand, noticed by rollback", False), (v2, "rollback", True)]
    assert label(v3)[1].startswith("Was champion from") and label(v3)[0] == ""

    client.set_registered_model_alias(name, "champion", v1)  # by hand again; a pipeline run notices it
    assert registry.sync_champion(name, "pipeline run abc") and not registry.sync_champion(name, "pipeline run abc")
    champ, desc, terms = model()
    assert champ == v1 and desc.startswith(f"Champion: version {v1},") and f"version {v2}" in desc
    assert terms[-1] == (v1, "by hand, noticed by pipeline run abc", True)
    assert [v for v in (v1, v2, v3) if label(v)[0]] == [v1]  # one version tagged champion
    assert [v for v in (v1, v2, v3) if label(v)[2]] == [v1]  # one source run tagged champion
    assert label(v1)[1].startswith("Champion since") and label(v2)[1].startswith("Was champion")
    registry.set_alias(name, "candidate", v2)  # other aliases carry no label
    assert label(v2)[0] == "" and model()[0] == v1


def test_a_large_baseline_is_recorded_by_digest_not_copied(tiny_artifact, tiny_model_dir, tmp_path, mlflow_store,
                                                          monkeypatch):
    """registry.baseline_weights auto: above DIGEST_ABOVE_BYTES the store gets the manifest, tokenizer and a record
    of the weights (their sha256, the checkpoint's), not a second fp32 copy; the version says it cannot be served."""
    import pytest

    from compress.artifact import checkpoint_digest
    from serve.artifact import WEIGHTS_BY_DIGEST, ArtifactError

    registry.configure(mlflow_store)
    name = unique("digest")
    cfg = load_config(None, [f"registry.model_name={name}"])
    art = reexported(tiny_artifact, tmp_path / "a", source_model=str(tiny_model_dir))
    assert registry.keeps_weights(art, "auto")  # the tiny graph is small: copied, as SmolLM2's is
    monkeypatch.setattr(registry, "DIGEST_ABOVE_BYTES", 0)
    assert not registry.keeps_weights(art, "auto") and registry.keeps_weights(art, "copy")
    with mlflow.start_run() as run:
        reg = register_task.fn(cfg.registry.model_name, run.info.run_id, str(art), ["baseline"], {"role": "baseline"},
                               same_config_only=False, weights="auto")
    v = registry.get_version(name, reg.version)
    assert v.tags["weights"] == "digest"
    got = registry.download(f"models:/{name}/{v.version}", tmp_path / "dl")
    weights = registry.weight_files(art)
    assert weights and not any((got / f).exists() for f in weights)
    record = json.loads((got / WEIGHTS_BY_DIGEST).read_text())
    manifest = read_manifest(art)
    assert {f: r["sha256"] for f, r in record["weights"].items()} == {f: manifest["files"][f]["sha256"] for f in weights}
    assert record["source"]["checkpoint"]["sha256"] == checkpoint_digest(tiny_model_dir)["sha256"]
    stored = sum(p.stat().st_size for p in got.rglob("*") if p.is_file())
    assert stored < sum((art / f).stat().st_size for f in weights) / 10
    with pytest.raises(ArtifactError, match="by digest only"):
        read_manifest(got)  # what the server checks before it loads a version
    # the same export again is the same version (its content digest), not a new upload
    with mlflow.start_run() as run:
        again = register_task.fn(cfg.registry.model_name, run.info.run_id, str(art), ["baseline"], {"role": "baseline"},
                                 same_config_only=False, weights="auto")
    assert again.reused and again.version == reg.version
