"""The designer's `--dry-run` plan (pipeline/dry_run.py): the model from its config.json on the meta device, LoRA
applied as the run would, the training data tokenized and packed (the tokenizer files only), no weights read."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from atelier_studio.data.chat import encode_examples
from atelier_studio.data.chat_formats import load_data
from atelier_studio.data.packing import pack_documents, pack_pairs
from atelier_studio.data.tokenizer import load_tokenizer
from atelier_studio.designer.config import DesignerConfig
from atelier_studio.designer.hf import build_model, read_args
from atelier_studio.designer.lora import LoraArgs, apply_lora
from atelier_studio.designer.preference import encode_pairs
from atelier_studio.designer.registry import family_of_args
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.dry_run import Plan, activation_bytes, fp8_memory, optimizer_memory, parameter_bytes
from atelier_studio.pipeline.float8 import apply_fp8
from atelier_studio.pipeline.hub import resolve_model_path
from atelier_studio.pipeline.lora_fp8 import FP8_CONVERSIONS

NF4_BYTES = 0.5 + 4 / 64  # 4 bits a weight and an fp32 scale per block of 64 (kernels/nf4.py)


def designer_plan(cfg: DesignerConfig) -> Plan:
    model_dir = Path(resolve_model_path(cfg.model.path, "model.path"))
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path: {model_dir} has no config.json (a Hugging Face model directory; see "
                          f"`atelier designer init`)")
    args = read_args(model_dir)
    family = family_of_args(args)
    full = cfg.lora.rank == 0
    base_dtype = torch.float32 if (cfg.model.dtype == "float32" or full) else torch.bfloat16
    act_bytes = 4 if cfg.model.dtype == "float32" else 2
    train = cfg.train
    tokens_per_micro = train.micro_batch * cfg.data.seq_len
    with torch.device("meta"):
        model = build_model(args).to(base_dtype)
        blocks = family.blocks(model)
        activations = activation_bytes(blocks[0], len(blocks), args.dim, tokens_per_micro, act_bytes,
                                       train.distributed.activation_checkpointing)
        if not full:
            try:
                targets = family.resolve_lora_targets(cfg.lora.targets)
            except ValueError as e:
                raise ConfigError(f"lora.targets: {e}") from None
            apply_lora(model, LoraArgs(**asdict(cfg.lora.args(targets))))
        if train.precision == "fp8":  # as the task applies it (designer/task.py): after LoRA, the LM head kept
            apply_fp8(model, train.fp8_recipe, conversions=FP8_CONVERSIONS)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    weights = parameter_bytes(model)
    notes = ["per process; under torchrun FSDP2 divides weights, gradients and optimizer state by the processes",
             "activations are counted from the dense linears: a mixture-of-experts layer's experts are not"]
    if cfg.lora.base_dtype == "nf4":  # the frozen bases in 4 bits instead of model.dtype
        frozen = total - trainable
        weights += int(frozen * NF4_BYTES) - frozen * 2
        notes.append("NF4 bases counted at 4.5 bits a weight (embeddings, norms and the LM head stay bf16)")
    dataset, doc_lens, loss_tokens = _packed_data(cfg, model_dir, train.micro_batch * train.grad_accum)
    flops = family.train_flops(model, doc_lens, loss_tokens)
    if cfg.train.objective == "dpo" and not full and not cfg.lora.init_adapter:  # the reference forward of each step
        flops += model.forward_flops(doc_lens, loss_tokens)
        notes.append("DPO: each step adds the reference forward (adapters off, no gradients) to the FLOPs")
    return Plan(params_total=total, params_trainable=trainable, unit="tokens",
                units_per_step=tokens_per_micro * train.grad_accum, flops_per_step=int(flops),
                memory={"weights": weights, **optimizer_memory(model), **fp8_memory(model, train.precision),
                        "activations": activations},
                dataset=dataset, notes=tuple(notes))


def _packed_data(cfg: DesignerConfig, model_dir: Path, rows: int) -> tuple[str, list[int], int]:
    """The training data packed as the run packs it: a description, and the document lengths and loss tokens of a
    step's rows (the first `rows` rows; full rows of one document each when there is no data to read)."""
    seq_len = cfg.data.seq_len
    if not Path(cfg.data.train).exists():  # a file or a folder of files (data/chat_formats.py)
        return (f"data.train {cfg.data.train} not found: FLOPs for rows of one {seq_len}-token document",
                [seq_len] * rows, seq_len * rows)
    tokenizer = load_tokenizer(model_dir)
    dpo = cfg.train.objective == "dpo"
    examples = load_data(cfg.data.train, cfg.data.format, cfg.data.columns.mapping(), pairs=dpo)[0]
    if dpo:  # pairs side by side in a row, as the run packs them (designer/preference.py)
        packed = pack_pairs(encode_pairs(tokenizer, examples, seq_len, cfg.data.overflow, cfg.data.train)[0], seq_len)
    else:
        packed = pack_documents(encode_examples(tokenizer, examples), seq_len, cfg.data.overflow)
    s = packed.stats
    step_rows = [i % max(s.num_rows, 1) for i in range(rows)]
    doc_lens = [n for i in step_rows for n in packed.doc_lens[i]]
    loss_tokens = sum(packed.num_loss_tokens[i] for i in step_rows)
    steps = s.num_rows // rows
    return (f"{cfg.data.train}: {s.num_docs} documents, {s.num_tokens:,} tokens -> {s.num_rows} rows of {seq_len} "
            f"({s.padding_fraction:.1%} padding; split {s.num_split}, truncated {s.num_truncated}, dropped "
            f"{s.num_dropped}); {steps} optimizer steps per epoch", doc_lens, loss_tokens)


__all__ = ["designer_plan"]
