"""imagegen/qwen_image.py + imagegen/hf.py + imagegen/lora.py against diffusers' QwenImageTransformer2DModel on the
same weights (tiny random configs, fp32 on the CPU): forward and every gradient with and without a text mask, the
RoPE positions, the checkpoint both ways, the named sizes, the FLOP count, the fused kernels, the registry, and the
LoRA file QwenImagePipeline.load_lora_weights reads."""

import dataclasses
import json

import pytest
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from atelier_studio.flows.cli import main
from atelier_studio.imagegen import registry
from atelier_studio.imagegen.hf import WEIGHTS_NAME, init_random, load_pretrained, read_args, save_pretrained
from atelier_studio.imagegen.lora import apply_lora, load_lora, save_lora, target_modules
from atelier_studio.imagegen.qwen_image import (
    FAMILY,
    LORA_ATTENTION,
    SIZES,
    QwenImage,
    QwenImageArgs,
    diffusers_forward,
    positions,
    rope_tables,
)
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.lora import LoraArgs, lora_layers

from tests.kernels._compare import rounding_tolerance

TINY = SIZES["qwen-image-tiny"]
RESOLUTIONS = [(8, 8), (6, 10)]  # latents: a square 4x4 and a non-square 3x5 token grid (odd: the centring's case)
# Qwen/Qwen-Image transformer/config.json
HUB = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
           num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=[16, 56, 56])


def diffusers_kwargs(args: QwenImageArgs) -> dict:
    return {k: v for k, v in args.to_diffusers_config().items() if not k.startswith("_")}


