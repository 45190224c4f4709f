"""`atelier imagegen export`: each form loaded by its consumer and compared with Atelier's model on random inputs.

- --single-file: SD3Transformer2DModel.from_single_file reads the original-layout file; its outputs equal the model's
  (the same tensors: bit for bit);
- --merge: StableDiffusion3Pipeline.from_pretrained reads the pipeline folder; its transformer predicts what
  Atelier's LoRA model predicts (fp32, W + s·B·A against the adapter computed beside W: 1e-5 relative, as
  tests/imagegen/test_lora.py's LoRA forwards); a run without pipeline/ gets a transformer folder;
- --lora-format kohya: the keys are ComfyUI's for SD3 (`lora_transformer_` + the diffusers module path), and applying
  them as a kohya loader does (W + alpha / r · up @ down) onto diffusers' transformer gives Atelier's outputs;
- --lora-format diffusers: load_lora_weights reads the folder and gives Atelier's outputs.
Runs are laid out by the test (config.toml, lora/, pipeline/ as the trainer writes them) from a tiny random pipeline.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from atelier_studio.flows.cli import main
from atelier_studio.imagegen.export import export_pipeline
from atelier_studio.imagegen.hf import load_pretrained, save_pretrained
from atelier_studio.imagegen.lora import apply_lora, save_lora, target_modules
from atelier_studio.imagegen.lora_kohya import KOHYA_PREFIX
from atelier_studio.imagegen.model import FAMILY
from atelier_studio.imagegen.single_file import single_file_state_dict
from atelier_studio.pipeline.lora import LoraArgs, lora_layers

from tests.imagegen._sd3 import build_pipeline, load_pipeline
from tests.imagegen.test_model import SD3_TINY, SD35_TINY, inputs, reference, rel_err

LORA = LoraArgs(rank=3, alpha=6.0, rslora=True)  # rsLoRA: a kohya alpha must carry √r
TARGETS = ("to_q", "to_v", "attn.to_add_out", "ff.net.2", "ff_context.net.0.proj")


@pytest.fixture(scope="module", params=["sd3", "sd3.5"])
def base(request, tmp_path_factory) -> Path:
    return build_pipeline(tmp_path_factory.mktemp(request.param) / "pipe", sd35=request.param == "sd3.5")


def lora_run(base: Path, run: Path, pipeline: bool = True):
    """A finished LoRA run on `base` as the trainer leaves it, and Atelier's model with that LoRA (random B)."""
    model = load_pretrained(base, kernels="ref")
    apply_lora(model, LORA, target_modules(model, FAMILY.resolve_lora_targets(TARGETS)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.weight.normal_(0, 0.1, generator=g)
    save_lora(model, LORA, run / "lora")
    (run / "config.toml").write_text(f'[model]\npath = "{base}"\n')
    if pipeline:
        export_pipeline(base, run / "pipeline")
    return model.eval()


def model_inputs(model):
    return inputs(model.args, 12, 16)


def test_single_file_loads_in_diffusers_from_single_file_bit_for_bit(tmp_path):
    from diffusers import SD3Transformer2DModel

    for args in (SD3_TINY, SD35_TINY):
        ref = reference(args)
        ref.save_pretrained(tmp_path / "cfg" / "transformer")
        state = single_file_state_dict(ref.state_dict())
        assert all(k.startswith("model.diffusion_model.") for k in state)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "m.safetensors")
        got = SD3Transformer2DModel.from_single_file(str(tmp_path / "m.safetensors"), config=str(tmp_path / "cfg"),
                                                     subfolder="transformer", local_files_only=True)
        for k, v in ref.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), k


def test_cli_single_file_of_a_lora_run_is_the_merged_transformer(base, tmp_path):
    from diffusers import SD3Transformer2DModel

    model = lora_run(base, tmp_path / "run")
    out = tmp_path / "sd3_merged.safetensors"
    assert main(["imagegen", "export", str(tmp_path / "run"), "--single-file", "--out", str(out)]) == 0
    got = SD3Transformer2DModel.from_single_file(str(out), config=str(base), subfolder="transformer",
                                                 local_files_only=True).eval()
    x = model_inputs(model)
    with torch.no_grad():
        want = model(*x)
        assert rel_err(got(*x).sample, want) <= 1e-5
        plain = load_pretrained(base, kernels="ref").eval()(*x)
    assert rel_err(plain, want) > 1e-3  # the adapter matters: an unmerged export would fail above


