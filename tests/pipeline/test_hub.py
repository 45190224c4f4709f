"""pipeline/hub.py: model arguments that are hub ids resolve from a cache laid out by the test, offline, never
downloaded; a local path always wins; a string that is no id is left for the caller's own error."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from atelier_studio.pipeline.config import load_config
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.hub import hub_cache_dir, parse_repo_id, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(cache: Path, repo_id: str, files: Path, commit: str = COMMIT, refs: tuple[str, ...] = ("main",),
                  repo_type: str = "model") -> Path:
    """A hub cache entry as huggingface_hub writes it: models--org--name/{refs/<ref> = commit, snapshots/<commit>/...}
    (datasets--org--name for repo_type "dataset") with the files of the folder `files` copied in; returns the
    snapshot folder."""
    repo = cache / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache under tmp_path, named by HF_HUB_CACHE, with the hub offline (nothing may be fetched)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _model_files(tmp_path: Path) -> Path:
    d = tmp_path / "files"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_repo_ids_are_told_from_other_strings():
    assert parse_repo_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert parse_repo_id("org/name@v1.0") == ("org/name", "v1.0")
    for not_an_id in ("tiny", "/abs/dir", "./rel/dir", "a/b/c", "org/na--me", "org/name.", "pixel:2", "model", ""):
        assert parse_repo_id(not_an_id) is None, not_an_id


def test_a_cached_id_resolves_to_its_snapshot_and_a_local_path_wins(tmp_path, offline_cache, monkeypatch):
    snapshot = lay_out_cache(offline_cache, "org/tiny", _model_files(tmp_path), refs=("main", "v1"))
    assert Path(resolve_model_path("org/tiny", "model.path")) == snapshot
    assert Path(resolve_model_path("org/tiny@v1", "model.path")) == snapshot
    assert Path(resolve_model_path(f"org/tiny@{COMMIT}", "model.path")) == snapshot
    # a local folder of the same name is used as it is
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert resolve_model_path("org/tiny", "model.path") == "org/tiny"
    # neither a path nor an id: unchanged, for the caller's "not a directory"
    assert resolve_model_path("no-such-dir", "model.path") == "no-such-dir"


def test_hf_home_names_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    snapshot = lay_out_cache(tmp_path / "home" / "hub", "org/tiny", _model_files(tmp_path))
    assert Path(resolve_model_path("org/tiny", "--model")) == snapshot


def test_a_missing_id_names_the_id_the_cache_and_the_fix(tmp_path, offline_cache):
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path("org/absent", "model.path")
    msg = str(e.value)
    assert "model.path 'org/absent'" in msg and str(offline_cache) in msg
    assert "huggingface-cli download org/absent" in msg and "local model directory" in msg
    lay_out_cache(offline_cache, "org/tiny", _model_files(tmp_path))
    with pytest.raises(ModelLoadError, match=r"org/tiny at revision v9 .*--revision v9"):
        resolve_model_path("org/tiny@v9", "--model")  # the model is there, the revision is not


def test_config_model_paths_resolve_when_the_config_loads(tmp_path, offline_cache):
    """A cached id becomes its snapshot; one not in the cache stays as written (a config may name a folder made
    later, `models/tiny`, which is also a valid id): the trainer resolves it strictly when it opens the model."""
    from atelier_studio.designer.config import DesignerConfig

    snapshot = lay_out_cache(offline_cache, "org/tiny", _model_files(tmp_path))
    base = ["data.train=x.jsonl", f"output.dir={tmp_path / 'run'}"]
    cfg = load_config(DesignerConfig, None, ["model.path=org/tiny", "lora.rank=4", "lora.init_adapter=org/tiny", *base])
    assert Path(cfg.model.path) == snapshot and Path(cfg.lora.init_adapter) == snapshot
    assert load_config(DesignerConfig, None, ["model.path=models/tiny", *base]).model.path == "models/tiny"
    with pytest.raises(ModelLoadError, match=r"^model.path 'models/tiny': .*not in the Hugging Face cache"):
        resolve_model_path("models/tiny", "model.path")
    assert resolve_model_path("models/tiny", "model.path", strict=False) == "models/tiny"
