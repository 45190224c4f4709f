"""Imagegen speed on one GPU: Atelier's MMDiT vs diffusers' SD3Transformer2DModel on the same weights and batches
(and FLUX.1-dev vs FluxTransformer2DModel: flux-dev-1024, 4096 image + 512 T5 tokens; Qwen-Image vs
QwenImageTransformer2DModel: qwen-image-1024, 4096 image + 512 Qwen2.5-VL tokens; every model-specific step asks the
family's record in imagegen/registry.py: the model class, the diffusers peer and its pipeline's call, the FLOPs).

    python3 -m atelier_studio.bench.imagegen --config sd3-medium-1024|sd3-medium-512|sd3.5-medium-1024|flux-dev-1024
        |qwen-image-1024 --out DIR
        [--peers diffusers,diffusers-compiled] [--lora RANK] [--batches 8,16] [--peer-batches 8,12]
        [--fp8 rowwise,tensorwise] [--fp8-batches 8] [--fp8-compile on|off|both] [--steps 10 --warmup 3]
        [--ablation [no_compile,reference_kernels,...]] [--loader-workers 4] [--no-loader]
        [--kernels auto|triton|ref] [--attention auto|flash|cudnn|efficient] [--checkpointing none|full|selective]
        [--profile] [--budget-s 200] [--tiny]
        [--loader-only]

Shapes: B images per micro-batch, C = 16 latent channels, h = w latent side (px / 8), N = (h/2)² image tokens,
L = 333 text tokens (SD3's 77 CLIP + 256 T5, padded: real work, SD3 uses no text mask), E = 4096 text
width, P = 2048 pooled width, D = 1536 model dim. sd3.5-medium-1024 is SD3.5-medium's MMDiT-X: dual attention
(a second, image-only attention) in blocks 0-12 and QK RMSNorm.

Per config the random weights are drawn ONCE on the device (bf16, every tensor random: AdaLN-Zero's zeros would
make the blocks identities and the timing meaningless); every run (Atelier, each peer, each ablation) copies them
into its own fp32 master weights and trains under bf16 autocast (docs/training.md). The batches — latents x0,
text states, pooled vectors, timesteps t (logit-normal, shift 3: imagegen/flow.py) and noise — are drawn once per
micro-batch size, and both sides compute the same loss the same way: x_t = (1 − t)·x0 + t·noise, v̂ = model(x_t,
text, pooled, 1000·t), loss = mean over images of mean((v̂ − (noise − x0))²) in fp32 (imagegen.flow.flow_loss).
A step = forward + loss + backward + AdamW step + zero_grad, timed with CUDA events (wall clock on CPU): `warmup`
steps first (per-block compile happens in the first: one bucket, so one shape), then `steps` timed ones; median
images/s and min–max.

Atelier: imagegen.model.MMDiT with its fused kernels (MMDiTArgs.kernels), per-block torch.compile
(pipeline/policies.compile_blocks), fused AdamW; the last block's dead text-query projection frozen as the trainer
does (imagegen/task.py). Peers: diffusers' SD3Transformer2DModel eager (its training scripts' default) and, as
"diffusers-compiled", the same with per-block compile. The ablation switches one optimisation off at a time;
`attention` times each SDPA backend (flash, cuDNN, memory-efficient) with everything else on, so the attention
choice is made by measurement. With --fp8, the same model with `train.precision = "fp8"` as the trainer applies it
(pipeline/float8.apply_fp8 with the family's fp8_skip: the joint blocks' projections and MLPs and the caption
projection in FP8, the per-image modulation linears, embedders and final projection in bf16) for each recipe, on the
bf16 run's batches: the FP8 ablation (FP8 off, rowwise, tensorwise) with the mean |Δloss| against bf16.

FLOPs: MMDiT.train_flops (docs/mfu.md: each token through its own stream's weights, modulation linears once per
image, 3× forward, + 12·L·S²·D attention), the same count for the peers; MFU against 989 TFLOP/s (dense bf16) and
1,979 (dense FP8), and against the bf16 and FP8 matmul rates measured in this run (bench/env.py matmul_rates).
--budget-s: runs that would start after it are recorded as skipped; the report is rewritten after every run.
Loader: images/s of the trainer's own streaming loader
(data/latent_stream.LatentStream with `--loader-workers` loader threads), batched and moved to the device,
against the training rate (target ≥ 10×).

LoRA (`--lora RANK`): the frozen base stays in bf16 (the weights drawn once, shared by every run: nothing updates
them), adapters of rank RANK and alpha RANK on every attention projection (imagegen/lora.py's default targets),
fp32 and computed in bf16 under autocast; A and B are drawn once (B random too, so the runs' losses compare
something) and copied into every run. Atelier: imagegen/lora.py's layers (kernels/lora_linear.py's fused
Function). Peers: the same diffusers models with PEFT adapters on the same modules (`add_adapter`), cast to fp32 as
diffusers' scripts do (cast_training_params). FLOPs: 4·N + 6·N_lora (MMDiT.train_flops: the frozen base gets no
weight gradient); `mfu_6n` is the full fine-tune's count over the same time, what most peers quote.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from atelier_studio.bench.env import clocks, environment, matmul_rates
from atelier_studio.bench.harness import (
    PEAK_TFLOPS,
    Budget,
    adamw,
    bar_chart,
    best_per_size,
    best_run,
    fmt,
    guarded,
    mfu_fields,
    no_rate,
    parse_ints,
    profile_table,
    run_status,
    timed_steps,
    train_step,
    write_report,
)
from atelier_studio.bench.harness import attempt as attempt_run
from atelier_studio.imagegen.ema import EMA, ema_update_ref
from atelier_studio.imagegen.flow import FlowArgs, add_noise, flow_loss, sample_timesteps
from atelier_studio.imagegen.lora import apply_lora, target_modules
from atelier_studio.imagegen.model import MMDiTArgs, sincos_2d_grid
from atelier_studio.imagegen.registry import family_of_args, family_of_size
from atelier_studio.kernels.fp8_linear import TRAIN_RECIPES
from atelier_studio.pipeline.float8 import apply_fp8
from atelier_studio.pipeline.lora import LoraArgs, lora_layers
from atelier_studio.pipeline.policies import AC_MODES, checkpoint_blocks, compile_block_list

PEERS = ("diffusers", "diffusers-compiled")
SDPA_BACKENDS = ("flash", "cudnn", "efficient")
ABLATIONS = ("no_compile", "reference_kernels", "foreach_adamw", *(f"sdpa_{b}" for b in SDPA_BACKENDS))
VAE_FACTOR = 8  # SD3's VAE: 1024 px -> 128 latent side
FLOW = FlowArgs()  # logit-normal timesteps, shift 3, no loss weighting (imagegen/flow.py)
QK_NORM = re.compile(r"\.norm_(added_)?[qk]\.weight$")  # SD3.5's QK-RMSNorm weights (init 1)


@dataclass(frozen=True)
class BenchConfig:
    size: str                     # a registered imagegen size (imagegen/registry.py)
    resolution: int               # pixel side of the one square bucket
    text_tokens: int              # L
    batches: tuple[int, ...]      # micro-batch sweep
    lr: float = 1e-5
    shard_samples: int = 256      # samples written for the loader measurement (~3.3 MB each at 333 x 4096 bf16)
    shard_size: int = 16          # samples per shard
    model: MMDiTArgs | None = None  # explicit args instead of the size's (the tiny runs: tiny_config)

    @property
    def latent_side(self) -> int:
        return self.resolution // VAE_FACTOR


CONFIGS = {
    "sd3-medium-1024": BenchConfig("sd3-medium", 1024, 333, (8, 16, 24)),
    "sd3-medium-512": BenchConfig("sd3-medium", 512, 333, (16, 32, 64)),
    "sd3.5-medium-1024": BenchConfig("sd3.5-medium", 1024, 333, (8, 16, 24)),
    # FLUX.1-dev: 4096 image tokens at 1024 px and FluxPipeline's 512 T5 tokens; LoRA is what users train on it
    "flux-dev-1024": BenchConfig("flux-dev", 1024, 512, (1, 2, 4)),
    # Qwen-Image: 4096 image tokens at 1024 px and 512 Qwen2.5-VL tokens (configs/imagegen/qwen-image-lora.toml)
    "qwen-image-1024": BenchConfig("qwen-image", 1024, 512, (1, 2, 4)),
}


@dataclass(frozen=True)
class Variant:
    """One Atelier run's switches (the ablation turns each off in turn)."""

    compile: bool = True
    kernels: str = "auto"         # MMDiTArgs.kernels; "ref": the plain-PyTorch paths
    fused_adamw: bool = True
    attention: str = "auto"       # MMDiTArgs.attention: "auto" (PyTorch's SDPA choice) or one of SDPA_BACKENDS
    precision: str = "bf16"       # train.precision: "bf16" or "fp8"
    fp8_recipe: str = "rowwise"   # train.fp8_recipe, with precision "fp8"
    checkpointing: str = "none"   # train.distributed.activation_checkpointing: "none" | "full" | "selective"


