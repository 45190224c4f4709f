"""The designer trainer's config: `[model]`, `[data]`, `[sample]`, `[lora]`, `[train]`, `[output]`.

    atelier designer train --config configs/designer/demo.toml --set lora.rank=16 --set output.dir=runs/d1
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from atelier_studio.data.chat_formats import PAIR_FORMATS
from atelier_studio.pipeline import config as engine_config
from atelier_studio.pipeline.config import MODEL_PATH, ConfigError, OutputConfig, TrainConfig
from atelier_studio.pipeline.config_diff import TRAIN_FREE, TRAIN_REFUSE, TRAIN_WARN, ResumePolicy


@dataclass(frozen=True)
class ModelConfig:
    # a Hugging Face model directory (config.json + safetensors + tokenizer files), or a hub id in the local cache
    path: str = field(default="", metadata=MODEL_PATH)
    # compute precision: "bfloat16" keeps fp32 master weights (full FT) or a frozen bf16 base (LoRA)
    # and runs the matmuls in bf16; "float32" is exact (CPU tests, parity checks)
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    attention: Literal["auto", "flash", "varlen", "sdpa"] = "auto"
    # rmsnorm / rope / swiglu / LoRA linear: "auto" = the Triton kernels on CUDA, the references elsewhere
    kernels: Literal["auto", "triton", "ref"] = "auto"
    # Qwen3.5's gated delta rule (kernels/gated_delta_rule.py): "auto" = fla-core on CUDA (an error if it is
    # not installed), the fp32 reference on CPU; "ref" accepts the slow reference anywhere
    delta_rule: Literal["auto", "fla", "ref"] = "auto"
    # Qwen3-MoE's load-balancing loss (router_aux_loss_coef · aux, over the real tokens): "auto" = config.json's
    # output_router_logits decides, as in transformers; "on" / "off" force it. Families without one: auto or off
    router_aux_loss: Literal["auto", "on", "off"] = "auto"

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path: required — a local Hugging Face model directory (see `atelier designer init`)")


@dataclass(frozen=True)
class ColumnsConfig:
    """`[data.columns]`: the file's column for a format's field, when its name differs (data/chat_formats.py);
    "" keeps the field's own name. E.g. `brief = "question"`, `caption = "answer"`."""

    brief: str = ""
    caption: str = ""
    system: str = ""
    messages: str = ""
    conversations: str = ""
    instruction: str = ""
    input: str = ""
    output: str = ""
    prompt: str = ""
    completion: str = ""
    chosen: str = ""  # preference pairs (train.objective = "dpo")
    rejected: str = ""

    def mapping(self) -> dict[str, str]:
        """{field: column} for the fields given a column of another name."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v and v != k}

    def validate(self) -> None:
        given = {k: v for k, v in dataclasses.asdict(self).items() if v}
        for name, column in given.items():
            other = next((k for k, v in given.items() if v == column and k != name), None)
            if other is not None:
                raise ConfigError(f"{name}: the column {column!r} is also data.columns.{other}'s; give each field its "
                                  f"own column")


@dataclass(frozen=True)
class DataConfig:
    # a file (.jsonl, .json, .csv, .parquet), a folder of them, or a `datasets` save_to_disk folder
    # (data/chat_formats.py; docs/data-in.md)
    train: str = ""
    eval: str = ""  # optional, read the same way
    # the records' shape: "auto" detects it per file from the columns and logs what it chose
    # (train.objective = "dpo" reads the pair formats: "brief_pair" {brief, chosen, rejected}, "preference" TRL's
    # {prompt, chosen, rejected}, "sharegpt_pair" LLaMA-Factory's {conversations, chosen, rejected})
    format: Literal["auto", "brief_caption", "messages", "prompt_completion", "sharegpt", "alpaca", "brief_pair",
                    "preference", "sharegpt_pair"] = "auto"
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    seq_len: int = 2048  # packed row length in tokens
    overflow: Literal["split", "truncate", "drop"] = "split"  # documents longer than a row
    max_eval_batches: int = 0  # 0 = the whole eval set

    def validate(self) -> None:
        if not self.train:
            raise ConfigError("train: required — a data file or folder (e.g. JSONL of {brief, caption} or {messages} "
                              "lines; docs/data-in.md lists every format)")
        if self.seq_len < 16:
            raise ConfigError(f"seq_len: must be >= 16, got {self.seq_len}")
        if self.max_eval_batches < 0:
            raise ConfigError(f"max_eval_batches: must be >= 0, got {self.max_eval_batches}")


@dataclass(frozen=True)
class LoraConfig(engine_config.LoraConfig):
    """The engine's `[lora]` (pipeline.config.LoraConfig: rank 16, alpha 32 by default) for the designer.

    targets: short names of the model family's linears (designer/family.py lora_targets: Qwen3 q k v o gate up down,
    Qwen3.5 those and qkv z b a out), checked against the family of model.path when the run starts (the family is
    known only from its config.json). init_adapter: a PEFT adapter directory.
    """

    # the frozen base's target linears: "bf16" keeps them in model.dtype; "nf4" stores them in 4 bits (QLoRA:
    # NF4 with double-quantised block scales, dequantised inside the matmul; pipeline/lora_nf4.py). The LM head,
    # embeddings and norms stay in model.dtype either way.
    base_dtype: Literal["bf16", "nf4"] = "bf16"

    def validate(self) -> None:
        super().validate()
        if self.base_dtype == "nf4" and self.rank == 0:
            raise ConfigError('base_dtype: "nf4" stores the frozen base of a LoRA run in 4 bits, but rank = 0 is full '
                              'fine-tuning, whose weights all train; set lora.rank > 0 for QLoRA, or lora.base_dtype = '
                              '"bf16"')


@dataclass(frozen=True)
class SampleConfig:
    """`[sample]`: captions the designer writes during training, at each evaluation (train.eval_every, and the end):
    greedy, for the first `briefs` briefs of data.eval, the same each time; a table (brief, caption, step) on every
    tracker and in samples/captions-step-N.jsonl, with the shapes-world judge's caption score when every brief is a
    shapes-world brief (designer/samples.py)."""

    briefs: int = 8  # 0: no captions during training
    max_new_tokens: int = 48

    def validate(self) -> None:
        if self.briefs < 0:
            raise ConfigError(f"briefs: must be >= 0 (0 = none), got {self.briefs}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class DpoConfig:
    """`[train.dpo]`: direct preference optimisation (train.objective = "dpo"; designer/dpo.py, docs/training.md).

    loss_type, as TRL's DPOTrainer names them: "sigmoid" is DPO (Rafailov et al. 2023), -log σ(β·margin) with
    margin = (log π(chosen) - log π_ref(chosen)) - (log π(rejected) - log π_ref(rejected)), log-probabilities summed
    over each caption's tokens; "ipo" is IPO (Azar et al. 2023), (margin' - 1/(2β))², on the log-ratios averaged
    over each caption's tokens (the length-normalised form TRL uses).

    sft_weight w adds w × the chosen captions' mean NLL per token to the loss (RPO's anchor; TRL's
    loss_type = [loss_type, "sft"] with loss_weights = [1, w]): 0 is plain DPO / IPO."""

    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    sft_weight: float = 0.0

    def validate(self) -> None:
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ConfigError(f"beta: must be a finite number > 0, got {self.beta}")
        if not (self.sft_weight >= 0 and math.isfinite(self.sft_weight)):
            raise ConfigError(f"sft_weight: must be a finite number >= 0 (0 = plain DPO), got {self.sft_weight}")


@dataclass(frozen=True)
class DesignerTrainConfig(TrainConfig):
    """The engine's `[train]` (pipeline.config.TrainConfig) with the designer's objective: "sft" learns the captions
    of brief/caption data; "dpo" learns from {brief, chosen, rejected} pairs against the frozen starting model
    (`[train.dpo]`)."""

    objective: Literal["sft", "dpo"] = "sft"
    dpo: DpoConfig = field(default_factory=DpoConfig)


@dataclass(frozen=True)
class DesignerConfig:
    # what a resume may change (pipeline/config_diff.py; docs/training.md): the model and its dtype, the data stream
    # (the train file, its format and columns, row length, overflow policy) and everything that fixes the adapters'
    # shapes and meaning are refused; kernels, attention and delta-rule paths (the same math), the MoE auxiliary loss,
    # the eval set and lora.dropout are hyper-parameters or execution choices, taken with a warning
    resume_policy: ClassVar[ResumePolicy] = ResumePolicy(
        refuse=("model.path", "model.dtype", "train.objective", "data.train", "data.format", "data.columns",
                "data.seq_len", "data.overflow", "lora", *TRAIN_REFUSE),
        warn=("model.attention", "model.kernels", "model.delta_rule", "model.router_aux_loss", "data.eval",
              "data.max_eval_batches", "lora.dropout", "sample", *TRAIN_WARN),
        free=TRAIN_FREE)

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: DesignerTrainConfig = field(default_factory=DesignerTrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def validate(self) -> None:
        pairs = self.data.format in PAIR_FORMATS
        if pairs and self.train.objective != "dpo":
            raise ConfigError(f'data.format = "{self.data.format}" holds preference pairs, which train.objective = '
                              f'"{self.train.objective}" cannot learn from; set train.objective = "dpo", or give '
                              f'brief/caption data')
        if self.train.objective == "dpo" and self.data.format not in ("auto", *PAIR_FORMATS):
            raise ConfigError(f'train.objective = "dpo" learns from preference pairs, but data.format = '
                              f'"{self.data.format}" holds one answer per prompt; set data.format to one of '
                              f'{", ".join(PAIR_FORMATS)} (or "auto")')
        if self.train.objective == "dpo" and self.model.router_aux_loss == "on":
            raise ConfigError('model.router_aux_loss = "on" with train.objective = "dpo": the DPO loss does not add a '
                              'Qwen3-MoE\'s load-balancing term yet; leave model.router_aux_loss = "auto" or "off"')
        if self.lora.base_dtype == "nf4" and self.train.precision == "fp8":
            raise ConfigError('lora.base_dtype = "nf4" with train.precision = "fp8": a frozen base is stored in NF4 or '
                              'computed in FP8, not both; set one of them back ("bf16")')
        if self.lora.base_dtype == "nf4" and self.train.distributed.param_dtype != "auto":
            raise ConfigError(f'train.distributed.param_dtype = "{self.train.distributed.param_dtype}" with '
                              f'lora.base_dtype = "nf4": a QLoRA run keeps every parameter in its own dtype under '
                              f'FSDP2 (the NF4 tensors are bytes); leave train.distributed.param_dtype = "auto"')
