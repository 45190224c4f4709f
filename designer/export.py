"""`atelier designer export --merge RUN`: a LoRA or QLoRA run's adapter merged into a full HF model directory.

RUN is a run folder (its adapter/ and config.toml) or a PEFT adapter folder (adapter_config.json, whose
base_model_name_or_path names the base). The base is loaded, the adapter applied (designer/lora.py
load_peft_adapter), and every target becomes W + s·B·A, summed in fp32 (merge_lora) and cast once to the output
dtype (default: the base's config.json dtype) by designer/hf.py's writer: the same sharding, config.json and
tokenizer files as any model directory Atelier writes, written atomically.

QLoRA (the run's config.toml has lora.base_dtype = "nf4"): the trainer computed with Ŵ = dequantise(NF4(W)), the
base quantised from the dtype it was loaded in (bf16, or fp32 when model.dtype = "float32"). The export quantises
the base the same way and merges onto Ŵ (in fp32), so the merged model is the one the run evaluated; its weights
carry the NF4 rounding (the log says so). Qwen3-MoE's per-expert adapters merge into the stacked experts
(GroupedLoRA), which hf.py writes in the released per-expert layout (model.layers.i.mlp.experts.{e}.*_proj.weight).
"""
from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from atelier_studio.data.textfile import read_json
from atelier_studio.designer.decoder import CausalLM
from atelier_studio.designer.hf import load_pretrained, save_pretrained
from atelier_studio.designer.lora import load_peft_adapter, merge_lora
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.hub import resolve_model_path
from atelier_studio.pipeline.lora import LoRALinear
from atelier_studio.pipeline.lora_nf4 import NF4LoRALinear, quantize_lora_bases
from atelier_studio.pipeline.nf4 import NF4ExpertStack

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class MergeSource:
    """What a merge reads: the adapter folder, its base model folder, and how the run held the base."""

    adapter: Path
    base: Path
    nf4: bool  # the run stored its LoRA bases in NF4 (QLoRA)
    base_load_dtype: torch.dtype  # the dtype the run loaded the base in (what NF4 was quantised from)
    run_config: bool  # the run's config.toml was found (the adapter alone says nothing of NF4)


def _run_config(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read the run's config: {e}") from None


def merge_source(run: Path) -> MergeSource:
    """The adapter, base and QLoRA flag of a run folder or an adapter folder; anything else is a ModelLoadError
    naming what is missing."""
    run = Path(run)
    if not run.is_dir():
        raise ModelLoadError(f"--merge {run}: not a directory (pass a LoRA run folder or its adapter/ folder)")
    if (run / "adapter_config.json").is_file():
        adapter, config = run, run.parent / "config.toml"  # a run's adapter/ sits beside the run's config.toml
    elif (run / "adapter" / "adapter_config.json").is_file():
        adapter, config = run / "adapter", run / "config.toml"
    else:
        full = " (a full fine-tuning run: its model/ is already a full model)" if (run / "model").is_dir() else ""
        raise ModelLoadError(f"--merge {run}: not a LoRA run: no adapter/adapter_config.json or "
                             f"adapter_config.json{full}")
    if not (adapter / "adapter_model.safetensors").is_file():
        raise ModelLoadError(f"{adapter}: adapter_model.safetensors is missing (an unfinished or copied-in-part run?)")
    cfg = read_json(adapter / "adapter_config.json", ModelLoadError)
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if not base:
        raise ModelLoadError(f"{adapter / 'adapter_config.json'}: no base_model_name_or_path (the base to merge into)")
    base_dir = Path(resolve_model_path(base, f"{adapter / 'adapter_config.json'}: base_model_name_or_path"))
    run_cfg = _run_config(config) if config.is_file() else {}
    nf4 = run_cfg.get("lora", {}).get("base_dtype") == "nf4"
    exact = run_cfg.get("model", {}).get("dtype") == "float32"
    return MergeSource(adapter, base_dir, nf4, torch.float32 if exact else torch.bfloat16, config.is_file())


def base_dtype(base: Path) -> torch.dtype:
    """The dtype the base's config.json declares (torch_dtype, or transformers 5's dtype); bfloat16 if none."""
    cfg = read_json(base / "config.json", ModelLoadError)
    name = (cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16") if isinstance(cfg, dict) else "bfloat16"
    return DTYPES.get(str(name), torch.bfloat16)


def dequantize_nf4_bases(model: CausalLM, dtype: torch.dtype) -> None:
    """Every NF4 base of a QLoRA model back as plain weights holding Ŵ in `dtype`, in place: an NF4LoRALinear becomes
    a LoRALinear (same adapters) over an nn.Linear, an NF4 expert stack a Parameter, for merge_lora. Ŵ comes in the
    dtype the base was quantised from, so `dtype` (that one, or fp32) holds it exactly."""
    for name, m in list(model.named_modules()):
        if isinstance(m, NF4LoRALinear):
            q = m.base_layer
            base = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, dtype=dtype).requires_grad_(False)
            with torch.no_grad():
                base.weight.copy_(q.dequantized_weight())
                if q.bias is not None:
                    base.bias.copy_(q.bias)
            plain = LoRALinear.__new__(LoRALinear)
            nn.Module.__init__(plain)
            plain.base_layer, plain.lora_A, plain.lora_B, plain.dropout = base, m.lora_A, m.lora_B, m.dropout
            plain.scale, plain.rank, plain.impl = m.scale, m.rank, m.impl
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, plain)
        elif isinstance(m, NF4ExpertStack):
            parent, _, leaf = name.rpartition(".")
            host = model.get_submodule(parent)
            weight = nn.Parameter(m.experts().dequantize().to(dtype), requires_grad=False)
            delattr(host, leaf)  # the NF4 module goes; the Parameter of the same name takes its place
            setattr(host, leaf, weight)


