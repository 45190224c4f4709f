"""imagegen/model.py + imagegen/hf.py against diffusers' SD3Transformer2DModel on the same weights."""

import dataclasses
import json

import pytest
import torch
from diffusers import SD3Transformer2DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from atelier_studio.imagegen.hf import INDEX_NAME, WEIGHTS_NAME, init_random, load_pretrained, save_pretrained
from atelier_studio.imagegen.model import SIZES, MMDiT, MMDiTArgs

SD3_TINY = MMDiTArgs(num_layers=2, num_heads=2, head_dim=16, joint_attention_dim=24, caption_projection_dim=32,
                     pooled_projection_dim=20, sample_size=16, pos_embed_max_size=16)
SD35_TINY = dataclasses.replace(SD3_TINY, num_layers=3, qk_norm="rms_norm", dual_attention_layers=(0, 1))
RESOLUTIONS = [(16, 16), (12, 20)]  # square and non-square latents (8x8 and 6x10 token grids)

# transformer/config.json of the stabilityai diffusers repos (as published on the Hub).
HUB_CONFIGS = {
    "sd3-medium": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                       num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                       pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192),
    "sd3.5-medium": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                         num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                         pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                         dual_attention_layers=list(range(13)), qk_norm="rms_norm"),
    "sd3.5-large": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                        num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm"),
}


def diffusers_kwargs(args: MMDiTArgs) -> dict:
    return {k: v for k, v in args.to_diffusers_config().items() if not k.startswith("_")}


def reference(args: MMDiTArgs, seed: int = 0) -> SD3Transformer2DModel:
    """diffusers model with every parameter random (norm weights too, so none is silently unused)."""
    torch.manual_seed(seed)
    ref = SD3Transformer2DModel(**diffusers_kwargs(args)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return ref


def inputs(args: MMDiTArgs, H: int, W: int, B: int = 2, L: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, args.in_channels, H, W, generator=g),
            torch.randn(B, L, args.joint_attention_dim, generator=g),
            torch.randn(B, args.pooled_projection_dim, generator=g),
            torch.rand(B, generator=g) * 1000)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("args", [SD3_TINY, SD35_TINY], ids=["sd3", "sd3.5"])
@pytest.mark.parametrize("hw", RESOLUTIONS, ids=["square", "nonsquare"])
@torch.no_grad()
def test_forward_matches_diffusers(args, hw):
    ref = reference(args)
    model = MMDiT(args).eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    x = inputs(args, *hw)
    out, expected = model(*x), ref(*x).sample
    assert out.shape == expected.shape == x[0].shape
    assert rel_err(out, expected) <= 1e-5


