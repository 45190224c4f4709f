"""The designer's task on the shared engine: packed brief→caption rows, loss on caption tokens only.

Precision (docs/training.md): with `model.dtype = "bfloat16"`, full fine-tuning keeps fp32 master weights and
runs the forward under bf16 autocast; LoRA keeps a frozen bf16 base and adapter weights in `lora.dtype`.
`"float32"` is exact throughout (CPU tests, parity checks). The loss is reduced in fp32.

The LM head and the cross-entropy run only on the tokens that carry a label (the caption tokens), in
chunks (`kernels.cross_entropy.linear_cross_entropy`), so the [tokens, vocab] logits never exist at
once. The indices of those tokens are computed on the host with the batch, so selecting them costs
no device sync.

Under torchrun (`dist.enabled`) each rank takes its share of every global micro-batch (rows balanced by
attention cost, data/balance.py), and the model is built on the meta device, wrapped (activation
checkpointing → compile → FSDP2, pipeline/distributed.py) and filled shard by shard straight from the
safetensors files: no rank holds the whole base model (`train.distributed.init = "full"` loads it whole
on every rank first). LoRA adapters start from the same draws as in one process, so the runs agree.

`train.precision = "fp8"` (pipeline/float8.py) computes every linear of the blocks in FP8 — full fine-tuning's
trainable linears, LoRA's frozen bases (quantised once; the adapters stay in lora.dtype) — and keeps the LM head
(it runs inside the chunked cross-entropy), the embeddings and the norms as they are. One process only.

`lora.base_dtype = "nf4"` (QLoRA, pipeline/lora_nf4.py) stores the LoRA bases in NF4, quantised on the device at
load: one process reads the model onto the host and moves one base weight at a time to the device to quantise it;
under torchrun each rank quantises each whole weight the same way and keeps its rows (FSDP2 shards the 4-bit
tensors). The LM head, embeddings and norms stay in model.dtype, and the adapters train as in a bf16-base run.
A Qwen3-MoE's expert stacks are quantised the same way, one stack at a time (per expert: kernels/nf4_moe.py), and
FSDP2 shards their bytes by whole experts; expert parallelism keeps each rank's experts' bytes (pipeline/nf4.py).
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from atelier_studio.data.balance import BalancedPackedLoader
from atelier_studio.data.chat import DataError, EncodedDoc, Example, encode_examples
from atelier_studio.data.chat_formats import load_data
from atelier_studio.data.packing import Batch, compile_shape, pack_documents
from atelier_studio.data.tokenizer import load_tokenizer
from atelier_studio.designer.config import DesignerConfig
from atelier_studio.designer.family import DesignerArgs
from atelier_studio.designer.hf import Model, StoredWeights, build_model, load_pretrained, read_args, save_pretrained
from atelier_studio.designer.lora import (
    ADAPTER_FILE,
    GroupedLoRA,
    LoraArgs,
    apply_lora,
    grouped_lora_names,
    grouped_weight,
    load_peft_adapter,
    lora_init_like,
    lora_targets,
    lora_tensors_of_adapter,
    merge_lora,
    save_peft_adapter,
)
from atelier_studio.designer.registry import family_of_args
from atelier_studio.designer.samples import CaptionSampler, sample_briefs
from atelier_studio.kernels.cross_entropy import linear_cross_entropy
from atelier_studio.kernels.nf4 import NF4Weight, quantize_nf4
from atelier_studio.kernels.nf4_moe import NF4Experts, quantize_experts
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.distributed import DistContext, all_reduce_sum, materialize_, parallelize
from atelier_studio.pipeline.float8 import apply_precision, check_precision
from atelier_studio.pipeline.hf_files import check_vocab_size
from atelier_studio.pipeline.hub import resolve_model_path
from atelier_studio.pipeline.lora_fp8 import FP8_CONVERSIONS
from atelier_studio.pipeline.lora_nf4 import quantize_lora_bases
from atelier_studio.pipeline.nf4 import NF4_TENSORS, NF4ExpertStack, NF4Linear
from atelier_studio.pipeline.progress import log
from atelier_studio.pipeline.task import SampleTable, Skipped, Task

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


@dataclass
class DeviceBatch:
    """A packed micro-batch on the device, plus the host-side counts the trainer reads without syncing."""

    batch: Batch
    loss_index: torch.Tensor  # [num_loss_tokens] positions (in the flattened B*T tokens) that carry a label
    real_tokens: torch.Tensor  # [B, T] bool: not padding (a family's auxiliary loss counts these only)


class DesignerTask(Task):
    unit = "tokens"
    # the token embedding and the LM head (Hugging Face names, every designer family): AdamW's under Muon
    outer_layers = ("model.embed_tokens.", "lm_head.")

    def __init__(self, cfg: DesignerConfig, device: torch.device, dist: DistContext | None = None):
        self.cfg = cfg
        self.device = device
        self.dist = dist if dist is not None else DistContext(device=device)
        rank, world_size = self.dist.rank, self.dist.world_size
        model_dir = Path(resolve_model_path(cfg.model.path, "model.path"))  # a hub id not in the cache: one line
        if not model_dir.is_dir():
            raise ConfigError(f"model.path: {model_dir} is not a directory (a Hugging Face model directory with "
                              f"config.json, safetensors and tokenizer files; see `atelier designer init`)")
        args = read_args(model_dir)  # config.json first: the tokenizer reads it too, and would report it less clearly
        self.family = family_of_args(args)
        self.tokenizer = load_tokenizer(model_dir)
        check_vocab_size(self.tokenizer, model_dir, args.vocab_size, model_dir)  # a tokenizer without its vocabulary
        eval_examples = self._build_data(rank, world_size)
        briefs = sample_briefs(eval_examples, cfg.sample.briefs)
        self.sampler = CaptionSampler(self.tokenizer, briefs, cfg.sample.max_new_tokens, args.max_seq_len) \
            if briefs else None

        exact = cfg.model.dtype == "float32"
        full = cfg.lora.rank == 0
        self.nf4 = cfg.lora.base_dtype == "nf4"
        # full FT: fp32 master weights; LoRA: the frozen base in the compute dtype
        base_dtype = torch.float32 if (exact or full) else torch.bfloat16
        self.lora_args: LoraArgs | None = None
        if not full:
            try:
                targets = self.family.resolve_lora_targets(cfg.lora.targets)
            except ValueError as e:
                raise ConfigError(f"lora.targets: {e} (model.path {model_dir} is a {self.family.name} model)") from None
            self.lora_args = LoraArgs(**asdict(cfg.lora.args(targets)))  # the designer's LoraArgs (designer/lora.py)
        if self.lora_args is not None and self.lora_args.dropout > 0:
            _check_grouped_dropout(args, self.lora_args, cfg.lora.dropout)
        if cfg.model.router_aux_loss == "on" and self.family.forward_with_aux is None:
            raise ConfigError(f"model.router_aux_loss = 'on': {self.family.name} models have no auxiliary loss "
                              f"(model.path {model_dir}); leave it 'auto' or 'off'")
        _preflight(cfg, args, device)
        check_precision(cfg.train, device, self.dist.enabled, frozen_bases=not full)
        sharded_init = self.dist.enabled and cfg.train.distributed.init == "sharded"
        self.model = self._build_sharded(model_dir, base_dtype) if sharded_init else self._build(model_dir, base_dtype)
        self.autocast = (not exact)
        n_train = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        n_all = sum(p.numel() for n, p in self.model.named_parameters() if not NF4Linear.owns_parameter(n))
        n_all += sum(m.in_features * m.out_features if isinstance(m, NF4Linear) else m.numel
                     for m in self.model.modules() if isinstance(m, (NF4Linear, NF4ExpertStack)))
        log(f"designer: {n_all / 1e6:.3f}M parameters, {n_train / 1e6:.3f}M trainable "
            f"({'full fine-tuning' if full else f'LoRA r{cfg.lora.rank}'}), {cfg.model.dtype} on {device}")

    # ------------------------------------------------------------------ model

    def _fsdp_param_dtype(self) -> torch.dtype | None:
        """FSDP2's compute dtype: fp32 when exact, bf16 for full FT (fp32 master), own dtypes for LoRA."""
        choice = self.cfg.train.distributed.param_dtype
        if choice != "auto":
            return getattr(torch, choice)
        if self.nf4:  # every parameter in its own dtype: the NF4 tensors are bytes (pipeline/nf4.py)
            return None
        if self.cfg.model.dtype == "float32":
            return torch.float32
        return None if self.lora_args is not None else torch.bfloat16

    def _wrap(self, model: Model) -> Model:
        # FP8 linears first: the policies below wrap what runs
        apply_precision(model, self.cfg.train, conversions=FP8_CONVERSIONS)
        return parallelize(model, self.family.blocks(model), self.dist, self.cfg.train.distributed,
                           self._fsdp_param_dtype())

    def _build(self, model_dir: Path, base_dtype: torch.dtype) -> Model:
        """One process (or init = "full"): load the whole model, add LoRA, then wrap (FSDP shards it).

        QLoRA loads the model on the host and quantises the LoRA bases on the device one at a time, so the device
        never holds the bf16 base; the adapters are drawn on the device as apply_lora draws them in a bf16 run."""
        model = load_pretrained(model_dir, dtype=base_dtype, device="cpu" if self.nf4 else self.device,
                                attention_impl=self.cfg.model.attention, delta_rule_impl=self.cfg.model.delta_rule,
                                kernels=self.cfg.model.kernels)
        if self.lora_args is not None:
            if self.cfg.lora.init_adapter:
                load_peft_adapter(model, resolve_model_path(self.cfg.lora.init_adapter, "lora.init_adapter"))
            elif self.nf4:
                init = _lora_init_like_apply_lora(model, self.lora_args, self.device)
                with torch.random.fork_rng(devices=[]):  # these host draws are replaced by `init`: no trace of them
                    apply_lora(model, self.lora_args)
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if name in init:
                            p.copy_(init[name])
            else:
                apply_lora(model, self.lora_args)
        if self.nf4:
            self._quantize_bases(model)
            model.to(self.device)
        self._wrap(model)
        self._log_shards(model)
        return model

    def _quantize_bases(self, model: Model) -> None:
        """lora.base_dtype = "nf4": every LoRA base that fits NF4 quantised on the device (pipeline/lora_nf4.py)."""
        done, kept = quantize_lora_bases(model, self.device)
        if not done:
            raise ConfigError(f'lora.base_dtype = "nf4": no LoRA target of this {self.family.name} model can be stored '
                              f'in NF4 (in_features must be a multiple of 64; lora.targets wraps {", ".join(kept)}); '
                              f'target other linears, or set lora.base_dtype = "bf16"')
        log(f"qlora: {len(done)} frozen bases (LoRA linears, expert stacks) stored in NF4"
            + (f"; kept in the model dtype (in_features not a multiple of 64): {', '.join(kept)}" if kept else ""))

    def _build_sharded(self, model_dir: Path, base_dtype: torch.dtype) -> Model:
        """Meta model → LoRA → wrap → each rank reads only its rows of every tensor from the safetensors files."""
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: not found")
        args = read_args(model_dir, self.cfg.model.attention, self.cfg.model.delta_rule, self.cfg.model.kernels)
        stored = StoredWeights(model_dir, args)  # checks every key and shape before anything is built
        with torch.device("meta"):
            model = build_model(args).to(base_dtype)
        lora_init: dict[str, torch.Tensor] = {}
        if self.lora_args is not None:
            if self.cfg.lora.init_adapter:  # checks the adapter's keys and shapes; the values are read below
                adapter = Path(resolve_model_path(self.cfg.lora.init_adapter, "lora.init_adapter"))
                load_peft_adapter(model, adapter)
                lora_init = lora_tensors_of_adapter(model, adapter / ADAPTER_FILE)
            else:
                lora_init = _lora_init_like_apply_lora(model, self.lora_args, self.device)
                apply_lora(model, self.lora_args)
            if self.nf4:
                self._quantize_bases(model)  # meta NF4 tensors: read() below fills them
        self._wrap(model)
        with stored:
            nf4 = _NF4Reader(lambda key: stored.read(key).to(self.device, base_dtype))

            def read(name: str, rows: slice) -> torch.Tensor:
                if name in lora_init:
                    return lora_init[name][rows]
                if nf4.owns(name):
                    return nf4.read(name, rows)
                return stored.read(name.replace(".base_layer.", "."), rows)  # a LoRA-wrapped base has the HF name

            materialize_(model, self.device, read)
        self._log_shards(model)
        return model

    def _log_shards(self, model: Model) -> None:
        """Under torchrun: which experts this rank holds under expert parallelism, and how much of the NF4 bases
        (1 / world size of them, by rows or by experts)."""
        if not self.dist.enabled:
            return
        exchanges = [m.exchange for m in model.modules() if getattr(m, "exchange", None) is not None]
        if exchanges:
            held, total = exchanges[0].experts, exchanges[0].local * exchanges[0].size
            log(f"expert parallelism: rank {self.dist.rank} of {self.dist.world_size} holds experts "
                f"{held.start}..{held.stop - 1} of {total} in each of {len(exchanges)} MoE layers")
        if not self.nf4:
            return
        from torch.distributed.tensor import DTensor

        held = total = 0
        for name, p in model.named_parameters():
            if NF4Linear.owns_parameter(name):
                local = p.to_local() if isinstance(p, DTensor) else p
                held, total = held + local.numel() * local.element_size(), total + p.numel() * p.element_size()
        log(f"qlora: rank {self.dist.rank} of {self.dist.world_size} holds {held:,} of the {total:,} bytes of NF4 "
            f"bases")

    # ------------------------------------------------------------------ data

    def _build_data(self, rank: int, world_size: int) -> list[Example]:
        """The train and eval loaders (`train_loader`, `eval_loader`); returns the eval examples (the sampled briefs
        come from them)."""
        cfg = self.cfg
        self.train_loader = self._loader(cfg.data.train, self._examples(cfg.data.train), rank, world_size,
                                         drop_last=True)
        self._dropped = self.train_loader.packed.stats.num_dropped  # data.overflow = "drop": left out of each epoch
        eval_examples = self._examples(cfg.data.eval) if cfg.data.eval else []
        self.eval_loader = self._loader(cfg.data.eval, eval_examples, rank, world_size, drop_last=False) \
            if cfg.data.eval else None
        return eval_examples

    def _examples(self, path: str) -> list[Example]:
        """data.train or data.eval read in its format (data/chat_formats.py), each file's format logged."""
        examples, formats = load_data(path, self.cfg.data.format, self.cfg.data.columns.mapping())
        for f in formats:
            log(f"data {f.path}: {f.examples} examples read as {f.format}"
                f"{' (detected from its columns; set data.format to choose)' if f.detected else ''}")
        return examples

    def _loader(self, path: str, examples: list[Example], rank: int, world_size: int,
                drop_last: bool) -> BalancedPackedLoader:
        docs = encode_examples(self.tokenizer, examples)
        if self.cfg.data.overflow != "drop":  # "drop" leaves such documents out on purpose
            check_prompts_fit(examples, docs, self.cfg.data.seq_len)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        packed = pack_documents(docs, self.cfg.data.seq_len, self.cfg.data.overflow, pad_id=pad_id)
        s = packed.stats
        log(f"data {path}: {s.num_docs} documents → {s.num_rows} rows of {self.cfg.data.seq_len} tokens, "
            f"{s.padding_fraction:.1%} padding, split {s.num_split}, truncated {s.num_truncated}, "
            f"dropped {s.num_dropped}")
        if s.num_rows == 0:
            raise DataError(f"{path}: all {s.num_docs} documents are longer than data.seq_len = "
                            f"{self.cfg.data.seq_len} tokens and data.overflow = \"drop\" left every one out: raise "
                            f"data.seq_len, or set data.overflow = \"truncate\" or \"split\"")
        return BalancedPackedLoader(packed, self.cfg.train.micro_batch, self.cfg.train.seed, rank, world_size,
                                    drop_last=drop_last, balance=self.cfg.train.distributed.balance)

    def skipped(self) -> Skipped | None:
        """The documents longer than data.seq_len that data.overflow = "drop" leaves out, once for every epoch begun
        (the whole data set is packed on every rank, so the count is every rank's); None with another overflow policy:
        a JSONL line that cannot be used is an error, never skipped."""
        if self.cfg.data.overflow != "drop":
            return None
        epochs = self.train_loader.epoch + 1
        reason = "longer than data.seq_len (data.overflow = drop)"
        return Skipped({self.cfg.data.train: {reason: self._dropped * epochs}} if self._dropped else {})

    def _to_device(self, batch: Batch) -> DeviceBatch:
        if self.cfg.train.distributed.compile:
            batch = compile_shape(batch)  # a bounded set of shapes for the compiled blocks
        loss_index = batch.labels.reshape(-1).ne(-100).nonzero().squeeze(1)  # on the host: no device sync
        return DeviceBatch(batch.to(self.device), loss_index.to(self.device, non_blocking=True),
                           batch.real_tokens().to(self.device, non_blocking=True))

    def train_batches(self) -> Iterator[DeviceBatch]:
        return (self._to_device(b) for b in self.train_loader)

    # ------------------------------------------------------------------ the step

    def batch_weight(self, b: DeviceBatch) -> int:
        return b.batch.num_loss_tokens

    def batch_units(self, b: DeviceBatch) -> int:
        return b.batch.num_tokens

    def batch_flops(self, b: DeviceBatch) -> int:
        return self.family.train_flops(self.model, b.batch.doc_lens, b.batch.num_loss_tokens)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def loss_sum(self, b: DeviceBatch) -> torch.Tensor:
        """Σ cross-entropy over the caption tokens, plus a family's auxiliary loss term (Qwen3-MoE's load balancing)
        times the micro-batch's loss tokens: divided by the accumulated batch's loss tokens (the trainer), the step
        loss is the mean cross-entropy plus the auxiliary term weighted by each micro-batch's share of the loss
        tokens (with one micro-batch: exactly transformers' loss + router_aux_loss_coef · aux)."""
        batch = b.batch
        with self._autocast():
            inputs = (batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
            aux = None
            if self.family.forward_with_aux is None:
                hidden = self.model(*inputs)  # [B,T,D]
            else:
                hidden, aux = self.family.forward_with_aux(self.model, *inputs, b.real_tokens,
                                                           self.cfg.model.router_aux_loss)
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, b.loss_index)  # [N,D]
            labels = batch.labels.reshape(-1).index_select(0, b.loss_index)  # [N]
            weight = self.model.lm_head_weight
            total = linear_cross_entropy(hidden, weight, labels)
        return total if aux is None else total + aux.float() * batch.num_loss_tokens

    def evaluate(self) -> dict[str, float]:
        if self.eval_loader is None:
            return {}
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = 0
        for i, batch in enumerate(self.eval_loader.iter_eval_batches()):
            if self.cfg.data.max_eval_batches and i >= self.cfg.data.max_eval_batches:
                break
            # no skipping of loss-free (padding) batches: under FSDP every rank must run the same forwards
            total += self.loss_sum(self._to_device(batch)).double()
            count += batch.num_loss_tokens
        if self.dist.enabled:  # each rank saw its own rows: sum over ranks
            total_all, count = all_reduce_sum(self.dist, [float(total), count])
            total = torch.tensor(total_all, dtype=torch.float64)
        if count == 0:
            return {}
        loss = float(total) / count
        return {"loss": loss, "ppl": float(torch.tensor(loss).exp())}

    def sample_table(self, step: int) -> SampleTable | None:
        """Greedy captions of the held-out briefs (designer/samples.py). Under torchrun every rank decodes the same
        briefs in lockstep (the trainer logs rank 0's table): each block's FSDP unit gathers its weights in its own
        forward, the root unit's (embedding, final norm, head) are gathered here, since decoding goes through
        `hidden_states` and `logits`, not the root's forward."""
        if self.sampler is None:
            return None
        with self._autocast(), self._root_unsharded():
            return self.sampler.table(self.model, step, lockstep=self.dist.enabled)

    @contextlib.contextmanager
    def _root_unsharded(self) -> Iterator[None]:
        unshard = getattr(self.model, "unshard", None)  # an FSDPModule under torchrun
        if not self.dist.enabled or unshard is None:
            yield
            return
        unshard()
        try:
            yield
        finally:
            self.model.reshard()

    def after_optimizer_step(self, step: int) -> None:
        pass

    # ------------------------------------------------------------------ state and export

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_meta(self) -> dict[str, Any]:
        return {"loader": self.train_loader.state_dict()}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.train_loader.load_state_dict(meta["loader"])

    @property
    def export_reads_frozen(self) -> bool:
        """A LoRA run exports its adapter alone (pipeline/task.py): the frozen base is not gathered for it."""
        return self.lora_args is None

    def export(self, out_dir: Path) -> dict[str, Path]:
        out_dir = Path(out_dir)
        if self.lora_args is not None:
            path = out_dir / "adapter"
            save_peft_adapter(self.model, self.lora_args, path,
                              base_model_path=str(Path(self.cfg.model.path).resolve()))
            copy_tokenizer(Path(self.cfg.model.path), path)
            return {"adapter": path}
        path = out_dir / "model"
        save_pretrained(self.model, path, dtype=torch.bfloat16 if self.autocast else torch.float32)
        copy_tokenizer(Path(self.cfg.model.path), path)
        return {"model": path}


