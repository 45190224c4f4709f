"""The designer's task on the shared engine: packed brief→caption rows, loss on caption tokens only.

Precision (DESIGN.md): with `model.dtype = "bfloat16"`, full fine-tuning keeps fp32 master weights and
runs the forward under bf16 autocast; LoRA keeps a frozen bf16 base and adapter weights in `lora.dtype`.
`"float32"` is exact throughout (CPU tests, parity checks). The loss is reduced in fp32.

The LM head and the cross-entropy run only on the tokens that carry a label (the caption tokens), in
chunks (`kernels.cross_entropy.linear_cross_entropy`), so the [tokens, vocab] logits never exist at
once. The indices of those tokens are computed on the host with the batch, so selecting them costs
no device sync.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from data.chat import encode_examples, load_examples
from data.packing import Batch, PackedLoader, pack_documents
from data.tokenizer import load_tokenizer
from designer.config import DesignerConfig
from designer.hf import load_pretrained, save_pretrained
from designer.lora import LoraArgs, apply_lora, load_peft_adapter, merge_lora, save_peft_adapter
from kernels.cross_entropy import linear_cross_entropy
from pipeline.progress import log

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


@dataclass
class DeviceBatch:
    """A packed micro-batch on the device, plus the host-side counts the trainer reads without syncing."""

    batch: Batch
    loss_index: torch.Tensor  # [num_loss_tokens] positions (in the flattened B*T tokens) that carry a label


class DesignerTask:
    unit = "tokens"

    def __init__(self, cfg: DesignerConfig, device: torch.device, rank: int = 0, world_size: int = 1):
        self.cfg = cfg
        self.device = device
        model_dir = Path(cfg.model.path)
        self.tokenizer = load_tokenizer(model_dir)
        self.train_loader = self._loader(cfg.data.train, rank, world_size, drop_last=True)
        self.eval_loader = self._loader(cfg.data.eval, rank, world_size, drop_last=False) if cfg.data.eval else None

        exact = cfg.model.dtype == "float32"
        full = cfg.lora.rank == 0
        # full FT: fp32 master weights; LoRA: the frozen base in the compute dtype
        base_dtype = torch.float32 if (exact or full) else torch.bfloat16
        self.model = load_pretrained(model_dir, dtype=base_dtype, device=device)
        self.model.args = _with_attention(self.model.args, cfg.model.attention)
        self.lora_args: LoraArgs | None = None
        if not full:
            self.lora_args = LoraArgs(rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                                      targets=cfg.lora.targets, rslora=cfg.lora.rslora, dtype=cfg.lora.dtype)
            if cfg.lora.init_adapter:
                load_peft_adapter(self.model, cfg.lora.init_adapter)
            else:
                apply_lora(self.model, self.lora_args)
        self.autocast = (not exact)
        n_train = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        n_all = sum(p.numel() for p in self.model.parameters())
        log(f"designer: {n_all / 1e6:.3f}M parameters, {n_train / 1e6:.3f}M trainable "
            f"({'full fine-tuning' if full else f'LoRA r{cfg.lora.rank}'}), {cfg.model.dtype} on {device}")

    # ------------------------------------------------------------------ data

    def _loader(self, path: str, rank: int, world_size: int, drop_last: bool) -> PackedLoader:
        examples = load_examples(path)
        docs = encode_examples(self.tokenizer, examples)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        packed = pack_documents(docs, self.cfg.data.seq_len, self.cfg.data.overflow, pad_id=pad_id)
        s = packed.stats
        log(f"data {path}: {s.num_docs} documents → {s.num_rows} rows of {self.cfg.data.seq_len} tokens, "
            f"{s.padding_fraction:.1%} padding, split {s.num_split}, truncated {s.num_truncated}, dropped {s.num_dropped}")
        return PackedLoader(packed, self.cfg.train.micro_batch, self.cfg.train.seed, rank, world_size,
                            drop_last=drop_last)

    def _to_device(self, batch: Batch) -> DeviceBatch:
        loss_index = batch.labels.reshape(-1).ne(-100).nonzero().squeeze(1)  # on the host: no device sync
        return DeviceBatch(batch.to(self.device), loss_index.to(self.device, non_blocking=True))

    def train_batches(self) -> Iterator[DeviceBatch]:
        return (self._to_device(b) for b in self.train_loader)

    # ------------------------------------------------------------------ the step

    def batch_weight(self, b: DeviceBatch) -> int:
        return b.batch.num_loss_tokens

    def batch_units(self, b: DeviceBatch) -> int:
        return b.batch.num_tokens

    def batch_flops(self, b: DeviceBatch) -> int:
        return self.model.train_flops(b.batch.doc_lens, head_tokens=b.batch.num_loss_tokens)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def loss_sum(self, b: DeviceBatch) -> torch.Tensor:
        batch = b.batch
        with self._autocast():
            hidden = self.model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)  # [B,T,D]
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, b.loss_index)  # [N,D]
            labels = batch.labels.reshape(-1).index_select(0, b.loss_index)  # [N]
            weight = self.model.lm_head_weight
            return linear_cross_entropy(hidden, weight, labels)

    def evaluate(self) -> dict[str, float]:
        if self.eval_loader is None:
            return {}
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = 0
        for i, batch in enumerate(self.eval_loader.iter_eval_batches()):
            if self.cfg.data.max_eval_batches and i >= self.cfg.data.max_eval_batches:
                break
            if batch.num_loss_tokens == 0:
                continue
            total += self.loss_sum(self._to_device(batch)).double()
            count += batch.num_loss_tokens
        if count == 0:
            return {}
        loss = float(total) / count
        return {"loss": loss, "ppl": float(torch.tensor(loss).exp())}

    def after_optimizer_step(self, step: int) -> None:
        pass

    # ------------------------------------------------------------------ state and export

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_meta(self) -> dict[str, Any]:
        return {"loader": self.train_loader.state_dict()}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.train_loader.load_state_dict(meta["loader"])

    def export(self, out_dir: Path) -> dict[str, Path]:
        out_dir = Path(out_dir)
        if self.lora_args is not None:
            path = out_dir / "adapter"
            save_peft_adapter(self.model, self.lora_args, path, base_model_path=str(Path(self.cfg.model.path).resolve()))
            copy_tokenizer(Path(self.cfg.model.path), path)
            return {"adapter": path}
        path = out_dir / "model"
        save_pretrained(self.model, path, dtype=torch.bfloat16 if self.autocast else torch.float32)
        copy_tokenizer(Path(self.cfg.model.path), path)
        return {"model": path}


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _with_attention(args: Any, impl: str) -> Any:
    import dataclasses

    return dataclasses.replace(args, attention_impl=impl) if hasattr(args, "attention_impl") else args


__all__ = ["DesignerTask", "copy_tokenizer", "merge_lora"]
