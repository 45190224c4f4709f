"""imagegen/flux.py + imagegen/hf.py + imagegen/lora.py against diffusers' FluxTransformer2DModel on the same weights
(tiny random configs, fp32 on the CPU): forward and every gradient, the packing and ids of FluxPipeline, the
checkpoint both ways, the named sizes, the FLOP count, the fused kernels, the registry, and the LoRA file
FluxPipeline.load_lora_weights reads."""

import dataclasses
import json
import re

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from atelier_studio.flows.cli import main
from atelier_studio.imagegen import registry
from atelier_studio.imagegen.flux import FAMILY, LORA_ATTENTION, SIZES, Flux, FluxArgs, pack, unpack
from atelier_studio.imagegen.hf import WEIGHTS_NAME, init_random, load_pretrained, read_args, save_pretrained
from atelier_studio.imagegen.lora import apply_lora, load_lora, save_lora, target_modules
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.lora import LoraArgs, lora_layers

from tests.kernels._compare import rounding_tolerance

DEV = SIZES["flux-tiny"]
SCHNELL = dataclasses.replace(DEV, guidance_embeds=False)
RESOLUTIONS = [(8, 8), (6, 10)]  # latents: a square 4x4 and a non-square 3x5 token grid
# black-forest-labs/FLUX.1-dev transformer/config.json (schnell's differs only in guidance_embeds: false)
HUB_DEV = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
               attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
               guidance_embeds=True, axes_dims_rope=[16, 56, 56])


def diffusers_kwargs(args: FluxArgs) -> dict:
    return {k: v for k, v in args.to_diffusers_config().items() if not k.startswith("_")}


def reference(args: FluxArgs, seed: int = 0) -> FluxTransformer2DModel:
    """diffusers' model with every parameter random (the RMSNorm weights too, so none is silently unused)."""
    torch.manual_seed(seed)
    ref = FluxTransformer2DModel(**diffusers_kwargs(args)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return ref


def inputs(args: FluxArgs, H: int, W: int, B: int = 2, L: int = 7, seed: int = 1):
    """(latents, text states, pooled, timestep sigma*1000, guidance or None): Atelier's forward arguments."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, args.in_channels, H, W, generator=g),
            torch.randn(B, L, args.joint_attention_dim, generator=g),
            torch.randn(B, args.pooled_projection_dim, generator=g), torch.rand(B, generator=g) * 1000,
            torch.full((B,), 3.5) if args.guidance_embeds else None)


def reference_forward(ref: FluxTransformer2DModel, latents, text, pooled, timestep, guidance) -> torch.Tensor:
    """diffusers' forward as FluxPipeline calls it: packed latents, its ids, sigma (not *1000), then unpacked."""
    B, C, H, W = latents.shape
    img_ids = FluxPipeline._prepare_latent_image_ids(B, H // 2, W // 2, latents.device, latents.dtype)
    txt_ids = torch.zeros(text.shape[1], 3)
    out = ref(hidden_states=FluxPipeline._pack_latents(latents, B, C, H, W), encoder_hidden_states=text,
              pooled_projections=pooled, timestep=timestep / 1000, img_ids=img_ids, txt_ids=txt_ids,
              guidance=guidance).sample
    return FluxPipeline._unpack_latents(out, H * 8, W * 8, 8)  # a VAE factor of 8: H*8 pixels are H latents


def tolerance(expected: torch.Tensor, depth: int) -> float:
    """Two fp32 computations of the same network that sum in other orders (the RoPE layout permutes the head dim
    inside attention's dot products): `depth` roundings of the output's scale per element, at most."""
    return rounding_tolerance(expected, torch.float32, depth)


# 4 blocks of about 8 sequential roundings at the output's scale each (measured: 1.6 eps x max for the output, 10 for
# the worst gradient, whose chain is ~4x deeper); a wrong op is off by O(1) of the scale.
DEPTH = 4 * 8


@pytest.mark.parametrize("args", [DEV, SCHNELL], ids=["dev", "schnell"])
@pytest.mark.parametrize("hw", RESOLUTIONS, ids=["square", "nonsquare"])
def test_forward_and_gradients_match_diffusers(args, hw):
    ref = reference(args)
    model = Flux(args)
    model.load_state_dict(ref.state_dict(), strict=True)
    x = inputs(args, *hw)
    out, expected = model(*x), reference_forward(ref, *x)
    assert out.shape == expected.shape == x[0].shape
    assert (out - expected).abs().max() <= tolerance(expected, DEPTH)
    # every parameter's gradient, of a loss that weights each output element differently
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * w).sum().backward()
    (expected * w).sum().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, r = p.grad, ref_grads[name].grad
        assert g is not None and r is not None and r.any(), name
        assert (g - r).abs().max() <= tolerance(r, DEPTH * 4), name


def test_packing_and_ids_are_flux_pipelines():
    latents = torch.randn(2, 4, 6, 10)
    packed = pack(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 4, 6, 10))
    assert torch.equal(unpack(packed, 6, 10), latents)