def check_prompts_fit(examples: list[Example], docs: list[EncodedDoc], seq_len: int) -> None:
    """Every document's prompt (system, brief, assistant header) and its first caption token fit in one row.

    A longer prompt would be split or cut so that its first row holds no caption token: a row with nothing to
    learn, which trains at loss 0. The error names data.seq_len, the first such line and the length it needs.
    """
    for example, doc in zip(examples, docs):
        first = next((i for i, target in enumerate(doc.loss_mask) if target), len(doc))
        if first >= seq_len:
            raise DataError(f"data.seq_len = {seq_len} is too short for {example.source}: its prompt alone is {first} "
                            f"tokens, so no caption token fits in a row; set data.seq_len >= {first + 1} (or "
                            f">= {len(doc)} to hold the whole document in one row)")


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _preflight(cfg: DesignerConfig, args: DesignerArgs, device: torch.device) -> None:
    """The family's own checks before anything is loaded (designer/family.py `preflight`; Qwen3.5: fla-core for a
    bf16 run on CUDA), each naming the config key to change."""
    family = family_of_args(args)
    if family.preflight is not None:
        family.preflight(args, cfg.model, device)


def _check_grouped_dropout(args: DesignerArgs, lora: LoraArgs, dropout: float) -> None:
    """LoRA dropout on grouped weights (Qwen3-MoE's experts) is refused before anything is loaded, naming the key."""
    with torch.device("meta"):
        probe = build_model(args)
    leaves = sorted({leaf for _, parent, leaf in lora_targets(probe, lora) if grouped_weight(parent, leaf) is not None})
    if leaves:
        targets = [t for t, path in family_of_args(args).lora_targets.items() if path.rsplit(".", 1)[1] in leaves]
        raise ConfigError(f"lora.dropout = {dropout}: the {', '.join(targets)} adapters are one per expert, where "
                          f"dropout is not supported (PEFT refuses it there too); set lora.dropout = 0, or "
                          f"lora.targets without {', '.join(targets)}")