def tiny_config(cfg: BenchConfig) -> BenchConfig:
    """The same code path at CPU size: the tiny MMDiT with the real size's architecture (SD3.5's QK RMSNorm and dual
    attention in its first block), an 8x8 latent (16 image tokens), 7 text tokens, fp32."""
    real, family = model_args(cfg), family_of_size(cfg.size)
    kept = {k: getattr(real, k) for k in ("qk_norm", "guidance_embeds") if hasattr(real, k)}  # the real's variant
    if getattr(real, "dual_attention_layers", ()):
        kept["dual_attention_layers"] = (0,)
    tiny = family.args_of_size(family.tiny_size, **kept)
    return dataclasses.replace(cfg, size=family.tiny_size, resolution=64, text_tokens=7, batches=(1, 2),
                               shard_samples=8, shard_size=2, model=tiny)


def model_args(cfg: BenchConfig) -> MMDiTArgs:
    return cfg.model if cfg.model is not None else family_of_size(cfg.size).args_of_size(cfg.size)


def image_tokens(cfg: BenchConfig, args: MMDiTArgs) -> int:
    return (cfg.latent_side // args.patch_size) ** 2


# ------------------------------------------------------------------------------------------------ weights and data

def random_state_dict(args: MMDiTArgs, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """diffusers-named weights, every one random: normal(0, 0.02) matrices and convs, normal(0, 0.01) biases,
    ones ± 0.1 for the QK-norm weights, and the fixed sincos grid for pos_embed.pos_embed."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in family_of_args(args).model_cls(args).state_dict().items()}
    out = {}
    for name, shape in shapes.items():
        if name == "pos_embed.pos_embed":
            grid = sincos_2d_grid(args.dim, args.pos_embed_max_size, args.sample_size // args.patch_size)
            out[name] = grid.to(device, dtype)
            continue
        std = 0.01 if name.endswith(".bias") else 0.02
        t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0, std, generator=g)
        out[name] = (t * 5 + 1 if QK_NORM.search(name) else t).to(dtype)
    return out


@dataclass
class ImageBatch:
    """One micro-batch, drawn once on the device: the same tensors go to every run."""

    x0: torch.Tensor          # [B, C, h, w] latents
    text: torch.Tensor        # [B, L, E]
    pooled: torch.Tensor      # [B, P]
    t: torch.Tensor           # [B] in (0, 1); the model sees 1000·t
    noise: torch.Tensor       # [B, C, h, w]

    @property
    def size(self) -> int:
        return self.x0.shape[0]


def _pooled_width(cfg: BenchConfig, args: MMDiTArgs) -> int:
    return family_of_args(args).pooled_width(args, cfg.text_tokens)


def make_batches(cfg: BenchConfig, args: MMDiTArgs, batch: int, count: int, device: torch.device, dtype: torch.dtype,
                 seed: int) -> list[ImageBatch]:
    """`count` micro-batches of `batch` images; text states in `dtype` (as a cache holds them), latents fp32."""
    g = torch.Generator(device=device).manual_seed(seed)
    side = cfg.latent_side
    out = []
    for _ in range(count):
        x0 = torch.randn(batch, args.in_channels, side, side, generator=g, device=device)
        text = torch.randn(batch, cfg.text_tokens, args.joint_attention_dim, generator=g, device=device).to(dtype)
        # the pooled vector, or where the family takes the text mask there a random one that masks nothing
        pooled = torch.randn(batch, _pooled_width(cfg, args), generator=g, device=device).to(dtype)
        t = sample_timesteps(batch, g, FLOW, image_tokens(cfg, args), device)
        noise = torch.randn(x0.shape, generator=g, device=device)
        out.append(ImageBatch(x0, text, pooled, t, noise))
    return out


@dataclass(frozen=True)
class Lora:
    """The LoRA runs' adapters: the layer settings, the wrapped modules and their A, B (drawn once, fp32)."""

    args: LoraArgs
    modules: tuple[str, ...]
    weights: dict[str, torch.Tensor]  # "<module>.lora_A.weight" / ".lora_B.weight"


def make_lora(args: MMDiTArgs, rank: int, device: torch.device, seed: int) -> Lora:
    """Rank-`rank` adapters (alpha = rank) on the family's default targets; A ~ N(0, 1/I), B ~ N(0, 0.01²)."""
    with torch.device("meta"):
        meta = family_of_args(args).model_cls(args)
    modules = target_modules(meta, family_of_args(args).default_lora_targets)
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name in modules:
        lin = meta.get_submodule(name)
        weights[f"{name}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g, device=device) \
            / lin.in_features**0.5
        weights[f"{name}.lora_B.weight"] = 0.01 * torch.randn(lin.out_features, rank, generator=g, device=device)
    return Lora(LoraArgs(rank=rank, alpha=float(rank)), tuple(modules), weights)


# ------------------------------------------------------------------------------------------------ runs

@dataclass
class Run:
    """A built model: forward(x_t, text, pooled, timestep) → v̂ [B, C, h, w], and its optimizer's parameters."""

    model: nn.Module
    forward: Callable[..., torch.Tensor]
    params: list[nn.Parameter]
    fused_adamw: bool
    autocast: bool                # bf16 autocast over fp32 master weights; off for exact (tiny) runs
    args: Any = None              # the model's args (its family: the guidance input)

    def loss(self, b: ImageBatch) -> torch.Tensor:
        """The loss both sides share: noise the latents, predict the velocity, the batch's mean flow_loss (fp32)."""
        x_t = add_noise(b.x0, b.noise, b.t)  # [B, C, h, w]
        # a guidance-distilled model (FLUX.1-dev) gets the trainer's default guidance input, model.guidance = 1
        guidance = family_of_args(self.args).guidance_kwargs(self.args, 1.0, b.size, b.x0.device)
        with torch.autocast(b.x0.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            pred = self.forward(x_t, b.text, b.pooled, b.t * 1000, **guidance)  # [B, C, h, w]
        return flow_loss(pred, b.x0, b.noise, b.t, FLOW).mean()


def _fp32_copy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in sd.items()}


def build_atelier(args: MMDiTArgs, sd: dict, v: Variant, exact: bool, lora: Lora | None = None) -> Run:
    """Full fine-tuning: fp32 master copies of the weights. LoRA: the shared frozen base as it is (bf16, or fp32 for
    exact runs) with imagegen/lora.py's layers holding fp32 copies of the drawn adapters."""
    with torch.device("meta"):
        model = family_of_args(args).model_cls(dataclasses.replace(args, kernels=v.kernels, attention=v.attention))
    model.load_state_dict(sd if lora is not None else _fp32_copy(sd), assign=True)
    model.train().requires_grad_(True)
    if lora is not None:
        apply_lora(model, lora.args, list(lora.modules))  # freezes the base
        with torch.no_grad():
            for name, m in lora_layers(model).items():
                m.lora_A.weight.copy_(lora.weights[f"{name}.lora_A.weight"])
                m.lora_B.weight.copy_(lora.weights[f"{name}.lora_B.weight"])
    if v.precision == "fp8":  # first, as the trainer applies train.precision (imagegen/task.py _wrap)
        apply_fp8(model, v.fp8_recipe, family_of_args(args).fp8_skip)
    for block in model.transformer_blocks:  # a block without text output has no text queries (imagegen/task.py _wrap)
        if block.attn.to_add_out is None:
            for m in (block.attn.add_q_proj, getattr(block.attn, "norm_added_q", None)):
                if m is not None:
                    m.requires_grad_(False)
    blocks = family_of_args(args).blocks(model)  # FLUX: the double- and the single-stream blocks
    checkpoint_blocks(blocks, v.checkpointing)  # the trainer's order: checkpointing, then compile
    if v.compile:
        compile_block_list(blocks)
    params = [p for p in model.parameters() if p.requires_grad]
    return Run(model, model, params, v.fused_adamw, autocast=not exact, args=args)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters made inside go to the meta device (no memory: the weights are assigned after); the other tensors a
    constructor makes stay real (QwenEmbedRope keeps its RoPE tables as plain attributes, which torch.device("meta")
    would leave without data)."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_peer(name: str, args: MMDiTArgs, sd: dict, exact: bool, lora: Lora | None = None,
               checkpointing: bool = False) -> Run:
    """The family's diffusers model (SD3Transformer2DModel, FluxTransformer2DModel; their default SDPA processors) on
    the same weights, called as its pipeline calls it (the family's diffusers_forward); with `lora`, PEFT adapters on
    the same modules (diffusers' `add_adapter`) holding fp32 copies of the same A and B; `checkpointing`: diffusers'
    own `enable_gradient_checkpointing()` (every block recomputed, what its training scripts'
    --gradient_checkpointing turns on)."""
    family = family_of_args(args)
    reference = family.diffusers_reference()  # ImportError → the peer is reported as skipped
    kwargs = {k: val for k, val in args.to_diffusers_config().items() if not k.startswith("_")}
    with _parameters_on_meta():
        model = reference(**kwargs)
    model.load_state_dict(sd if lora is not None else _fp32_copy(sd), assign=True, strict=True)
    model.train().requires_grad_(True)
    if lora is not None:
        from peft import LoraConfig

        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=lora.args.rank, lora_alpha=lora.args.alpha, target_modules=list(lora.modules),
                                     init_lora_weights=True))
        named = dict(model.named_parameters())
        for key, value in lora.weights.items():  # fp32 adapters (diffusers' cast_training_params), the same values
            module, ab = key.rsplit(".lora_", 1)
            named[f"{module}.lora_{ab.split('.')[0]}.default.weight"].data = value.float().clone()
    if checkpointing:
        model.enable_gradient_checkpointing()
    if name == "diffusers-compiled" and not exact:
        compile_block_list([*model.transformer_blocks, *getattr(model, "single_transformer_blocks", ())])
    dev = next(model.parameters()).device

    def forward(x_t, text, pooled, timestep, **guidance):
        return family.diffusers_forward(model, x_t, text, pooled, timestep, **guidance)

    params = [p for p in model.parameters() if p.requires_grad]
    return Run(model, forward, params, fused_adamw=dev.type == "cuda", autocast=not exact, args=args)


