"""imagegen/export.py: a pipeline directory from a base pipeline, loaded back by
StableDiffusion3Pipeline.from_pretrained: the scheduler's shift from the run, files linked not copied, extra files,
T5-less loading, atomic on failure."""

from __future__ import annotations

import json
import os

import pytest
import torch

from atelier_studio.imagegen.export import export_pipeline
from atelier_studio.imagegen.flow import FlowArgs
from atelier_studio.imagegen.sd3_text import SD3TextEncoders
from atelier_studio.pipeline.atomic import is_temporary
from atelier_studio.pipeline.errors import ModelLoadError

from tests.imagegen._sd3 import MAX_SEQUENCE_LENGTH, build_pipeline, load_pipeline


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_pipeline(tmp_path_factory.getbasetemp() / "sd3-pipe")


def test_export_with_the_run_shift_loads_in_diffusers(base, tmp_path):
    out = tmp_path / "pipeline"

    def extra(tmp):
        (tmp / "pytorch_lora_weights.safetensors").write_bytes(b"stand-in for an adapter file")

    export_pipeline(base, out, flow=FlowArgs(shift=1.5), extra=extra)
    assert json.loads((out / "model_index.json").read_text()) == json.loads((base / "model_index.json").read_text())
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    for weights in ("vae/diffusion_pytorch_model.safetensors", "text_encoder_3/model.safetensors"):
        assert os.stat(out / weights).st_ino == os.stat(base / weights).st_ino  # a hard link, not a copy
    pipe = load_pipeline(out)
    assert pipe.scheduler.config.shift == 1.5 and pipe.text_encoder_3 is not None
    assert json.loads((base / "scheduler" / "scheduler_config.json").read_text())["shift"] == 3.0  # base untouched
    # a run trained with text.use_t5 = false: the pipeline loaded without T5 encodes as Atelier's use_t5 = false
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(out, text_encoder_3=None, tokenizer_3=None, local_files_only=True)
    captions = ["a small blue circle", "a red star in the corner"]
    with torch.no_grad():
        want, _, want_pooled, _ = pipe.encode_prompt(captions, None, None, device="cpu",
                                                     do_classifier_free_guidance=False,
                                                     max_sequence_length=MAX_SEQUENCE_LENGTH)
    states, pooled, _ = SD3TextEncoders(out, MAX_SEQUENCE_LENGTH, use_t5=False).encode(captions)
    torch.testing.assert_close(states, want, rtol=0, atol=0)  # the same modules on the same ids
    torch.testing.assert_close(pooled, want_pooled, rtol=0, atol=0)


def test_export_failures_leave_nothing(base, tmp_path):
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ModelLoadError, match="not-a-model: not a diffusers transformer directory"):
        export_pipeline(base, tmp_path / "a", transformer=tmp_path / "not-a-model")
    with pytest.raises(FileNotFoundError, match="no AutoencoderKL found"):
        export_pipeline(base, tmp_path / "b", vae=tmp_path / "not-a-model")

    def fails(tmp):
        raise RuntimeError("stop")

    export_pipeline(base, tmp_path / "c")
    before = (tmp_path / "c" / "model_index.json").read_text()
    with pytest.raises(RuntimeError, match="stop"):
        export_pipeline(base, tmp_path / "c", flow=FlowArgs(shift=2.0), extra=fails)
    assert (tmp_path / "c" / "model_index.json").read_text() == before  # the old export is still whole
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not [p for p in tmp_path.rglob(".*") if is_temporary(p.name)]