def reference(args: QwenImageArgs, seed: int = 0) -> QwenImageTransformer2DModel:
    """diffusers' model with every parameter random (the RMSNorm weights too, so none is silently unused)."""
    torch.manual_seed(seed)
    ref = QwenImageTransformer2DModel(**diffusers_kwargs(args)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return ref


def inputs(args: QwenImageArgs, H: int, W: int, B: int = 2, L: int = 7, seed: int = 1, masked: bool = True):
    """(latents, text states, text mask or None, timestep sigma*1000): Atelier's forward arguments. The mask pads
    the second prompt after 4 tokens, as QwenImagePipeline pads a batch's shorter prompt."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1:, 4:] = 0
    return (torch.randn(B, args.in_channels, H, W, generator=g),
            torch.randn(B, L, args.joint_attention_dim, generator=g), mask if masked else None,
            torch.rand(B, generator=g) * 1000)


def reference_forward(ref: QwenImageTransformer2DModel, latents, text, mask, timestep) -> torch.Tensor:
    """diffusers' forward as QwenImagePipeline calls it (its own packing, img_shapes and sigma), then unpacked."""
    B, C, H, W = latents.shape
    out = ref(hidden_states=QwenImagePipeline._pack_latents(latents, B, C, H, W), encoder_hidden_states=text,
              encoder_hidden_states_mask=mask, timestep=timestep / 1000, img_shapes=[[(1, H // 2, W // 2)]] * B).sample
    return QwenImagePipeline._unpack_latents(out, H * 8, W * 8, 8)[:, :, 0]  # [B, C, 1, H, W]: one frame


def tolerance(expected: torch.Tensor, depth: int) -> float:
    """Two fp32 computations of the same network that sum in other orders (the RoPE layout permutes the head dim
    inside attention's dot products): `depth` roundings of the output's scale per element, at most."""
    return rounding_tolerance(expected, torch.float32, depth)


# 2 blocks of about 8 sequential roundings at the output's scale each, as FLUX's 4 (measured: 2 eps x max for the
# output); gradients' chains are ~4x deeper. A wrong op is off by O(1) of the scale.
DEPTH = 2 * 8


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "unmasked"])
@pytest.mark.parametrize("hw", RESOLUTIONS, ids=["square", "nonsquare"])
def test_forward_and_gradients_match_diffusers(hw, masked):
    ref = reference(TINY)
    model = QwenImage(TINY)
    model.load_state_dict(ref.state_dict(), strict=True)
    x = inputs(TINY, *hw, masked=masked)
    out, expected = model(*x), reference_forward(ref, *x)
    assert out.shape == expected.shape == x[0].shape
    assert (out - expected).abs().max() <= tolerance(expected, DEPTH)
    # every parameter's gradient, of a loss that weights each output element differently
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * w).sum().backward()
    (expected * w).sum().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, r = grad(p), grad(ref_grads[name])
        assert r.any() != name.startswith(LAST_TEXT_ONLY), name
        assert (g - r).abs().max() <= tolerance(r, DEPTH * 4), name


def grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)  # None: not in the graph at all


# The last block's text output is read by nothing (only the image stream reaches proj_out), in diffusers as here:
# what only makes it gets no gradient in either model.
LAST_TEXT_ONLY = tuple(f"transformer_blocks.{TINY.num_layers - 1}.{p}."
                       for p in ("attn.add_q_proj", "attn.norm_added_q", "attn.to_add_out", "txt_mlp"))


@torch.no_grad()
def test_padded_text_is_never_attended():
    """What the mask hides does not reach the image: changing the padded states leaves the output as it was."""
    model = QwenImage(TINY)
    model.load_state_dict(reference(TINY).state_dict(), strict=True)
    latents, text, mask, t = inputs(TINY, 6, 10)
    other = text.clone()
    other[1, 4:] = torch.randn_like(other[1, 4:])
    assert torch.equal(model(latents, text, mask, t), model(latents, other, mask, t))
    assert not torch.equal(model(latents, text, None, t), model(latents, other, None, t))


def test_rope_positions_are_qwen_embed_ropes():
    """The centred image grid and the text after it, against diffusers' QwenEmbedRope tables (complex, interleaved
    pairs) taken to the kernel's rotate-half layout."""
    ref = QwenImageTransformer2DModel(**diffusers_kwargs(TINY)).pos_embed
    for h, w in ((3, 5), (4, 4)):
        img, txt = ref([(1, h, w)], max_txt_seq_len=7, device=torch.device("cpu"))  # complex [N, Dh/2], [L, Dh/2]
        freqs = torch.cat([txt, img])  # [S, Dh/2], text first
        cos, sin = rope_tables(positions(7, h, w), TINY.axes_dims_rope)
        # the same fp32 angles; torch.polar's sin/cos and Tensor.cos/sin may round the last bit differently
        eps = torch.finfo(torch.float32).eps
        torch.testing.assert_close(cos, torch.cat([freqs.real, freqs.real], dim=-1), rtol=0, atol=2 * eps)
        torch.testing.assert_close(sin, torch.cat([freqs.imag, freqs.imag], dim=-1), rtol=0, atol=2 * eps)


@torch.no_grad()
def test_checkpoint_round_trips_through_diffusers(tmp_path):
    model = QwenImage(TINY)
    for p in model.parameters():  # init_weights zeroes AdaLN; perturb so outputs are non-trivial
        p.add_(0.05 * torch.randn_like(p))
    out_dir = save_pretrained(model, tmp_path / "qwen")
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", WEIGHTS_NAME]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["_class_name"] == "QwenImageTransformer2DModel"
    assert (config["in_channels"], config["out_channels"]) == (16, 4)  # diffusers': packed in, latent out
    ref, info = QwenImageTransformer2DModel.from_pretrained(out_dir, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    x = inputs(TINY, 8, 8)
    expected = reference_forward(ref.eval(), *x)
    assert (model(*x) - expected).abs().max() <= tolerance(expected, DEPTH)
    # and back: diffusers' own save loads into Atelier's model, of the Qwen-Image family (a pipeline's transformer/)
    ref.save_pretrained(tmp_path / "pipe" / "transformer")
    again = load_pretrained(tmp_path / "pipe")
    assert type(again) is QwenImage and again.args == TINY
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("name", sorted(SIZES))
def test_named_sizes_contract(name):
    """Every named size: its config round-trips (the published one for qwen-image), and at tiny width the model has
    diffusers' exact keys and shapes and gives finite gradients everywhere."""
    args = SIZES[name]
    assert QwenImageArgs.from_diffusers_config(args.to_diffusers_config()) == args
    if name == "qwen-image":
        assert QwenImageArgs.from_diffusers_config(HUB) == args
    small = dataclasses.replace(args, num_layers=min(args.num_layers, 2), num_heads=2, head_dim=8,
                                axes_dims_rope=(2, 2, 4), joint_attention_dim=12)
    ref_shapes = {k: v.shape for k, v in QwenImageTransformer2DModel(**diffusers_kwargs(small)).state_dict().items()}
    model = QwenImage(small)
    assert {k: v.shape for k, v in model.state_dict().items()} == ref_shapes
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    model(*inputs(small, 4, 6)).square().mean().backward()
    for n, p in model.named_parameters():
        assert grad(p).isfinite().all() and grad(p).any() != n.startswith(LAST_TEXT_ONLY), n


def test_init_weights_is_adaln_zero():
    model = QwenImage(TINY)
    adaln = [m[1] for b in model.transformer_blocks for m in (b.img_mod, b.txt_mod)]
    assert len(adaln) == 4 and not any(lin.weight.any() or lin.bias.any() for lin in adaln)  # every block starts as id
    assert model.transformer_blocks[0].attn.to_q.weight.std() > 0
    out = model(*inputs(TINY, 8, 8))
    assert torch.equal(out, torch.zeros_like(out))  # DiT: the zero-init final layer outputs 0


def test_train_flops_matches_flop_counter():
    """The model's own count against FlopCounterMode (attention on the math backend, which it counts as bmm's)."""
    model = QwenImage(TINY)
    latents, text, _, t = inputs(TINY, 6, 10, B=3, L=5)
    N, L = 3 * 5, 5
    predicted = model.train_flops(3, N, L)
    for x in (latents, text):
        x.requires_grad_(True)
    with FlopCounterMode(display=False) as full, sdpa_kernel(SDPBackend.MATH):
        model(latents, text, None, t).sum().backward()
    # backward = 2 x forward for matmuls and attention, up to the sinusoid features (no input gradient there)
    assert abs(full.get_total_flops() - predicted) <= 0.02 * predicted
    _, attn = model.forward_flops(3, N, L)
    assert attn == 3 * 4 * (N + L) ** 2 * TINY.dim * TINY.num_layers


def test_kernels_on_equals_kernels_off():
    """The Triton kernels (CPU: the interpreter) and the references give the same output and gradients in fp32,
    RoPE's half layout and the text RMSNorm's odd width included."""
    ref = reference(TINY)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for kernels in ("ref", "triton"):
        model = QwenImage(dataclasses.replace(TINY, kernels=kernels)).to(dev)
        model.load_state_dict(ref.state_dict(), strict=True)
        x = [t.to(dev) for t in inputs(TINY, 6, 10)]
        out = model(*x)
        out.square().mean().backward()
        runs.append((out.detach(), {n: grad(p) for n, p in model.named_parameters()}))
    (out_ref, grads_ref), (out_tri, grads_tri) = runs
    assert (out_tri - out_ref).abs().max() <= tolerance(out_ref, DEPTH)
    for n, g in grads_ref.items():
        assert (grads_tri[n] - g).abs().max() <= tolerance(g, DEPTH * 4), n


def test_bad_inputs_and_configs_say_what(tmp_path):
    model = QwenImage(TINY)
    latents, text, mask, t = inputs(TINY, 8, 8)
    with pytest.raises(ValueError, match="must be even"):
        model(latents[..., :7], text, mask, t)
    with pytest.raises(ValueError, match=r"text_mask must be \[2, 7\]"):
        model(latents, text, mask[:, :5], t)
    with pytest.raises(ValueError, match=r"axes_dims_rope.*must sum to head_dim = 16"):
        QwenImageArgs(axes_dims_rope=(4, 4, 4))
    with pytest.raises(ValueError, match=r"c.json: in_channels 6 must be a positive multiple of 4"):
        QwenImageArgs.from_diffusers_config({**HUB, "in_channels": 6}, "c.json")
    with pytest.raises(ValueError, match=r"c.json: patch_size 1: only 2"):
        QwenImageArgs.from_diffusers_config({**HUB, "patch_size": 1}, "c.json")
    with pytest.raises(ValueError, match=r"c.json: \['zero_cond_t'\] must be false"):
        QwenImageArgs.from_diffusers_config({**HUB, "zero_cond_t": True}, "c.json")
    d = tmp_path / "m"
    init_random("qwen-image-tiny", d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_layer": 3}))
    with pytest.raises(ModelLoadError, match=r"config.json: unknown QwenImageTransformer2DModel field\(s\) "
                                             r"\['num_layer'\]"):
        read_args(d)


def test_the_family_is_registered_and_init_writes_each_size(tmp_path, capsys):
    assert registry.family_of_class_name("QwenImageTransformer2DModel", "config.json") is FAMILY
    assert registry.family_of_size("qwen-image") is FAMILY and registry.family_of_size("qwen-image-tiny") is FAMILY
    assert FAMILY.diffusers_reference() is QwenImageTransformer2DModel
    model = QwenImage(TINY)
    assert registry.family_of_args(model.args) is FAMILY
    assert FAMILY.blocks(model) == list(model.transformer_blocks)
    assert FAMILY.train_flops(model, 2, 16, 7) == model.train_flops(2, 16, 7)
    assert FAMILY.guidance_kwargs(TINY, 4.0, 2, torch.device("cpu")) == {} and FAMILY.sampling_cfg(4.0, TINY) == 4.0
    assert main(["imagegen", "init", "--size", "qwen-image-tiny", "--out", str(tmp_path / "m"),
                 "--dtype", "float32"]) == 0
    assert "Qwen-Image qwen-image-tiny" in capsys.readouterr().out
    loaded = load_pretrained(tmp_path / "m")
    assert type(loaded) is QwenImage and loaded.args == TINY
    ref, info = QwenImageTransformer2DModel.from_pretrained(tmp_path / "m", output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []


# ------------------------------------------------------------------------------------------------ LoRA

def test_lora_targets_cover_both_streams():
    assert FAMILY.resolve_lora_targets(()) == LORA_ATTENTION
    model = QwenImage(TINY)
    names = target_modules(model, FAMILY.resolve_lora_targets(("to_q", "add_v_proj", "txt_mlp.net.2", "img_mod.1")))
    assert names == [f"transformer_blocks.{i}.{p}" for i in range(2)
                     for p in ("attn.to_q", "attn.add_v_proj", "txt_mlp.net.2", "img_mod.1")]


@pytest.mark.parametrize("targets", [(), ("to_q", "to_v", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mod.1")],
                         ids=["attention", "mixed"])
def test_load_lora_weights_gives_atelier_outputs(targets, tmp_path):
    """QwenImagePipeline.load_lora_weights reads the file Atelier writes, wraps exactly Atelier's modules with
    Atelier's scale, and its transformer predicts what Atelier's does."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from peft.tuners.lora import LoraLayer

    lora = LoraArgs(rank=4, alpha=8.0)
    ref = reference(TINY)
    model = QwenImage(TINY)
    model.load_state_dict(ref.state_dict(), strict=True)
    apply_lora(model, lora, target_modules(model, FAMILY.resolve_lora_targets(targets)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in lora_layers(model).values():  # a fresh adapter is the identity and would test nothing
            m.lora_B.weight.normal_(0, 0.1, generator=g)
    out = save_lora(model, lora, tmp_path / "lora")

    pipe = QwenImagePipeline(transformer=reference(TINY), scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                             text_encoder=None, tokenizer=None)
    x = inputs(TINY, 6, 10)
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
    again = QwenImage(TINY)
    again.load_state_dict(ref.state_dict(), strict=True)
    assert load_lora(again, out) == lora
    with torch.no_grad():
        assert torch.equal(again(*x), want)


def test_the_familys_diffusers_call_is_qwen_image_pipelines():
    """FAMILY.diffusers_forward (the bench's peer call) feeds diffusers what QwenImagePipeline feeds it."""
    ref = reference(TINY)
    x = inputs(TINY, 6, 10)
    with torch.no_grad():
        assert torch.equal(diffusers_forward(ref, *x), reference_forward(ref, *x))
        assert FAMILY.diffusers_forward is diffusers_forward