@torch.no_grad()
def test_checkpoint_round_trips_through_diffusers(tmp_path):
    model = Flux(DEV)
    for p in model.parameters():  # init_weights zeroes AdaLN; perturb so outputs are non-trivial
        p.add_(0.05 * torch.randn_like(p))
    out_dir = save_pretrained(model, tmp_path / "flux")
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", WEIGHTS_NAME]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["_class_name"] == "FluxTransformer2DModel" and config["in_channels"] == 16
    ref, info = FluxTransformer2DModel.from_pretrained(out_dir, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    x = inputs(DEV, 8, 8)
    expected = reference_forward(ref.eval(), *x)
    assert (model(*x) - expected).abs().max() <= tolerance(expected, DEPTH)
    # and back: diffusers' own save loads into Atelier's model, of the FLUX family (a pipeline's transformer/ too)
    ref.save_pretrained(tmp_path / "pipe" / "transformer")
    again = load_pretrained(tmp_path / "pipe")
    assert type(again) is Flux and again.args == DEV
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("name", sorted(SIZES))
def test_named_sizes_contract(name):
    """Every named size: its config round-trips (the published one for dev and schnell), and at tiny width the model
    has diffusers' exact keys and shapes and gives finite gradients everywhere."""
    args = SIZES[name]
    assert FluxArgs.from_diffusers_config(args.to_diffusers_config()) == args
    if name in ("flux-dev", "flux-schnell"):
        assert FluxArgs.from_diffusers_config({**HUB_DEV, "guidance_embeds": name == "flux-dev"}) == args
    small = dataclasses.replace(args, num_layers=min(args.num_layers, 2),
                                num_single_layers=min(args.num_single_layers, 2), num_heads=2, head_dim=8,
                                axes_dims_rope=(2, 2, 4), joint_attention_dim=12,
                                pooled_projection_dim=10)
    ref_shapes = {k: v.shape for k, v in FluxTransformer2DModel(**diffusers_kwargs(small)).state_dict().items()}
    model = Flux(small)
    assert {k: v.shape for k, v in model.state_dict().items()} == ref_shapes
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    model(*inputs(small, 4, 6)).square().mean().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all() and p.grad.any(), n


def test_init_weights_is_adaln_zero():
    model = Flux(DEV)
    adaln = [lin for b in model.transformer_blocks for lin in (b.norm1.linear, b.norm1_context.linear)]
    adaln += [b.norm.linear for b in model.single_transformer_blocks]
    assert len(adaln) == 6 and not any(lin.weight.any() or lin.bias.any() for lin in adaln)  # every block starts as id
    assert model.transformer_blocks[0].attn.to_q.weight.std() > 0
    assert model.single_transformer_blocks[0].proj_mlp.weight.std() > 0
    out = model(*inputs(DEV, 8, 8))
    assert torch.equal(out, torch.zeros_like(out))  # DiT: the zero-init final layer outputs 0


def test_train_flops_matches_flop_counter():
    """The model's own count against FlopCounterMode (attention on the math backend, which it counts as bmm's)."""
    model = Flux(DEV)
    latents, text, pooled, t, g = inputs(DEV, 6, 10, B=3, L=5)
    N, L = 3 * 5, 5
    predicted = model.train_flops(3, N, L)
    for x in (latents, text, pooled):
        x.requires_grad_(True)
    with FlopCounterMode(display=False) as full, sdpa_kernel(SDPBackend.MATH):
        model(latents, text, pooled, t, g).sum().backward()
    # backward = 2 x forward for matmuls and attention, up to the sinusoid features (no input gradient there)
    assert abs(full.get_total_flops() - predicted) <= 0.02 * predicted
    _, attn = model.forward_flops(3, N, L)
    assert attn == 3 * 4 * (N + L) ** 2 * DEV.dim * (DEV.num_layers + DEV.num_single_layers)


def test_kernels_on_equals_kernels_off():
    """The Triton kernels (CPU: the interpreter) and the references give the same output and gradients in fp32,
    RoPE's half-layout included."""
    ref = reference(DEV)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for kernels in ("ref", "triton"):
        model = Flux(dataclasses.replace(DEV, kernels=kernels)).to(dev)
        model.load_state_dict(ref.state_dict(), strict=True)
        x = [t.to(dev) for t in inputs(DEV, 6, 10)]
        out = model(*x)
        out.square().mean().backward()
        runs.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (out_ref, grads_ref), (out_tri, grads_tri) = runs
    assert (out_tri - out_ref).abs().max() <= tolerance(out_ref, DEPTH)
    for n, g in grads_ref.items():
        assert (grads_tri[n] - g).abs().max() <= tolerance(g, DEPTH * 4), n


def test_bad_inputs_and_configs_say_what(tmp_path):
    model = Flux(DEV)
    latents, text, pooled, t, g = inputs(DEV, 8, 8)
    with pytest.raises(ValueError, match=r"guidance must be \[2\], got None"):
        model(latents, text, pooled, t)
    with pytest.raises(ValueError, match="no guidance embedding"):
        Flux(SCHNELL)(latents, text, pooled, t, g)
    with pytest.raises(ValueError, match="must be even"):
        model(latents[..., :7], text, pooled, t, g)
    with pytest.raises(ValueError, match=r"axes_dims_rope.*must sum to head_dim = 16"):
        FluxArgs(axes_dims_rope=(4, 4, 4))
    with pytest.raises(ValueError, match=r"c.json: in_channels 6 must be a positive multiple of 4"):
        FluxArgs.from_diffusers_config({**HUB_DEV, "in_channels": 6}, "c.json")
    with pytest.raises(ValueError, match=r"c.json: patch_size 2: only 1"):
        FluxArgs.from_diffusers_config({**HUB_DEV, "patch_size": 2}, "c.json")
    d = tmp_path / "m"
    init_random("flux-tiny", d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_single_layer": 3}))
    with pytest.raises(ModelLoadError, match=r"config.json: unknown FluxTransformer2DModel field\(s\) "
                                             r"\['num_single_layer'\]"):
        read_args(d)


def test_the_family_is_registered_and_init_writes_each_size(tmp_path, capsys):
    assert registry.family_of_class_name("FluxTransformer2DModel", "config.json") is FAMILY
    assert registry.family_of_size("flux-dev") is FAMILY and registry.family_of_size("flux-schnell") is FAMILY
    assert FAMILY.diffusers_reference() is FluxTransformer2DModel
    model = Flux(DEV)
    assert registry.family_of_args(model.args) is FAMILY
    assert FAMILY.blocks(model) == [*model.transformer_blocks, *model.single_transformer_blocks]
    assert main(["imagegen", "init", "--size", "flux-tiny", "--out", str(tmp_path / "m"), "--dtype", "float32"]) == 0
    assert "FLUX.1 flux-tiny" in capsys.readouterr().out
    loaded = load_pretrained(tmp_path / "m")
    assert type(loaded) is Flux and loaded.args == DEV
    ref, info = FluxTransformer2DModel.from_pretrained(tmp_path / "m", output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and ref.config.guidance_embeds


# ------------------------------------------------------------------------------------------------ LoRA

def test_lora_targets_cover_both_block_types():
    assert FAMILY.resolve_lora_targets(()) == LORA_ATTENTION
    model = Flux(DEV)
    names = target_modules(model, FAMILY.resolve_lora_targets(("to_q", "proj_mlp", "to_add_out")))
    assert names == ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_add_out",
                     "transformer_blocks.1.attn.to_q", "transformer_blocks.1.attn.to_add_out",
                     "single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_mlp",
                     "single_transformer_blocks.1.attn.to_q", "single_transformer_blocks.1.proj_mlp"]


@pytest.mark.parametrize("targets", [(), ("to_q", "to_v", "ff.net.2", "proj_mlp", "proj_out")],
                         ids=["attention", "mixed"])
def test_load_lora_weights_gives_atelier_outputs(targets, tmp_path):
    """FluxPipeline.load_lora_weights reads the file Atelier writes, wraps exactly Atelier's modules (of both block
    types) with Atelier's scale, and its transformer predicts what Atelier's does."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from peft.tuners.lora import LoraLayer

    lora = LoraArgs(rank=4, alpha=8.0)
    ref = reference(DEV)
    model = Flux(DEV)
    model.load_state_dict(ref.state_dict(), strict=True)
    apply_lora(model, lora, target_modules(model, FAMILY.resolve_lora_targets(targets)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in lora_layers(model).values():  # a fresh adapter is the identity and would test nothing
            m.lora_B.weight.normal_(0, 0.1, generator=g)
    out = save_lora(model, lora, tmp_path / "lora")

    pipe = FluxPipeline(transformer=reference(DEV), scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    x = inputs(DEV, 6, 10)
    with torch.no_grad():
        base = reference_forward(pipe.transformer, *x)
    pipe.load_lora_weights(str(out))
    wrapped = {n: m for n, m in pipe.transformer.named_modules() if isinstance(m, LoraLayer)}
    assert sorted(wrapped) == sorted(lora_layers(model))
    assert {m.scaling[next(iter(m.scaling))] for m in wrapped.values()} == {lora.scale}
    with torch.no_grad():
        want, got = model(*x), reference_forward(pipe.transformer, *x)
    assert (want - base).abs().max() > 0.05  # the adapters change the output ...
    assert (got - want).abs().max() <= tolerance(want, DEPTH)  # ... and diffusers' changes it the same way
    # and back: Atelier reads the file into a fresh model and predicts the same
    again = Flux(DEV)
    again.load_state_dict(ref.state_dict(), strict=True)
    assert load_lora(again, out) == lora
    with torch.no_grad():
        assert torch.equal(again(*x), want)


def test_the_familys_diffusers_call_is_flux_pipelines():
    """FAMILY.diffusers_forward (the bench's peer call) feeds diffusers what FluxPipeline feeds it."""
    ref = reference(DEV)
    x = inputs(DEV, 6, 10)
    with torch.no_grad():
        assert torch.equal(FAMILY.diffusers_forward(ref, *x[:4], guidance=x[4]), reference_forward(ref, *x))


@pytest.mark.parametrize("field,value,words", [
    ("num_heads", 0, "0: must be a positive int"), ("joint_attention_dim", True, "must be a positive int"),
    ("axes_dims_rope", (4, 6), "must be 3 positive even ints"), ("axes_dims_rope", (5, 5, 6), "positive even ints"),
    ("kernels", "cuda", "'cuda': must be one of"), ("attention", "sdpa", "must be one of"),
])
def test_both_rope_families_check_their_args_alike(field, value, words):
    """FLUX.1 and Qwen-Image share their args' checks (imagegen/layers.py check_rope_args): one message, the class
    named."""
    from atelier_studio.imagegen.qwen_image import QwenImageArgs

    for cls in (FluxArgs, QwenImageArgs):
        with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{field}=.*{re.escape(words)}"):
            cls(**{field: value})
    with pytest.raises(ValueError, match="FluxArgs.guidance_embeds=1: must be true or false"):
        FluxArgs(guidance_embeds=1)


@pytest.mark.parametrize("attention, masked, device, cudnn", [
    ("auto", False, "meta", False), ("auto", True, "meta", True), ("cudnn", False, "meta", True),
    ("auto", False, "cpu", True)], ids=["auto-unmasked", "auto-masked", "pinned-cudnn", "cpu"])
def test_auto_attention_leaves_cudnn_out_only_without_a_mask(monkeypatch, attention, masked, device, cudnn):
    """FLUX.1's unmasked joint attention under attention = "auto" off the CPU (meta stands in for the GPU) runs with
    PyTorch's cuDNN SDPA backend switched off (its backward fails at FLUX.1-dev's 1024 px shape on the GPU); a masked
    call (Qwen-Image's padded text), a pinned "cudnn" and the CPU keep it. The flags are read inside the SDPA call."""
    from atelier_studio.imagegen.layers import rope_attention

    seen = []

    def spy(q, k, v, attn_mask=None):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return torch.zeros_like(q)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    B, S, Hn, Dh = 2, 5, 2, 8
    q, k, v = (torch.randn(B, S, Hn, Dh, device=device) for _ in range(3))
    cos, sin = torch.ones(S, Dh, device=device), torch.zeros(S, Dh, device=device)
    mask = torch.ones(B, S, dtype=torch.bool, device=device) if masked else None
    assert rope_attention(q, k, v, cos, sin, "ref", attention, mask).shape == (B, S, Hn * Dh)
    assert seen == [(cudnn, attention == "auto")]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the call
