"""pipeline/hf_files.py: the checks that run before transformers or diffusers read a user's folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atelier_studio.pipeline.atomic import save_safetensors
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.hf_files import (
    check_tokenizer_dir,
    check_vocab_size,
    check_weights_dir,
    read_safetensors_header,
)


class Sized:
    """A stand-in tokenizer: only its length is read."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def weights(folder: Path, name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors({"w": torch.zeros(4, 4), "b": torch.zeros(4)}, folder / name)
    return folder / name


def test_a_whole_file_passes_and_every_kind_of_damage_is_named(tmp_path):
    f = weights(tmp_path / "m")
    assert set(read_safetensors_header(f)) == {"w", "b"}
    assert check_weights_dir(tmp_path / "m") == [f]
    data = f.read_bytes()
    for damaged, message in [(data[:6], "no header length"), (data[:40], "header claims"),
                             (data[:-8], "truncated file?"),
                             (data[:8] + b"\xff" * (len(data) - 8), "corrupt safetensors header"),
                             (len(b"[1]").to_bytes(8, "little") + b"[1]", "not an object")]:
        f.write_bytes(damaged)
        with pytest.raises(ModelLoadError, match=message) as e:
            check_weights_dir(tmp_path / "m", "vae")
        assert str(f) in str(e.value)


def test_a_folder_without_safetensors_names_its_pickles(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelLoadError, match=r"vae .*/vae: no safetensors weights.*diffusion_pytorch_model.bin.*never"):
        check_weights_dir(tmp_path / "vae", "vae")


def test_an_index_is_checked_shard_by_shard(tmp_path):
    weights(tmp_path, "model-00001-of-00002.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors is listed but missing"):
        check_weights_dir(tmp_path)
    weights(tmp_path, "model-00002-of-00002.safetensors")
    assert len(check_weights_dir(tmp_path)) == 2


@pytest.mark.parametrize("kind, files, ok", [
    ("clip", ["tokenizer.json"], True), ("clip", ["vocab.json", "merges.txt"], True),
    ("clip", ["vocab.json"], False), ("clip", ["tokenizer_config.json"], False),
    ("t5", ["spiece.model"], True), ("t5", ["tokenizer.json"], True), ("t5", ["tokenizer_config.json"], False),
    ("qwen", ["tokenizer.json"], True), ("qwen", ["vocab.json", "merges.txt"], True), ("qwen", ["merges.txt"], False)])
def test_a_tokenizer_folder_needs_its_vocabulary(tmp_path, kind, files, ok):
    for name in files:
        (tmp_path / name).write_text("{}")
    if ok:
        assert check_tokenizer_dir(tmp_path, kind) == tmp_path
    else:
        with pytest.raises(ModelLoadError, match=f"{tmp_path}: no tokenizer vocabulary"):
            check_tokenizer_dir(tmp_path, kind)


def test_the_tokenizer_must_fit_its_encoder(tmp_path):
    check_vocab_size(Sized(32100), tmp_path / "tokenizer_3", 32128, tmp_path / "text_encoder_3")  # T5's padding rows
    check_vocab_size(Sized(49408), tmp_path / "tokenizer", 49408, tmp_path / "text_encoder")
    with pytest.raises(ModelLoadError, match="has 3 tokens .* vocab_size 49408: its vocabulary did not load"):
        check_vocab_size(Sized(3), tmp_path / "tokenizer_2", 49408, tmp_path / "text_encoder_2")
    with pytest.raises(ModelLoadError, match="has 49409 tokens .* ids past it have no embedding"):
        check_vocab_size(Sized(49409), tmp_path / "tokenizer", 49408, tmp_path / "text_encoder")
