"""MMDiT LoRA (imagegen/lora.py) against diffusers + PEFT on the same weights: the file
`StableDiffusion3Pipeline.load_lora_weights` reads, training parity, FLOPs; and through the CLI on tiny SD3 / SD3.5
pipelines: cache -> LoRA train -> the exported pipeline/ (base + LoRA) renders what `atelier imagegen sample` renders,
and a resumed run equals an uninterrupted one.

Tolerances (fp32 on the CPU):
- one forward, Atelier's MMDiT with its LoRA layers vs diffusers' with PEFT's: the same math in other orders (PEFT
  adds base and adapter outputs after the fact, Atelier's reference adds inside one fp32 expression); the models
  alone agree to 1e-5 relative (tests/imagegen/test_model.py), and a LoRA term adds two small matmuls: 1e-5;
- training: five AdamW steps at lr 1e-3 on the same batches; the losses (~2) differ by float rounding, carried
  forward by Adam (each coordinate steps by up to lr whatever its gradient's size): 1e-5 relative per loss, and
  the adapters within 1e-4 of lr-sized steps (a wrong gradient moves them by O(lr) = 1e-3 at once);
- the fused LoRA kernel (lora_linear's Function) vs its plain reference inside the model: fp32 sums in another
  order, 1e-5 relative on the output and every adapter gradient;
- sampled latents and PNGs: as tests/imagegen/test_sd3_pipeline.py (1e-4 relative after 3 CFG steps; 8-bit
  rounding of the same pixels one level apart at most).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from atelier_studio.imagegen.flow import FlowArgs, add_noise, flow_loss
from atelier_studio.imagegen.lora import LORA_FILE, apply_lora, load_lora, read_lora, save_lora, target_modules
from atelier_studio.imagegen.model import FAMILY, LORA_ATTENTION, MMDiT
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.lora import LoraArgs, LoRALinear, lora_layers

from tests.imagegen._sd3 import MAX_SEQUENCE_LENGTH, RESOLUTION, SD3_CONFIG, build_pipeline, build_shards, load_pipeline
from tests.imagegen.test_model import SD3_TINY, SD35_TINY, inputs, reference, rel_err
from tests.imagegen.test_sd3_pipeline import GUIDANCE, PROMPTS, SEED, STEPS, run_cli, sets

ARGS = {"sd3": SD3_TINY, "sd3.5": SD35_TINY}
LORAS = {
    "attention": (LoraArgs(rank=4, alpha=8.0), ()),
    "mixed-rslora": (LoraArgs(rank=3, alpha=6.0, rslora=True), ("to_q", "attn.to_add_out", "ff.net.2",
                                                                 "ff_context.net.0.proj")),
}


def lora_model(args, lora: LoraArgs, names: tuple[str, ...], seed: int = 0) -> MMDiT:
    """An MMDiT with diffusers' reference weights (every tensor random) and LoRA layers whose B is random too (a fresh
    adapter is the identity and would test nothing)."""
    model = MMDiT(args).eval()
    model.load_state_dict(reference(args, seed).state_dict(), strict=True)
    apply_lora(model, lora, target_modules(model, FAMILY.resolve_lora_targets(names)))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.weight.normal_(0, 0.1, generator=g)
    return model


def diffusers_pipeline(transformer):
    """A StableDiffusion3Pipeline around one transformer (the text encoders and VAE play no part here)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                                    text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                    text_encoder_3=None, tokenizer_3=None)


# ----------------------------------------------------------------------------- the file diffusers reads