def export_merged(run: Path, out: Path, dtype: str | None = None, log: Callable[[str], None] = print,
                  max_shard_bytes: int = 5 * 2**30) -> Path:
    """Merge RUN's adapter into its base and write the full model to `out` (module docstring), in safetensors shards
    of at most `max_shard_bytes` (hf.save_pretrained's default). Returns `out`."""
    src = merge_source(run)
    out_dtype = DTYPES[dtype] if dtype else base_dtype(src.base)
    # The dtype the base weights are held in: merge_lora sums W + s·B·A in fp32 and casts the sum to it, the writer
    # casts to out_dtype. Holding the base in out_dtype when that is the dtype the weights come in (the base's own,
    # or the run's for NF4) costs no rounding and half the memory of fp32; otherwise fp32, so the cast is the only one.
    held = src.base_load_dtype if src.nf4 else base_dtype(src.base)
    work = out_dtype if out_dtype == held else torch.float32
    model = load_pretrained(src.base, dtype=src.base_load_dtype if src.nf4 else work)
    lora = load_peft_adapter(model, src.adapter)
    if src.nf4:
        done, _ = quantize_lora_bases(model)
        dequantize_nf4_bases(model, work)
        log(f"QLoRA run: {len(done)} NF4 bases quantised from {str(src.base_load_dtype).removeprefix('torch.')} as "
            f"the run did, and merged dequantised: the merged weights carry the NF4 rounding of the base")
    elif not src.run_config:
        log(f"no run config.toml beside {src.adapter}: merged as a LoRA adapter on the unquantised base")
    merge_lora(model)
    tokenizer = src.adapter if (src.adapter / "tokenizer.json").is_file() else src.base
    tokenizer = tokenizer if (tokenizer / "tokenizer_config.json").is_file() else None
    save_pretrained(model, out, dtype=out_dtype, max_shard_bytes=max_shard_bytes, tokenizer_dir=tokenizer)
    note = "" if tokenizer else " (no tokenizer files found beside the adapter or the base)"
    log(f"merged the LoRA r{lora.rank} adapter {src.adapter} into {src.base}: a full "
        f"{str(out_dtype).removeprefix('torch.')} model at {out}{note}")
    return out