def measure(build: Callable[[], Run], batches: list[ImageBatch], warmup: int, steps: int, lr: float,
            flops: int) -> dict[str, Any]:
    """Build, run warmup + steps optimizer steps, time them; OOM is a result (bench.harness.guarded)."""
    cuda = batches[0].x0.is_cuda

    def use(run: Run) -> dict[str, Any]:
        opt = adamw(run.params, lr, fused=run.fused_adamw and cuda)
        return timed_steps(train_step(run.loss, batches, opt), warmup + steps, cuda)

    r = guarded(build, use, cuda)
    if r["oom"]:
        return r
    t = r["step_s"][warmup:]
    ips = [batches[0].size / s for s in t]
    tflops = flops / statistics.median(t) / 1e12
    r.update(images_per_s=statistics.median(ips), images_per_s_min=min(ips), images_per_s_max=max(ips),
             step_s_median=statistics.median(t), tflops=tflops, mfu=tflops / PEAK_TFLOPS,
             timed_losses=r["losses"][warmup:])
    return r


# ------------------------------------------------------------------------------------------------ EMA and loader

def profile_run(build: Callable[[], Run], batches: list[ImageBatch], lr: float, path: Path) -> Path:
    """bench.harness.profile_table over one run's step (3 warm-up steps, 2 profiled), on the GPU. No Dynamo reset:
    the sweep's compiled blocks are reused (the same module structure and shapes)."""
    run = build()
    opt = adamw(run.params, lr, fused=run.fused_adamw)
    return profile_table(train_step(run.loss, batches, opt), 3, path)