def test_targets_resolve_like_peft_and_skip_what_a_block_lacks():
    assert FAMILY.resolve_lora_targets(()) == LORA_ATTENTION
    assert FAMILY.resolve_lora_targets(("to_q",)) == ("attn.to_q", "attn2.to_q")
    assert FAMILY.resolve_lora_targets(("attn.to_q", "ff.net.2")) == ("attn.to_q", "ff.net.2")
    with pytest.raises(ValueError, match=r"\['to_x'\] match no MMDiT linear .*attn.to_q"):
        FAMILY.resolve_lora_targets(("to_q", "to_x"))
    model = MMDiT(SD35_TINY)  # 3 layers, dual attention in 0 and 1; the last has no text output
    names = target_modules(model, FAMILY.resolve_lora_targets(("add_q_proj", "to_add_out", "attn2.to_k",
                                                                "ff_context.net.2")))
    assert names == ["transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.attn.to_add_out",
                     "transformer_blocks.0.attn2.to_k", "transformer_blocks.0.ff_context.net.2",
                     "transformer_blocks.1.attn.add_q_proj", "transformer_blocks.1.attn.to_add_out",
                     "transformer_blocks.1.attn2.to_k", "transformer_blocks.1.ff_context.net.2"]  # block 2: none


@pytest.mark.parametrize("variant", ["sd3", "sd3.5"])
@pytest.mark.parametrize("which", list(LORAS))
def test_load_lora_weights_gives_atelier_outputs(variant, which, tmp_path):
    """StableDiffusion3Pipeline.load_lora_weights reads the file Atelier writes, wraps exactly Atelier's modules with
    Atelier's scale, warns about nothing, and its transformer predicts what Atelier's does."""
    args = ARGS[variant]
    lora, names = LORAS[which]
    model = lora_model(args, lora, names)
    out = save_lora(model, lora, tmp_path / "lora")
    assert sorted(p.name for p in out.iterdir()) == [LORA_FILE]

    pipe = diffusers_pipeline(reference(args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.load_lora_weights(str(out))
    assert not [w for w in caught if "LoRA" in str(w.message) or "PEFT" in str(w.message)], caught
    from peft.tuners.lora import LoraLayer

    wrapped = {n: m for n, m in pipe.transformer.named_modules() if isinstance(m, LoraLayer)}
    assert sorted(wrapped) == sorted(lora_layers(model))
    assert {m.scaling[next(iter(m.scaling))] for m in wrapped.values()} == {lora.scale}

    x = inputs(args, 12, 20)
    with torch.no_grad():
        want = model(*x)
        got = pipe.transformer(*x).sample
    assert want.abs().mean() > 0.05
    assert rel_err(got, want) <= 1e-5  # module docstring

    # and Atelier's own reader gives back the same layers and weights
    again = MMDiT(args).eval()
    again.load_state_dict(reference(args).state_dict())
    assert load_lora(again, out) == lora
    with torch.no_grad():
        assert torch.equal(again(*x), want)


def test_the_file_is_diffusers_layout_with_its_config(tmp_path):
    lora = LoraArgs(rank=2, alpha=5.0, dropout=0.1)
    model = lora_model(SD3_TINY, lora, ("attn.to_q", "ff.net.0.proj"))
    f = save_lora(model, lora, tmp_path / "l") / LORA_FILE
    with safe_open(str(f), framework="pt") as sf:
        keys, meta = sorted(sf.keys()), json.loads(sf.metadata()["lora_adapter_metadata"])
    layers = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.1.attn.to_q",
              "transformer_blocks.1.ff.net.0.proj"]
    assert keys == sorted(f"transformer.{n}.lora_{ab}.weight" for n in layers for ab in "AB")
    assert meta == {"transformer.r": 2, "transformer.lora_alpha": 5.0, "transformer.lora_dropout": 0.1,
                    "transformer.use_rslora": False, "transformer.target_modules": layers, "transformer.bias": "none"}
    tensors = load_file(f)
    assert tensors["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"].dtype == torch.float32


def test_a_file_without_metadata_reads_as_diffusers_reads_it(tmp_path):
    """diffusers takes alpha = r when the file has no LoRA config (its scripts' older files): so does Atelier."""
    from safetensors.torch import save_file

    lora = LoraArgs(rank=4, alpha=4.0)
    model = lora_model(SD3_TINY, lora, ())
    tensors = {f"transformer.{n}.lora_{ab}.weight": getattr(m, f"lora_{ab}").weight.detach().bfloat16()
               for n, m in lora_layers(model).items() for ab in "AB"}
    save_file(tensors, tmp_path / LORA_FILE)
    args, weights = read_lora(tmp_path)
    assert (args.rank, args.alpha, args.dtype) == (4, 4.0, "bfloat16") and len(weights) == len(tensors)


def test_bad_lora_files_name_the_problem(tmp_path):
    from safetensors.torch import save_file

    def file(name: str, tensors: dict, meta: dict | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, d / LORA_FILE, metadata=meta)
        return d

    a, b = torch.randn(4, 32), torch.randn(32, 4)
    blk = "transformer.transformer_blocks.0.attn"
    cases = [
        (file("te", {"text_encoder.layer.lora_A.weight": a}), r"'text_encoder.layer.lora_A.weight' is not a "
                                                               r"transformer LoRA weight"),
        (file("ranks", {f"{blk}.to_q.lora_A.weight": a, f"{blk}.to_q.lora_B.weight": b,
                        f"{blk}.to_k.lora_A.weight": a[:2].clone(),
                        f"{blk}.to_k.lora_B.weight": b[:, :2].contiguous()}),
         r"ranks \[2, 4\]"),
        (file("dora", {f"{blk}.to_q.lora_A.weight": a, f"{blk}.to_q.lora_B.weight": b},
              {"lora_adapter_metadata": json.dumps({"transformer.use_dora": True})}), r"use_dora = True"),
        (file("half", {f"{blk}.to_q.lora_A.weight": a}), r"lora_B.weight is missing"),
        (file("where", {"transformer.pos_embed.proj.lora_A.weight": a, "transformer.pos_embed.proj.lora_B.weight": b}),
         r"pos_embed.proj is not a linear a LoRA of this MMDiT may wrap"),
        (file("size", {f"{blk}.to_q.lora_A.weight": torch.randn(4, 48), f"{blk}.to_q.lora_B.weight": b}),
         r"has shape \(4, 48\), this model expects \(4, 32\)"),
    ]
    for path, message in cases:
        model = MMDiT(SD3_TINY)
        with pytest.raises(ModelLoadError, match=message):
            load_lora(model, path)
    with pytest.raises(FileNotFoundError, match=LORA_FILE):
        read_lora(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- training, kernels, FLOPs


def _peft_twin(model: MMDiT, args, lora: LoraArgs):
    """diffusers' SD3Transformer2DModel with PEFT adapters on the same modules, its A and B copied from `model`."""
    from peft import LoraConfig

    ref = reference(args)
    names = list(lora_layers(model))
    ref.add_adapter(LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=names, use_rslora=lora.rslora,
                               lora_dropout=lora.dropout, init_lora_weights=True))
    theirs = dict(ref.named_parameters())
    with torch.no_grad():
        for name, m in lora_layers(model).items():
            for ab in "AB":
                theirs[f"{name}.lora_{ab}.default.weight"].copy_(getattr(m, f"lora_{ab}").weight)
    return ref


@pytest.mark.parametrize("variant", ["sd3", "sd3.5"])
def test_training_matches_diffusers_with_peft(variant):
    args = ARGS[variant]
    lora, names = LORAS["mixed-rslora"]
    model = lora_model(args, lora, names)
    ref = _peft_twin(model, args, lora)
    ours = [p for p in model.parameters() if p.requires_grad]
    theirs = [p for p in ref.parameters() if p.requires_grad]
    assert len(ours) == len(theirs) == 2 * len(lora_layers(model))  # the base is frozen on both sides
    opts = [torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01) for ps in (ours, theirs)]
    model.train()
    ref.train()
    flow = FlowArgs()
    g = torch.Generator().manual_seed(7)
    for step in range(5):
        x0, text, pooled, _ = inputs(args, 12, 20, B=3, seed=10 + step)
        t, noise = torch.rand(3, generator=g), torch.randn(x0.shape, generator=g)
        x_t = add_noise(x0, noise, t)
        losses = []
        for opt, fwd in zip(opts, (lambda: model(x_t, text, pooled, t * 1000),
                                   lambda: ref(x_t, text, pooled, t * 1000).sample)):
            loss = flow_loss(fwd(), x0, noise, t, flow).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), (step, losses)  # module docstring
    theirs = dict(ref.named_parameters())
    for name, m in lora_layers(model).items():
        for ab in "AB":
            # 1% of one step (lr 1e-3): module docstring
            torch.testing.assert_close(getattr(m, f"lora_{ab}").weight, theirs[f"{name}.lora_{ab}.default.weight"],
                                       rtol=0, atol=1e-5)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_fused_lora_kernel_equals_its_reference_in_the_model():
    """kernels="triton" runs the LoRA layers through lora_linear's fused Function (any device) and the model's Triton
    kernels through the interpreter; "ref" the plain references: the same output and adapter gradients."""
    lora, names = LORAS["mixed-rslora"]
    runs = []
    for kernels in ("ref", "triton"):
        args = dataclasses.replace(SD35_TINY, kernels=kernels)
        model = lora_model(args, lora, names)
        assert {m.impl for m in lora_layers(model).values()} == {"fused" if kernels == "triton" else "ref"}
        out = model(*inputs(args, 8, 8))
        out.square().mean().backward()
        runs.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (out_ref, grads_ref), (out_fused, grads_fused) = runs
    assert rel_err(out_fused, out_ref) <= 1e-5
    assert grads_ref.keys() == grads_fused.keys()
    for n, g in grads_ref.items():
        assert g.abs().max() > 0, n
        assert rel_err(grads_fused[n], g) <= 1e-5, n  # module docstring