@torch.no_grad()
def test_save_loads_in_diffusers_without_missing_keys(tmp_path):
    model = MMDiT(SD35_TINY)
    for p in model.parameters():  # init_weights zeroes AdaLN; perturb so outputs are non-trivial
        p.add_(0.05 * torch.randn_like(p))
    out_dir = save_pretrained(model, tmp_path / "mmdit")
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", WEIGHTS_NAME]
    ref, info = SD3Transformer2DModel.from_pretrained(out_dir, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    x = inputs(SD35_TINY, 12, 20)
    assert rel_err(model(*x), ref.eval()(*x).sample) <= 1e-5


@pytest.mark.parametrize("layout", ["transformer_dir", "pipeline_dir"])
@torch.no_grad()
def test_load_diffusers_saved_dir(tmp_path, layout):
    ref = reference(SD35_TINY, seed=3)
    target = tmp_path / "pipe" / "transformer" if layout == "pipeline_dir" else tmp_path / "t"
    ref.save_pretrained(target)
    model = load_pretrained(tmp_path / "pipe" if layout == "pipeline_dir" else target)
    x = inputs(SD35_TINY, 16, 16)
    assert rel_err(model(*x), ref(*x).sample) <= 1e-5


@torch.no_grad()
def test_sharded_save_round_trip(tmp_path):
    model = MMDiT(SD3_TINY)
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))
    out_dir = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((out_dir / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    ref, info = SD3Transformer2DModel.from_pretrained(out_dir, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    again = load_pretrained(out_dir)
    x = inputs(SD3_TINY, 16, 16)
    assert torch.equal(again(*x), model(*x))
    assert rel_err(ref.eval()(*x).sample, model(*x)) <= 1e-5
    # Overwriting an existing directory swaps it whole (the old shards and index disappear).
    save_pretrained(model, out_dir, dtype=torch.bfloat16)
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", WEIGHTS_NAME]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_init_random_writes_a_loadable_model(tmp_path):
    out = init_random("tiny", tmp_path / "tiny", seed=5, in_channels=3, out_channels=3)
    model = load_pretrained(out)
    assert model.args == dataclasses.replace(SIZES["tiny"], in_channels=3, out_channels=3)
    again = load_pretrained(init_random("tiny", tmp_path / "tiny2", seed=5, in_channels=3, out_channels=3))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    with pytest.raises(ValueError, match="unknown MMDiTArgs override"):
        init_random("tiny", tmp_path / "bad", in_chans=3)
    with pytest.raises(ValueError, match="unknown imagegen size"):
        init_random("huge", tmp_path / "bad")


def test_init_weights_is_adaln_zero():
    torch.manual_seed(0)
    model = MMDiT(SD35_TINY)
    for b in model.transformer_blocks:
        assert not b.norm1.linear.weight.any() and not b.norm1_context.linear.weight.any()
    assert not model.proj_out.weight.any() and not model.norm_out.linear.weight.any()
    assert model.transformer_blocks[0].attn.to_q.weight.std() > 0
    out = model(*inputs(SD35_TINY, 16, 16))
    assert torch.equal(out, torch.zeros_like(out))  # DiT: the zero-init final layer outputs 0


@pytest.mark.parametrize("name", sorted(SIZES))
def test_named_sizes_contract(name):
    """Every named size: the published config round-trips, and at tiny width the model has
    diffusers' exact keys and shapes, runs forward, and gives finite gradients everywhere."""
    args = SIZES[name]
    assert MMDiTArgs.from_diffusers_config(args.to_diffusers_config()) == args
    if name in HUB_CONFIGS:
        assert MMDiTArgs.from_diffusers_config(HUB_CONFIGS[name]) == args
    small = dataclasses.replace(args, num_heads=2, head_dim=8, caption_projection_dim=16, joint_attention_dim=12,
                                pooled_projection_dim=10, pos_embed_max_size=min(args.pos_embed_max_size, 64))
    ref_shapes = {k: v.shape for k, v in SD3Transformer2DModel(**diffusers_kwargs(small)).state_dict().items()}
    model = MMDiT(small)
    assert {k: v.shape for k, v in model.state_dict().items()} == ref_shapes
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    out = model(*inputs(small, 8, 6))
    out.square().mean().backward()
    # The last block's text queries are dead in diffusers too (its text output is dropped): skipped.
    last = f"transformer_blocks.{small.num_layers - 1}.attn"
    dead = {f"{last}.add_q_proj.weight", f"{last}.add_q_proj.bias", f"{last}.norm_added_q.weight"}
    for n, p in model.named_parameters():
        if n in dead:
            assert p.grad is None
        else:
            assert p.grad is not None and p.grad.isfinite().all() and p.grad.any(), n


@pytest.mark.parametrize("args", [SD3_TINY, SD35_TINY], ids=["sd3", "sd3.5"])
def test_train_flops_matches_flop_counter(args):
    """FlopCounterMode has no formula for PyTorch's CPU flash kernel; the math backend runs
    attention as counted bmm's (on CUDA the flash/efficient kernels are counted directly)."""
    model = MMDiT(args)
    latents, text, pooled, t = inputs(args, 12, 20, B=3, L=5)
    N, L = (12 // 2) * (20 // 2), 5
    with FlopCounterMode(display=False) as fwd, sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad():
            model(latents, text, pooled, t)
    measured_fwd = fwd.get_total_flops()
    predicted = model.train_flops(3, N, L)
    assert abs(3 * measured_fwd - predicted) <= 0.02 * predicted
    # Forward + backward with every input requiring grad: backward is exactly 2x forward for
    # matmuls and attention, up to the sinusoid timestep features (no input gradient there).
    for x in (latents, text, pooled):
        x.requires_grad_(True)
    with FlopCounterMode(display=False) as full, sdpa_kernel(SDPBackend.MATH):
        model(latents, text, pooled, t).sum().backward()
    assert abs(full.get_total_flops() - predicted) <= 0.02 * predicted
    # Attention: 12*S^2*D per joint layer but 12*N*S*D for the last (no text queries), plus
    # 12*N^2*D per dual-attention layer; batch 3.
    S, D, n_layers = N + L, args.dim, args.num_layers
    _, attn = model.forward_flops(3, N, L)
    expected = 12 * D * ((n_layers - 1) * S * S + N * S + len(args.dual_attention_layers) * N * N)
    assert 3 * attn == 3 * expected


def test_bad_inputs_say_what_and_where(tmp_path):
    model = MMDiT(SD3_TINY)
    latents, text, pooled, t = inputs(SD3_TINY, 16, 16)
    with pytest.raises(ValueError, match=r"latents must be \[B, 16, H, W\], got \(2, 3, 16, 16\)"):
        model(latents[:, :3], text, pooled, t)
    with pytest.raises(ValueError, match="multiples of patch_size"):
        model(latents[..., :15], text, pooled, t)
    with pytest.raises(ValueError, match="exceeds pos_embed_max_size"):
        model(torch.randn(2, 16, 34, 16), text, pooled, t)
    with pytest.raises(ValueError, match="text_states must be"):
        model(latents, text[..., :5], pooled, t)
    with pytest.raises(ValueError, match="timestep must be"):
        model(latents, text, pooled, t[:1])
    with pytest.raises(ValueError, match="caption_projection_dim"):
        dataclasses.replace(SD3_TINY, caption_projection_dim=48)
    with pytest.raises(ValueError, match="dual_attention_layers"):
        dataclasses.replace(SD3_TINY, dual_attention_layers=(2,))

    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(tmp_path)
    d = save_pretrained(model, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_heads": 3}))
    with pytest.raises(ValueError, match=r"config.json: unknown SD3Transformer2DModel field\(s\) \['num_heads'\]"):
        load_pretrained(d)
    (d / "config.json").write_text(json.dumps({**cfg, "attention_head_dim": 8}))
    with pytest.raises(ValueError, match=r"config.json: MMDiTArgs.caption_projection_dim=32: must equal dim"):
        load_pretrained(d)
    (d / "config.json").write_text(json.dumps({**cfg, "joint_attention_dim": 20}))
    with pytest.raises(ValueError, match=r"safetensors: key 'context_embedder.weight' has shape \(32, 24\), "
                                         r"the config expects \(32, 20\)"):
        load_pretrained(d)
    (d / "config.json").write_text(json.dumps({**cfg, "num_layers": 1}))
    with pytest.raises(ValueError, match="unexpected key"):
        load_pretrained(d)
    (d / "config.json").write_text(json.dumps({**cfg, "qk_norm": "rms_norm"}))
    with pytest.raises(ValueError, match="missing key.*norm_q.weight"):
        load_pretrained(d)
    (d / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="neither diffusion_pytorch_model.safetensors"):
        load_pretrained(d)


def _train_pass(model: MMDiT, x) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(*x)
    out.square().mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("args", [SD3_TINY, SD35_TINY], ids=["sd3", "sd3.5"])
def test_kernels_on_equals_kernels_off(args):
    """The Triton kernels (CPU: the interpreter) and the references give the same output and gradients, in
    fp32, on a model whose every parameter is random (AdaLN-Zero would hide the modulation and gates)."""
    ref = reference(args)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU host has no interpreter: real kernels there
    runs = []
    for kernels in ("ref", "triton"):
        model = MMDiT(dataclasses.replace(args, kernels=kernels)).to(dev)
        model.load_state_dict(ref.state_dict(), strict=True)
        runs.append(_train_pass(model, [t.to(dev) for t in inputs(args, 12, 20)]))
    (out_ref, grads_ref), (out_tri, grads_tri) = runs
    assert rel_err(out_tri, out_ref) <= 1e-5
    assert grads_ref.keys() == grads_tri.keys() and len(grads_ref) > 20
    for n, g in grads_ref.items():
        assert rel_err(grads_tri[n], g) <= 1e-4, n


def test_kernels_choice_stays_out_of_the_checkpoint_config():
    args = dataclasses.replace(SD35_TINY, kernels="triton", attention="math")
    assert "kernels" not in args.to_diffusers_config() and "attention" not in args.to_diffusers_config()
    assert MMDiTArgs.from_diffusers_config(args.to_diffusers_config(), kernels="triton", attention="math") == args
    with pytest.raises(ValueError, match="MMDiTArgs.kernels='cuda'"):
        dataclasses.replace(SD3_TINY, kernels="cuda")
    with pytest.raises(ValueError, match="MMDiTArgs.attention='fast'"):
        dataclasses.replace(SD3_TINY, attention="fast")


def test_pinned_sdpa_backend_gives_the_same_model_and_compiles():
    """MMDiTArgs.attention pins the joint attention's SDPA backend: the math backend equals PyTorch's own choice
    (CPU), in eager and under torch.compile (the backend context is traced, no graph break)."""
    weights = reference(SD35_TINY).state_dict()
    x = inputs(SD35_TINY, 12, 20)
    auto, pinned = MMDiT(SD35_TINY), MMDiT(dataclasses.replace(SD35_TINY, attention="math"))
    auto.load_state_dict(weights, strict=True)
    pinned.load_state_dict(weights, strict=True)
    # two attention algorithms (the math backend's full softmax, the CPU flash kernel's blockwise one) on the same
    # fp32 inputs: they agree to rounding, 1.1 eps of RMS error measured; 1e-5 (~80 eps) is the bound of the
    # kernels-on-vs-off test above. A backend that computed something else is off by O(1).
    assert rel_err(pinned(*x), auto(*x)) <= 1e-5
    if not torch.cuda.is_available():  # the pin is real: a CUDA-only backend has no CPU kernel to run
        cudnn = MMDiT(dataclasses.replace(SD35_TINY, attention="cudnn"))
        cudnn.load_state_dict(weights, strict=True)
        with pytest.raises(RuntimeError):
            cudnn(*x)
    block = pinned.transformer_blocks[0]
    hidden, ctx, temb = (torch.randn(2, 16, SD35_TINY.dim), torch.randn(2, 5, SD35_TINY.dim),
                         torch.randn(2, SD35_TINY.dim))
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(hidden, ctx, temb), block(hidden, ctx, temb)):
        assert rel_err(a, b) <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_blocks_with_kernels_give_the_eager_reference_gradients():
    """Per-block compile (pipeline/policies) around the Triton custom ops vs eager references, bf16 autocast."""
    from atelier_studio.pipeline.policies import compile_blocks

    args = dataclasses.replace(SD35_TINY, num_heads=4, head_dim=64, caption_projection_dim=256)
    ref = reference(args).cuda()
    x = [t.cuda() for t in inputs(args, 32, 32, B=3, L=20)]
    grads = []
    for kernels, compiled in (("ref", False), ("triton", True)):
        torch._dynamo.reset()
        model = MMDiT(dataclasses.replace(args, kernels=kernels)).cuda()
        model.load_state_dict(ref.state_dict(), strict=True)
        if compiled:
            compile_blocks(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(*x)
        out.float().square().mean().backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    for n, g in grads[0].items():
        assert rel_err(grads[1][n], g) < 2e-2, f"{n}: compiled kernels vs eager reference"