class _NF4Reader:
    """materialize_'s reader for the NF4 tensors of a meta model's LoRA bases and expert stacks (pipeline/nf4.py's
    names; an expert stack's rows are its experts).

    A weight's NF4 form depends on the whole weight (its mean and group factors), so a rank reads the whole HF
    weight, quantises it on the device exactly as one process does, and keeps its rows of the row-sharded data and
    scalers. materialize_ asks for every parameter before any buffer: the last weight's full NF4 form is kept for
    its second parameter, and each weight's small whole-rank tensors (factor, mean, code) for the buffers."""

    def __init__(self, load: Callable[[str], torch.Tensor]) -> None:
        self.load = load
        self.current: tuple[str, NF4Weight | NF4Experts] | None = None
        self.small: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def owns(name: str) -> bool:
        return name.rpartition(".")[2] in NF4_TENSORS and (".base_layer." in name or ".mlp.experts." in name)

    def read(self, name: str, rows: slice) -> torch.Tensor:
        stem, _, part = name.rpartition(".")  # stem: <linear>.base_layer, or an expert stack's state-dict name
        if part in ("quantized_data", "quantized_scalers"):
            if self.current is None or self.current[0] != stem:
                if stem.endswith(".base_layer"):
                    w = quantize_nf4(self.load(stem.removesuffix(".base_layer") + ".weight"))
                else:  # a stack [E, O, I], read whole and quantised per expert (kernels/nf4_moe.py)
                    w = quantize_experts(self.load(stem))
                self.current = (stem, w)
                self.small[stem] = {"quantization_factor": w.factor, "scaler_mean": w.mean, "nf4": w.code}
            w = self.current[1]
            return (w.data if part == "quantized_data" else w.scalers)[rows]
        if stem not in self.small:
            raise KeyError(f"{name}: read before its layer's quantised parameters")
        return self.small[stem][part]  # whole on every rank



def _lora_init_like_apply_lora(model: Model, args: LoraArgs, device: torch.device) -> dict[str, torch.Tensor]:
    """The full LoRA weights apply_lora would draw (same order, generator and device), by parameter name: a
    grouped weight's (Qwen3-MoE's experts) from GroupedLoRA itself, a linear's from pipeline.lora.lora_init_like,
    one target at a time so the draws come in apply_lora's order. Every rank draws all of them and keeps its rows,
    so a sharded run starts from the adapter a one-process run with the same seed starts from.
    """
    out = {}
    for name, parent, leaf in lora_targets(model, args):
        grouped = grouped_weight(parent, leaf)
        if grouped is None:
            out.update(lora_init_like([(name, getattr(parent, leaf))], args, device))
            continue
        g, o, i = grouped.shape
        lora = GroupedLoRA(g, o, i, leaf, args, device)
        a_name, b_name = grouped_lora_names(name)
        out[a_name], out[b_name] = lora.lora_A.detach(), lora.lora_B.detach()
    return out


__all__ = ["DesignerTask", "check_prompts_fit", "copy_tokenizer", "merge_lora"]