def ema_timing(args: MMDiTArgs, sd: dict, device: torch.device, lora: Lora | None = None,
               repeats: int = 5) -> dict[str, float]:
    """Milliseconds of one EMA update over all trainable weights (the adapters, with `lora`): imagegen.ema's one
    foreach lerp vs the per-tensor reference loop (the trainer runs it after every optimizer step)."""
    model = build_atelier(args, sd, Variant(compile=False), exact=True, lora=lora).model
    ema = EMA(model, decay=0.9999)
    shadow = dict(zip(ema.names, ema.shadow))
    params = dict(model.named_parameters())
    out = {}
    for name, fn in (("foreach", ema.update), ("reference", lambda i: ema_update_ref(shadow, params, 0.9))):
        fn(1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(repeats):
            fn(i + 2)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[f"{name}_ms"] = (time.perf_counter() - t0) / repeats * 1e3
    return out


def random_latent_samples(cfg: BenchConfig, args: MMDiTArgs, n: int, seed: int) -> Iterator[dict]:
    """Samples as `atelier imagegen cache` writes them (bf16, one square bucket): random, never zeros."""
    g = torch.Generator().manual_seed(seed)
    side = cfg.latent_side
    for i in range(n):
        yield {"key": f"s{i:06d}", "latent": torch.randn(args.in_channels, side, side, generator=g).bfloat16(),
               "text_states": torch.randn(cfg.text_tokens, args.joint_attention_dim, generator=g).bfloat16(),
               "pooled": torch.randn(_pooled_width(cfg, args), generator=g).bfloat16(),
               "bucket": (cfg.resolution, cfg.resolution), "caption": f"random sample {i}"}


def loader_throughput(cfg: BenchConfig, args: MMDiTArgs, batch: int, workers: int, device: torch.device,
                      work: Path) -> dict[str, Any]:
    """Images/s of the trainer's loader: latent shards → data.latent_stream.LatentStream (planned from the tar
    headers, tensors read ahead by `workers` threads straight into the batch, page-locked on CUDA) → the device,
    as imagegen/task.py reads them.

    Writes cfg.shard_samples random samples in shards of cfg.shard_size; the stream is endless, so it reads one
    epoch untimed (worker start-up, and the page cache warm as a long run's data is) and times the next.
    """
    from atelier_studio.data.latent_stream import LatentStream, StreamConfig
    from atelier_studio.data.shards import write_latent_shards

    shards = work / "latents"
    write_latent_shards(random_latent_samples(cfg, args, cfg.shard_samples, seed=0), shards, cfg.shard_size)
    stream = LatentStream(shards, StreamConfig(batch, workers=workers, pin_memory=device.type == "cuda"))
    per_epoch = max(1, cfg.shard_samples // batch)
    chunks = stream.chunks()

    def read(n: int) -> int:
        images = 0
        for _ in range(n):
            for c in next(chunks):
                for k in ("latent", "text_states", "pooled"):
                    c[k].to(device, non_blocking=True)
                images += c["latent"].shape[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        return images

    read(per_epoch)
    t0 = time.perf_counter()
    n = read(per_epoch)
    rate = n / (time.perf_counter() - t0)
    chunks.close()
    return {"images_per_s": rate, "workers": workers, "batch": batch, "samples": cfg.shard_samples,
            "shard_size": cfg.shard_size, "bytes_per_image": _sample_bytes(cfg, args), "loader": "LatentStream"}


def _sample_bytes(cfg: BenchConfig, args: MMDiTArgs) -> int:
    return 2 * (args.in_channels * cfg.latent_side**2 + cfg.text_tokens * args.joint_attention_dim
                + _pooled_width(cfg, args))


# ------------------------------------------------------------------------------------------------ the bench

def _summary(r: dict[str, Any], batch: int, report: dict[str, Any]) -> dict[str, Any]:
    out = {"images_per_s": r["images_per_s"], "images_per_s_min": r["images_per_s_min"],
           "images_per_s_max": r["images_per_s_max"], "mfu": r["mfu"],
           **mfu_fields(r["tflops"], report["matmul_tflops"], report.get("matmul_tflops_fp8_best")),
           "peak_gb": r["peak_gb"], "batch": batch}
    if "mfu_6n" in r:
        out["mfu_6n"] = r["mfu_6n"]
    return out


def attempt(build: Callable[[], Run], batches: list[ImageBatch], warmup: int, steps: int, lr: float,
            flops: int) -> dict[str, Any]:
    """measure(), with any other failure (a compile error, an SDPA backend that cannot run these shapes) recorded
    as this run's result instead of ending the whole bench: {"oom": False, "failed": True, "error": ...}."""
    return attempt_run(lambda: measure(build, batches, warmup, steps, lr, flops), passthrough=(ImportError,))


def _ok(r: dict[str, Any]) -> bool:
    return "images_per_s" in r


def _best(runs: dict[str, dict[str, Any]]) -> str | None:
    return best_run(runs, "images_per_s")


def bench(name: str, cfg: BenchConfig, peers: list[str], batches: list[int], steps: int, warmup: int,
          ablation: list[str], loader_workers: int, device: torch.device, exact: bool, kernels: str = "auto",
          seed: int = 0, profile_path: Path | None = None, attention: str = "auto", fp8: tuple[str, ...] = (),
          fp8_batches: list[int] | None = None, fp8_compile_modes: tuple[bool, ...] | None = None,
          peer_batches: list[int] | None = None, loader: bool = True, budget: Budget | None = None,
          on_result: Callable[[dict[str, Any]], Any] | None = None,
          compile_modes: tuple[bool, ...] = (True,), lora_rank: int = 0,
          checkpointing: str = "none") -> dict[str, Any]:
    """One config, in this order: Atelier's bf16 batch sweep (each batch in each of `compile_modes`), the FP8 rows
    (each recipe of `fp8` at `fp8_batches`, default the best bf16 batch, compiled as `fp8_compile_modes`, default as
    the best bf16 run), the peers (at `peer_batches`,
    default the sweep's), the ablation and attention backends, a profile, the EMA and loader timings. A run that
    would start once `budget` is spent is recorded as skipped; `on_result(report)` gets the summarised report after
    every run. `lora_rank` > 0: LoRA of that rank on the frozen base instead of full fine-tuning (module docstring);
    the FP8 rows are full fine-tuning's only (the trainer refuses FP8 with an MMDiT LoRA). `checkpointing`: every
    Atelier run's activation checkpointing mode; the peers get diffusers' gradient checkpointing when it is not
    "none"."""
    if lora_rank and fp8:
        raise ValueError("bench: --fp8 measures full fine-tuning; drop --lora or --fp8")
    args = model_args(cfg)
    dtype = torch.float32 if exact else torch.bfloat16
    budget = budget or Budget(None)
    N, L = image_tokens(cfg, args), cfg.text_tokens
    rates = matmul_rates()
    report: dict[str, Any] = {**environment(), "config": {"name": name, **dataclasses.asdict(cfg), "image_tokens": N,
                                                          "model": dataclasses.asdict(args)},
                              "run": {"warmup": warmup, "steps": steps, "seed": seed, "budget_s": budget.seconds},
                              "clocks": {"before": clocks()}, "matmul_tflops": rates["bf16"],
                              "matmul_tflops_fp8": rates["fp8"], "matmul_tflops_fp8_best": rates["fp8_best"],
                              "atelier_runs": {}, "fp8_runs": {}, "peer_runs": {p: {} for p in peers},
                              "ablation_runs": {},
                              "notes": {"weights": "random, every tensor (no AdaLN-Zero), drawn once; fp32 master "
                                                   "copies per run, bf16 autocast",
                                        "loss": "mean over images of imagegen.flow.flow_loss (no weighting), same "
                                                "batches, timesteps and noise",
                                        "peer_attention": "diffusers JointAttnProcessor2_0 "
                                                          "(F.scaled_dot_product_attention)",
                                        "fp8": "train.precision = fp8 as the trainer applies it (apply_fp8 with the "
                                               "family's fp8_skip)"}}
    sd = random_state_dict(args, dtype, device, seed)
    lora = make_lora(args, lora_rank, device, seed + 1) if lora_rank else None
    with torch.device("meta"):
        meta_model, meta_full = family_of_args(args).model_cls(args), family_of_args(args).model_cls(args)
        if lora is not None:  # the FLOP count sees the adapters and the frozen base (4·N + 6·N_lora)
            apply_lora(meta_model, lora.args, list(lora.modules))
    # tiny (CPU, exact): no compile (Inductor's C++ build takes minutes on a CPU)
    modes = (False,) if exact else tuple(compile_modes)
    base = Variant(kernels=kernels, attention=attention, checkpointing=checkpointing)
    report["run"]["activation_checkpointing"] = checkpointing
    if checkpointing != "none":
        report["notes"]["checkpointing"] = (f"Atelier: activation checkpointing {checkpointing!r} on every block "
                                            "(the trainer's policy); peers: diffusers' enable_gradient_checkpointing()")
    data: dict[int, tuple[list[ImageBatch], int]] = {}
    if lora is not None:
        report["notes"]["weights"] = ("random, every tensor, drawn once; the frozen base shared by every run in its "
                                      "dtype (bf16), the adapters' A and B drawn once and copied in fp32 into each "
                                      "run, bf16 autocast")
        report["notes"]["peers"] = "diffusers + PEFT (add_adapter on the same modules, adapters cast to fp32)"
        report["lora"] = {"rank": lora.args.rank, "alpha": lora.args.alpha, "modules": len(lora.modules),
                          "targets": list(family_of_args(args).default_lora_targets),
                          "trainable_params": sum(v.numel() for v in lora.weights.values())}

    def data_for(bs: int) -> tuple[list[ImageBatch], int]:
        if bs not in data:
            data[bs] = (make_batches(cfg, args, bs, warmup + steps, device, dtype, seed + bs),
                        family_of_args(args).train_flops(meta_model, bs, N, L))
        return data[bs]

    def measured(build: Callable[[], Run], bs: int, label: str, compiled: bool | None = None) -> dict[str, Any]:
        if budget.spent():
            return budget.skipped()
        host, flops = data_for(bs)
        r = attempt(build, host, warmup, steps, cfg.lr, flops)
        if compiled is not None:
            r["compile"] = compiled
        if lora is not None and "step_s_median" in r:  # the full fine-tune's 6·N count over the same step time
            full_flops = family_of_args(args).train_flops(meta_full, bs, N, L)
            r["mfu_6n"] = full_flops / r["step_s_median"] / 1e12 / PEAK_TFLOPS
        print(f"{label} batch={bs}: " + _said(r), flush=True)
        return r

    def emit() -> None:
        summarize(report)
        if on_result is not None:
            on_result(report)

    for bs in batches:
        for c in modes:
            v = dataclasses.replace(base, compile=c)
            report["atelier_runs"].setdefault(str(bs), {})[str(c)] = measured(
                lambda: build_atelier(args, sd, v, exact, lora), bs, f"atelier bf16 compile={c}", c)
            emit()
    best = _best(report["sweep"])
    main_variant = dataclasses.replace(base, compile=report["sweep"][best]["compile"] if best else modes[0])
    f_modes = (False,) if exact else tuple(fp8_compile_modes or (main_variant.compile,))
    for recipe in fp8:
        for bs in fp8_batches or ([int(best)] if best else []):
            for c in f_modes:
                v = dataclasses.replace(main_variant, compile=c, precision="fp8", fp8_recipe=recipe)
                r = measured(lambda: build_atelier(args, sd, v, exact), bs, f"atelier fp8-{recipe} compile={c}", c)
                report["fp8_runs"].setdefault(recipe, {}).setdefault(str(bs), {})[str(c)] = r
                emit()
    for p in peers:
        for bs in peer_batches or batches:
            try:
                report["peer_runs"][p][str(bs)] = measured(
                    lambda: build_peer(p, args, sd, exact, lora, checkpointing != "none"), bs, p)
            except ImportError as e:
                report["peer_runs"][p] = {"skipped": f"import failed: {e}"}
                emit()
                break
            emit()

    if ablation and best is not None:
        switches = {"no_compile": dataclasses.replace(main_variant, compile=False),
                    "reference_kernels": dataclasses.replace(main_variant, kernels="ref"),
                    "foreach_adamw": dataclasses.replace(main_variant, fused_adamw=False),
                    **{f"sdpa_{b}": dataclasses.replace(main_variant, attention=b) for b in SDPA_BACKENDS}}
        chosen = [a for a in ablation if device.type == "cuda" or not a.startswith("sdpa_")]  # SDPA choice: GPU
        for abl in chosen:
            v = switches[abl]
            r = measured(lambda: build_atelier(args, sd, v, exact, lora), int(best), f"ablation {abl}")
            report["ablation_runs"][abl] = {k: r.get(k) for k in ("images_per_s", "peak_gb", "oom", "failed", "error",
                                                                  "skipped")}
            emit()
    if profile_path is not None and best is not None and device.type == "cuda" and not budget.spent():
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        report["profile"] = str(profile_run(lambda: build_atelier(args, sd, main_variant, exact, lora),
                                            data_for(int(best))[0], cfg.lr, profile_path))
        gc.collect()
        torch.cuda.empty_cache()
    report["ema_update"] = ema_timing(args, sd, device, lora)
    bs = int(best) if best else batches[0]
    if loader and not budget.spent():
        try:  # a loader failure (e.g. webdataset missing) must not lose the measurements above
            with tempfile.TemporaryDirectory(prefix="atelier-bench-loader-") as tmp:
                report["loader"] = loader_throughput(cfg, args, bs, loader_workers, device, Path(tmp))
        except (ImportError, OSError, RuntimeError, ValueError) as e:
            report["loader"] = {"images_per_s": None, "workers": loader_workers, "error": f"{type(e).__name__}: {e}"}
    else:
        report["loader"] = {"images_per_s": None, "workers": loader_workers,
                            "error": "not measured (--no-loader)" if not loader else budget.reason()}
    report["loader_images_per_s"] = report["loader"]["images_per_s"]
    train = report["atelier"].get("images_per_s")
    report["loader"]["ratio_to_training"] = report["loader_images_per_s"] / train if train and \
        report["loader_images_per_s"] else None
    report["clocks"]["after"] = clocks()
    emit()
    return report


def _said(r: dict[str, Any]) -> str:
    return run_status(r, lambda x: f"{x['images_per_s']:.2f} images/s")


def _rate(r: dict[str, Any]) -> str:
    return f"{r['images_per_s']:.2f}" if _ok(r) else _said(r)


def _failed(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return no_rate(runs, "batches")


def _loss_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The report's derived fields from its raw runs (sweep, fp8_runs, peer_runs, ablation_runs), in place: each
    configuration's best run, the strongest peer and the ratios against it, loss parity with diffusers, the FP8 rows
    against bf16 on the same batches. Idempotent: called after every run."""
    sweep, by_compile = best_per_size(report["atelier_runs"], "images_per_s")
    report["sweep"] = sweep
    if by_compile:
        report["sweep_by_compile"] = by_compile
    best = _best(sweep)
    report["atelier"] = {**_summary(sweep[best], int(best), report), "compile": sweep[best].get("compile")} \
        if best else _failed(sweep)
    report["peers"], report["loss_mean_abs_diff_by_peer"] = {}, {}
    for p, runs in report["peer_runs"].items():
        if "skipped" in runs:
            report["peers"][p] = {"skipped": runs["skipped"]}
            continue
        k = _best(runs)
        report["peers"][p] = _summary(runs[k], int(k), report) if k else _failed(runs)
        same = [m for m in runs if _ok(runs[m]) and _ok(sweep.get(m, {}))]
        if same:  # the same batches through both: the largest micro-batch both ran
            m = max(same, key=int)
            report["loss_mean_abs_diff_by_peer"][p] = {"batch": int(m), "diff": _loss_diff(
                sweep[m]["timed_losses"], runs[m]["timed_losses"])}
    first = report["loss_mean_abs_diff_by_peer"].get("diffusers")
    report["loss_mean_abs_diff"] = first["diff"] if first else None
    mine = report["atelier"].get("images_per_s")
    ran = {p: r["images_per_s"] for p, r in report["peers"].items() if r.get("images_per_s")}
    report["speedup"] = {p: mine / v for p, v in ran.items()} if mine else {}
    report["strongest_peer"] = max(ran, key=ran.get) if ran else None
    report["speedup_vs_strongest_peer"] = report["speedup"].get(report["strongest_peer"])
    report["fp8"] = {}
    for recipe, by_bs in report["fp8_runs"].items():
        flat = {(bs, c): r for bs, modes in by_bs.items() for c, r in modes.items()}
        ok = [key for key, r in flat.items() if _ok(r)]
        if not ok:
            report["fp8"][recipe] = _failed({str(i): r for i, r in enumerate(flat.values())})
            continue
        bs, c = max(ok, key=lambda key: flat[key]["images_per_s"])
        r = flat[(bs, c)]
        row = {**_summary(r, int(bs), report), "compile": c == "True"}
        same = report["atelier_runs"].get(bs, {})
        bf16 = same.get(c) if _ok(same.get(c, {})) else sweep.get(bs, {})
        if _ok(bf16):
            row["speedup_vs_bf16_same_batches"] = r["images_per_s"] / bf16["images_per_s"]
            row["loss_mean_abs_diff_vs_bf16"] = _loss_diff(r["timed_losses"], bf16["timed_losses"])
        if ran:
            row["speedup_vs_strongest_peer"] = r["images_per_s"] / max(ran.values())
        report["fp8"][recipe] = row
    report["ablation"], report["attention"] = {}, {}
    if report["ablation_runs"] and mine:
        report["ablation"]["all_on"] = mine
        for abl, r in report["ablation_runs"].items():
            (report["attention"] if abl.startswith("sdpa_") else report["ablation"])[abl] = r.get("images_per_s")
    return report


# ------------------------------------------------------------------------------------------------ report

def markdown(report: dict[str, Any]) -> str:
    """The result table: Atelier (bf16, each FP8 recipe) and each peer at its best micro-batch, the FP8 ablation, the
    ablation, attention, loader, EMA."""
    c, lora = report["config"], report.get("lora")
    what = f", LoRA r{lora['rank']} on {lora['modules']} linears (MFU: 4·N + 6·N_lora)" if lora else ""
    ac = report["run"].get("activation_checkpointing", "none")
    what += f", activation checkpointing {ac} (peers: diffusers' gradient checkpointing)" if ac != "none" else ""
    top = report["peers"].get(report.get("strongest_peer") or "", {}).get("images_per_s")
    lines = [f"## imagegen {c['name']} ({c['image_tokens']} image + {c['text_tokens']} text tokens{what}) — "
             f"{report['gpu'].get('name') or 'cpu'}, measured matmul bf16 {fmt(report['matmul_tflops'], '.0f')} / "
             f"FP8 {fmt(report.get('matmul_tflops_fp8_best'), '.0f')} TFLOP/s", "",
             "| run | batch | images/s (min–max) | × strongest peer | MFU (989) | MFU (1,979) | "
             "MFU vs bf16 matmul | MFU vs FP8 matmul | peak GB |", "|---|---|---|---|---|---|---|---|---|"]
    rows = [("atelier bf16", report["atelier"])] + [(f"atelier fp8 {k}", r) for k, r in report["fp8"].items()] \
        + list(report["peers"].items())
    for name, r in rows:
        if "images_per_s" not in r:
            what = "OOM" if r.get("oom") else r.get("skipped") or r.get("error") or "failed (see JSON)"
            lines.append(f"| {name} | — | {what} | | | | | | |")
            continue
        ratio = f"{r['images_per_s'] / top:.2f}×" if top else "—"
        lines.append(f"| {name} | {r['batch']} | {r['images_per_s']:.2f} ({r['images_per_s_min']:.2f}–"
                     f"{r['images_per_s_max']:.2f}) | {ratio} | {r['mfu']:.1%} | {fmt(r.get('mfu_fp8_peak'), '.1%')} | "
                     f"{fmt(r.get('mfu_matmul'), '.1%')} | {fmt(r.get('mfu_matmul_fp8'), '.1%')} | "
                     f"{fmt(r['peak_gb'], '.1f')} |")
    peer = "diffusers + PEFT" if lora else "diffusers"
    lines += ["", f"loss mean abs diff vs {peer}: {fmt(report['loss_mean_abs_diff'], '.2e')}; speedup: "
              + ", ".join(f"{p} {s:.2f}x" for p, s in report["speedup"].items())]
    if lora:
        lines += ["", "MFU with the full fine-tune's 6·N count over the same times (what most peers quote): "
                  + ", ".join(f"{name} {fmt(r.get('mfu_6n'), '.1%')}"
                              for name, r in [("atelier", report["atelier"]), *report["peers"].items()])]
    if report["fp8_runs"]:
        lines += ["", "| FP8 ablation | batch | compile | images/s | × bf16, same batches | loss mean abs diff "
                      "vs bf16 |", "|---|---|---|---|---|---|"]
        lines += [f"| bf16 (FP8 off) | {bs} | {c} | {_rate(r)} | 1.00× | — |"
                  for bs, modes in report["atelier_runs"].items() for c, r in modes.items()]
        for recipe, by_bs in report["fp8_runs"].items():
            for bs, modes in by_bs.items():
                for comp, r in modes.items():
                    bf16 = report["atelier_runs"].get(bs, {}).get(comp, {})
                    both = _ok(r) and _ok(bf16)
                    ratio = f"{r['images_per_s'] / bf16['images_per_s']:.2f}×" if both else "—"
                    dl = f"{_loss_diff(r['timed_losses'], bf16['timed_losses']):.2e}" if both else "—"
                    lines.append(f"| fp8 {recipe} | {bs} | {comp} | {_rate(r)} | {ratio} | {dl} |")
    for title, table in (("ablation (one switched off)", report["ablation"]),
                         ("attention backend", report["attention"])):
        if table:
            lines += ["", f"| {title} | images/s |", "|---|---|"]
            lines += [f"| {k} | {fmt(v, '.2f') if v is not None else 'failed/OOM/skipped'} |" for k, v in table.items()]
    ld, ema = report.get("loader"), report.get("ema_update")
    if ld is not None:
        why = f" ({ld['error']})" if ld.get("error") else ""
        lines += ["", f"loader: {fmt(ld['images_per_s'], '.1f')} images/s with {ld['workers']} workers "
                  f"({fmt(ld.get('ratio_to_training'), '.1f')}x the training rate){why}"]
    if ema is not None:
        lines.append(f"EMA update: {ema['foreach_ms']:.2f} ms foreach vs {ema['reference_ms']:.2f} ms per-tensor")
    return "\n".join(lines) + "\n"


def ablation_chart(report: dict[str, Any], path: Path) -> Path | None:
    """Images/s with each optimisation off, with each attention backend, with each FP8 recipe; the peers as dashed
    lines."""
    marks = {p: r["images_per_s"] for p, r in report["peers"].items() if "images_per_s" in r}
    bars = dict(report["ablation"] or ({"all_on": report["atelier"]["images_per_s"]}
                                       if "images_per_s" in report["atelier"] else {}))
    bars.update(report["attention"])
    bars.update({f"fp8 {k}": r.get("images_per_s") for k, r in report["fp8"].items()})
    return bar_chart(bars.items(), "images/s", f"imagegen {report['config']['name']}: ablation, attention, FP8", path,
                     marks)


def report_name(report: dict[str, Any]) -> str:
    lora = report.get("lora")
    ac = report["run"].get("activation_checkpointing", "none") != "none"
    return f"imagegen-{report['config']['name']}" + (f"-lora{lora['rank']}" if lora else "") + ("-ac" if ac else "")


def write(report: dict[str, Any], out: Path) -> Path:
    return write_report(report, out, report_name(report), markdown(report), lambda path: ablation_chart(report, path))


def loader_only(cfg: BenchConfig, batches: list[int], workers: int) -> int:
    """Print the loader's images/s at the config's sample shapes for 0..`workers` threads (no model, no report)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = model_args(cfg)
    for w in sorted({0, workers}):
        with tempfile.TemporaryDirectory(prefix="atelier-bench-loader-") as tmp:
            r = loader_throughput(cfg, args, batches[-1], w, device, Path(tmp))
        print(f"loader {cfg.resolution} px, batch {r['batch']}, {w} threads: {r['images_per_s']:.1f} images/s "
              f"({r['images_per_s'] * r['bytes_per_image'] / 2**20:.0f} MiB/s) to {device}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The bench's command line (bench/session.py's plan is checked against it)."""
    p = argparse.ArgumentParser(prog="python3 -m atelier_studio.bench.imagegen", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, choices=sorted(CONFIGS))
    p.add_argument("--out", default="bench/results")
    p.add_argument("--peers", default="diffusers")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="LoRA of this rank on a frozen bf16 base instead of full fine-tuning; the peers get PEFT")
    p.add_argument("--batches", type=parse_ints, default=None)
    p.add_argument("--peer-batches", type=parse_ints, default=None, help="the peers' batches; default: --batches")
    p.add_argument("--fp8", default="",
                   help=f"FP8 recipes to measure beside bf16 (comma list of {list(TRAIN_RECIPES)})")
    p.add_argument("--fp8-batches", type=parse_ints, default=None, help="the FP8 runs' batches; default: the best bf16")
    p.add_argument("--fp8-compile", choices=("on", "off", "both"), default=None,
                   help="per-block compile of the FP8 runs; default: as bf16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ablation", nargs="?", const=",".join(ABLATIONS), default="",
                   help=f"switch these off one at a time (comma list; alone: all of {','.join(ABLATIONS)})")
    p.add_argument("--loader-workers", type=int, default=4)
    p.add_argument("--no-loader", action="store_true", help="skip the loader measurement (it writes ~0.8 GB of shards)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds: runs that would start later are recorded as skipped (the report is rewritten "
                        "after every run)")
    p.add_argument("--kernels", choices=("auto", "triton", "ref"), default="auto",
                   help="Atelier's MMDiTArgs.kernels (auto: Triton on CUDA; triton on a CPU needs TRITON_INTERPRET=1)")
    p.add_argument("--attention", choices=("auto", *SDPA_BACKENDS), default="auto",
                   help="Atelier's SDPA backend (MMDiTArgs.attention); the sdpa_* ablation rows measure each")
    p.add_argument("--profile", action="store_true", help="write a torch.profiler kernel table of Atelier's best run")
    p.add_argument("--compile", choices=("on", "off", "both"), default="on",
                   help="per-block torch.compile for Atelier; both: each batch both ways, the faster kept")
    p.add_argument("--checkpointing", choices=AC_MODES, default="none",
                   help="activation checkpointing of every Atelier block (the trainer's policy); not none: the peers "
                        "get diffusers' gradient checkpointing")
    p.add_argument("--no-cudnn-attention", action="store_true",
                   help="turn PyTorch's cuDNN SDPA backend off for every run, Atelier's and the peers' (its backward "
                        "fails at FLUX.1-dev's 1024 px shape on the device's torch 2.11 / H100: docs/performance.md)")
    p.add_argument("--tiny", action="store_true", help="tiny model, fp32, CPU: the same code path for tests")
    p.add_argument("--loader-only", action="store_true",
                   help="only the loader figure, at the config's real sample shapes, on any machine (its CPU's rate)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    peers = [x for x in a.peers.split(",") if x]
    bad = [x for x in peers if x not in PEERS]
    if bad:
        p.error(f"--peers: unknown {bad}; known: {list(PEERS)}")
    if a.steps < 1 or a.warmup < (0 if a.tiny else 3):
        p.error(f"--steps must be >= 1 and --warmup >= 3 (got {a.steps}, {a.warmup})")
    ablation = [x for x in a.ablation.split(",") if x]
    if [x for x in ablation if x not in ABLATIONS]:
        p.error(f"--ablation: unknown {[x for x in ablation if x not in ABLATIONS]}; known: {list(ABLATIONS)}")
    if a.loader_workers < 0:
        p.error(f"--loader-workers must be >= 0, got {a.loader_workers}")
    if a.lora < 0:
        p.error(f"--lora must be a rank >= 1 (or 0 for full fine-tuning), got {a.lora}")
    recipes = tuple(x for x in a.fp8.split(",") if x)
    if [x for x in recipes if x not in TRAIN_RECIPES]:
        p.error(f"--fp8: unknown {[x for x in recipes if x not in TRAIN_RECIPES]}; known: {list(TRAIN_RECIPES)}")
    if a.lora and recipes:
        p.error("--fp8 measures full fine-tuning (the trainer refuses FP8 with an MMDiT LoRA); drop --lora or --fp8")
    if a.budget_s is not None and a.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {a.budget_s}")
    cfg = CONFIGS[a.config]
    if a.loader_only:
        return loader_only(cfg, a.batches or list(cfg.batches), a.loader_workers)
    device = torch.device("cpu") if a.tiny or not torch.cuda.is_available() else torch.device("cuda")
    if a.tiny:
        cfg = tiny_config(cfg)
    elif device.type != "cuda":
        p.error("a real-size run needs a CUDA GPU; use --tiny on a CPU")
    if a.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    out = Path(a.out)
    modes = {"on": (True,), "off": (False,), "both": (True, False)}
    report = bench(a.config, cfg, peers, a.batches or list(cfg.batches), a.steps, a.warmup, ablation,
                   a.loader_workers, device, exact=a.tiny, kernels=a.kernels,
                   profile_path=out / f"imagegen-{a.config}-{time.strftime('%Y-%m-%d')}-profile.txt"
                   if a.profile else None, attention=a.attention, fp8=recipes, fp8_batches=a.fp8_batches,
                   fp8_compile_modes=modes[a.fp8_compile] if a.fp8_compile else None, peer_batches=a.peer_batches,
                   loader=not a.no_loader, budget=Budget(a.budget_s), on_result=lambda r: write(r, out),
                   compile_modes=modes[a.compile], lora_rank=a.lora, checkpointing=a.checkpointing)
    path = write(report, out)
    print(markdown(report))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