@pytest.mark.parametrize("variant", ["sd3", "sd3.5"])
def test_lora_train_flops_match_flop_counter(variant):
    """4·N + 6·N_lora: FlopCounterMode sees the forward, every input gradient and only the adapters' weight
    gradients; the count is the full fine-tune's less the frozen base's weight gradients."""
    args = ARGS[variant]
    lora, names = LORAS["mixed-rslora"]
    model = lora_model(args, lora, names)
    latents, text, pooled, t = inputs(args, 12, 20, B=3, L=5)
    N, L = (12 // 2) * (20 // 2), 5
    for x in (latents, text, pooled):  # input gradients everywhere, as the count assumes (docs/mfu.md)
        x.requires_grad_(True)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(latents, text, pooled, t).sum().backward()
    predicted = model.train_flops(3, N, L)
    # the timestep embedder alone gets no input gradient (its input is the sinusoid of t): well under 2%
    assert abs(counter.get_total_flops() - predicted) <= 0.02 * predicted
    full = MMDiT(args)
    mm_base, attn = full.forward_flops(3, N, L)
    mm_lora = model.forward_flops(3, N, L)[0] - mm_base  # the adapters' forward FLOPs
    assert predicted == 2 * mm_base + 3 * mm_lora + 3 * attn
    assert full.train_flops(3, N, L) == 3 * mm_base + 3 * attn


# ----------------------------------------------------------------------------- through the CLI


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return build_shards(tmp_path_factory.getbasetemp() / "sd3-world")


def _losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize("variant", ["sd3", "sd3.5"])
def test_lora_run_exports_a_pipeline_that_renders_as_atelier_samples(variant, tmp_path, shards):
    from atelier_studio.imagegen.autoencoder import SD3VAE
    from atelier_studio.imagegen.sample import load_for_sampling, sample_latents, text_encoder_from_meta

    pipe_dir = build_pipeline(tmp_path / "base", sd35=variant == "sd3.5", seed=11)
    latents, run = tmp_path / "latents", tmp_path / "run"
    common = sets(pipe_dir, shards, latents, run, "lora.rank=4", "lora.alpha=8", "lora.targets=to_q,to_v,ff.net.2",
                  "sample.every=3", "sample.steps=2")
    run_cli("imagegen", "cache", "--config", str(SD3_CONFIG), "--out", str(latents), *common)
    run_cli("imagegen", "train", "--config", str(SD3_CONFIG), *common)
    assert {"imagegen.json", "lora", "lora_ema", "pipeline"} <= {p.name for p in run.iterdir()}
    assert not (run / "transformer").exists() and not (run / "ema").exists()
    # the pipeline: the base transformer untouched (hard-linked), the EMA adapter at its top
    base = load_file(pipe_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    got = load_file(run / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert got.keys() == base.keys() and all(torch.equal(got[k], base[k]) for k in got)
    ema, trained = load_file(run / "lora_ema" / LORA_FILE), load_file(run / "lora" / LORA_FILE)
    exported = load_file(run / "pipeline" / LORA_FILE)
    assert exported.keys() == ema.keys() and all(torch.equal(exported[k], ema[k]) for k in ema)
    assert any(not torch.equal(ema[k], trained[k]) for k in ema)  # the EMA is its own average
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)  # the adapters trained

    # diffusers: from_pretrained + load_lora_weights; Atelier: the same latents from the same directory
    ref = load_pipeline(run / "pipeline")
    ref.load_lora_weights(str(run / "pipeline"))
    gen = lambda: torch.Generator().manual_seed(SEED)  # noqa: E731
    want = ref(PROMPTS, height=RESOLUTION, width=RESOLUTION, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
               max_sequence_length=MAX_SEQUENCE_LENGTH, generator=gen(), output_type="latent").images
    meta = json.loads((run / "imagegen.json").read_text())
    model = load_for_sampling(run / "pipeline", meta, torch.device("cpu"))
    text = text_encoder_from_meta(meta["text"], torch.device("cpu"), run / "pipeline")
    got_latents = sample_latents(model, text, SD3VAE.from_dir(run / "pipeline"), PROMPTS, RESOLUTION, STEPS, GUIDANCE,
                                 SEED, FlowArgs(**meta["flow"]))
    assert rel_err(got_latents, want) <= 1e-4  # module docstring

    # `atelier imagegen sample` on the pipeline and on the run's lora_ema/ writes what diffusers renders
    captions = tmp_path / "prompts.txt"
    captions.write_text("\n".join(PROMPTS) + "\n")
    pngs = ref(PROMPTS, height=RESOLUTION, width=RESOLUTION, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
               max_sequence_length=MAX_SEQUENCE_LENGTH, generator=gen(), output_type="pil").images
    for name, model_dir in (("p", run / "pipeline"), ("l", run / "lora_ema")):
        run_cli("imagegen", "sample", "--model", str(model_dir), "--captions", str(captions), "--out",
                str(tmp_path / name), "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--seed", str(SEED))
        for i, w in enumerate(pngs):
            png = np.asarray(Image.open(tmp_path / name / f"{i:05d}.png"), dtype=int)
            assert np.abs(png - np.asarray(w, dtype=int)).max() <= 1, name  # 8-bit rounding (module docstring)


def test_lora_resume_is_exact_and_the_base_stays_bf16_frozen(tmp_path, tmp_path_factory, shards):
    """A run stopped at step 2 and resumed to 4 equals one run to 4: the adapters, the EMA, the data position and the
    RNG (LoRA dropout and caption dropout draw from it) come back from the checkpoint."""
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.imagegen.task import ImagegenTask
    from atelier_studio.pipeline.config import load_config

    pipe_dir = build_pipeline(tmp_path_factory.getbasetemp() / "sd3-pipe")
    latents = tmp_path / "latents"
    extra = ("lora.rank=4", "lora.dropout=0.2", "text.caption_dropout=0.3", "train.schedule=constant",
             "train.save_every=2", "ema.decay=0.9")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_cli("imagegen", "cache", "--config", str(SD3_CONFIG), "--out", str(latents),
            *sets(pipe_dir, shards, latents, whole, *extra))
    run_cli("imagegen", "train", "--config", str(SD3_CONFIG), *sets(pipe_dir, shards, latents, whole, *extra,
                                                                    "train.max_steps=4"))
    run_cli("imagegen", "train", "--config", str(SD3_CONFIG), *sets(pipe_dir, shards, latents, parts, *extra,
                                                                    "train.max_steps=2"))
    run_cli("imagegen", "train", "--config", str(SD3_CONFIG), *sets(pipe_dir, shards, latents, parts, *extra,
                                                                    "train.max_steps=4"))
    assert _losses(parts) == _losses(whole) and len(_losses(whole)) == 4  # bit for bit: same kernels, same order
    for name in ("lora", "lora_ema"):
        a, b = load_file(whole / name / LORA_FILE), load_file(parts / name / LORA_FILE)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    ckpt = sorted((parts / "checkpoints").iterdir())[-1]
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as sf:
        assert sorted(sf.keys()) and all("lora_" in k for k in sf.keys())  # only the adapters are checkpointed

    # bf16 compute: the frozen base is bf16, the adapters fp32, only the adapters train
    cfg = load_config(ImagegenConfig, SD3_CONFIG, sets(pipe_dir, shards, latents, tmp_path / "bf16", *extra)[1::2]
                      + ["model.dtype=bfloat16"])
    task = ImagegenTask(cfg, torch.device("cpu"))
    for n, p in task.model.named_parameters():
        if "lora_" in n:
            assert p.dtype == torch.float32 and p.requires_grad, n
        else:
            assert p.dtype == torch.bfloat16 and not p.requires_grad, n
    assert isinstance(task.model.transformer_blocks[0].attn.to_q, LoRALinear)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_lora_on_cuda_is_as_close_to_fp32_as_diffusers_with_peft():
    """What the trainer runs on a GPU: the frozen base in bf16, fp32 adapters computed in bf16 under autocast, per-block
    compiled around the fused LoRA and Triton kernels. Its output and every adapter gradient against the same model
    in fp32 are within FlashAttention's rule (2x the error of diffusers + PEFT doing the same in bf16, plus one
    rounding at the result's scale: tests/kernels/_compare.py)."""
    from peft import LoraConfig

    from atelier_studio.pipeline.policies import compile_blocks

    from tests.kernels._compare import assert_error_within

    args = dataclasses.replace(SD35_TINY, num_heads=4, head_dim=64, caption_projection_dim=256)
    lora, names = LoraArgs(rank=8, alpha=16.0), FAMILY.lora_targets  # every attention and feed-forward linear
    exact = lora_model(args, lora, names).cuda()  # fp32, plain references
    x = [t.cuda() for t in inputs(args, 32, 32, B=3, L=20)]

    def adapters_from(model, key):
        return {n: (key(n, "A"), key(n, "B")) for n in lora_layers(model)}

    fast = MMDiT(dataclasses.replace(args, kernels="triton")).cuda()
    fast.load_state_dict(reference(args).state_dict(), strict=True)
    fast.to(torch.bfloat16)
    apply_lora(fast, lora, list(lora_layers(exact)))
    peft = reference(args).cuda().to(torch.bfloat16).requires_grad_(False)
    peft.add_adapter(LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora_layers(exact))))
    theirs = dict(peft.named_parameters())
    with torch.no_grad():
        for name, m in lora_layers(exact).items():
            for ab in "AB":
                src = getattr(m, f"lora_{ab}").weight
                getattr(lora_layers(fast)[name], f"lora_{ab}").weight.copy_(src)
                theirs[f"{name}.lora_{ab}.default.weight"].data = src.detach().clone()  # fp32, as diffusers casts
    compile_blocks(fast)
    results = {}
    for label, model, call in (("exact", exact, lambda: exact(*x)), ("fast", fast, lambda: fast(*x)),
                               ("peft", peft, lambda: peft(*x).sample)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=label != "exact"):
            out = call()
        out.float().square().mean().backward()
        named = dict(model.named_parameters())
        key = (lambda n, ab: named[f"{n}.lora_{ab}.default.weight"].grad) if label == "peft" else \
            (lambda n, ab: named[f"{n}.lora_{ab}.weight"].grad)
        results[label] = (out.float(), adapters_from(exact, key))
    assert_error_within(results["fast"][0], results["exact"][0], results["peft"][0], "output", dtype=torch.bfloat16)
    for name, (ga, gb) in results["exact"][1].items():
        for i, ab in enumerate("AB"):
            assert_error_within(results["fast"][1][name][i], (ga, gb)[i], results["peft"][1][name][i],
                                f"{name} d{ab}", dtype=torch.bfloat16)