def test_cli_merge_writes_a_pipeline_diffusers_loads(base, tmp_path):
    model = lora_run(base, tmp_path / "run")
    assert main(["imagegen", "export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "merged")]) == 0
    pipe = load_pipeline(tmp_path / "merged")
    x = model_inputs(model)
    with torch.no_grad():
        assert rel_err(pipe.transformer(*x).sample, model(*x)) <= 1e-5
    assert pipe.transformer.dtype == torch.float32  # the base's dtype
    assert not (tmp_path / "merged" / "pytorch_lora_weights.safetensors").exists()  # merged, not loaded on top


def test_cli_merge_without_a_pipeline_writes_a_transformer_folder(base, tmp_path):
    from diffusers import SD3Transformer2DModel

    model = lora_run(base, tmp_path / "run", pipeline=False)
    assert main(["imagegen", "export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "t")]) == 0
    got = SD3Transformer2DModel.from_pretrained(tmp_path / "t").eval()
    x = model_inputs(model)
    with torch.no_grad():
        assert rel_err(got(*x).sample, model(*x)) <= 1e-5


def test_cli_kohya_lora_has_comfyuis_keys_and_a_kohya_loaders_result(base, tmp_path):
    from diffusers import SD3Transformer2DModel

    model = lora_run(base, tmp_path / "run")
    out = tmp_path / "my_lora.safetensors"
    assert main(["imagegen", "export", str(tmp_path / "run"), "--lora-format", "kohya", "--out", str(out)]) == 0
    tensors = load_file(out)
    ref = SD3Transformer2DModel.from_pretrained(base / "transformer").eval()
    # ComfyUI's SD3 key map: "lora_transformer_" + a diffusers module path with "." -> "_"
    names = {KOHYA_PREFIX + n.replace(".", "_"): n for n, _ in ref.named_modules()}
    modules = {k.rsplit(".", 2)[0] for k in tensors}
    assert modules == {KOHYA_PREFIX + n.replace(".", "_") for n in lora_layers(model)}
    assert set(tensors) == {f"{m}.{p}" for m in modules for p in ("lora_down.weight", "lora_up.weight", "alpha")}
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["ss_network_dim"] == "3"
    with torch.no_grad():  # what a kohya loader does with the file
        for m in modules:
            down, up, alpha = tensors[f"{m}.lora_down.weight"], tensors[f"{m}.lora_up.weight"], tensors[f"{m}.alpha"]
            linear = ref.get_submodule(names[m])
            linear.weight += alpha.item() / down.shape[0] * (up @ down)
    assert math.isclose(tensors[f"{next(iter(modules))}.alpha"].item(), LORA.alpha * math.sqrt(LORA.rank), rel_tol=1e-6)
    x = model_inputs(model)
    with torch.no_grad():
        assert rel_err(ref(*x).sample, model(*x)) <= 1e-5


def test_cli_diffusers_lora_loads_with_load_lora_weights(base, tmp_path):
    model = lora_run(base, tmp_path / "run")
    assert main(["imagegen", "export", str(tmp_path / "run"), "--lora-format", "diffusers", "--out",
                 str(tmp_path / "lora_out")]) == 0
    pipe = load_pipeline(base)
    pipe.load_lora_weights(str(tmp_path / "lora_out"))
    x = model_inputs(model)
    with torch.no_grad():
        assert rel_err(pipe.transformer(*x).sample, model(*x)) <= 1e-5


def test_a_full_run_exports_its_ema_as_a_single_file(tmp_path):
    from diffusers import SD3Transformer2DModel

    ref = reference(SD3_TINY)
    ref.save_pretrained(tmp_path / "run" / "transformer")
    ema = reference(SD3_TINY, seed=5)
    ema.save_pretrained(tmp_path / "run" / "ema")
    out = tmp_path / "full.safetensors"
    assert main(["imagegen", "export", str(tmp_path / "run"), "--single-file", "--out", str(out)]) == 0
    got = SD3Transformer2DModel.from_single_file(str(out), config=str(tmp_path / "run"), subfolder="ema",
                                                 local_files_only=True)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in ema.state_dict().items())


@pytest.mark.parametrize("argv,message", [
    (lambda t: [str(t / "run"), "--out", str(t / "o")], "choose one of --lora-format diffusers|kohya, --merge"),
    (lambda t: [str(t / "run"), "--merge", "--single-file", "--out", str(t / "o")], "choose one of"),
    (lambda t: [str(t / "nope"), "--merge", "--out", str(t / "o")], "nope: not a directory"),
    (lambda t: [str(t / "full"), "--lora-format", "kohya", "--out", str(t / "o.safetensors")],
     "is a full fine-tuning run, it has no LoRA"),
    (lambda t: [str(t / "run"), "--lora-format", "kohya", "--out", str(t / "o.bin")],
     "o.bin: this export is one file; give it the .safetensors suffix"),
    (lambda t: [str(t / "empty"), "--merge", "--out", str(t / "o")], "empty: not a finished imagegen run"),
], ids=["no-form", "two-forms", "missing-run", "kohya-of-full-run", "not-safetensors", "unfinished-run"])
def test_bad_exports_are_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "run" / "lora").mkdir(parents=True)
    reference(SD3_TINY).save_pretrained(tmp_path / "full" / "transformer")
    (tmp_path / "empty").mkdir()
    base = tmp_path / "base"
    save_pretrained(load_pretrained(tmp_path / "full" / "transformer"), base)
    model = load_pretrained(base)
    apply_lora(model, LORA, target_modules(model, FAMILY.resolve_lora_targets(("to_q",))))
    save_lora(model, LORA, tmp_path / "run" / "lora")
    (tmp_path / "run" / "config.toml").write_text(f'[model]\npath = "{base}"\n')
    assert main(["imagegen", "export", *argv(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atelier: error: ") and message in err[0], err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.safetensors").exists()
