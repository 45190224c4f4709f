"""The designer's preference task (`train.objective = "dpo"`): DPO / IPO on {brief, chosen, rejected} pairs.

Everything but the data and the loss is DesignerTask's (designer/task.py): the model, LoRA / QLoRA / full
fine-tuning, precision, the export, the caption samples. The data: each pair's two conversations (prompt +
chosen, prompt + rejected) are encoded like SFT documents (data/chat.py, so they share the prompt's tokens) and
packed side by side in one row as two documents (data/packing.py pack_pairs): per-document attention and
positions, no label across, so a packed row gives each document's log-probability exactly as alone.

The reference model π_ref is the model the run starts from:
  - "adapters off" (LoRA and QLoRA from fresh adapters): the same model with every adapter's scale at 0
    (designer/lora.py adapters_disabled) and in eval mode, without gradients, beside each policy forward; no
    second model in memory. Its FLOPs (a forward, designer/decoder.py forward_flops) count in MFU.
  - "precomputed" (full fine-tuning, or LoRA from lora.init_adapter): one pass over every train and eval pair
    before the first step, kept as a [pairs, 2] table (chosen, rejected) in every checkpoint, so a resumed run
    reads the table instead of recomputing it from trained weights. Logged with its time and FLOPs; not a step.

The loss unit is the pair: loss_sum is Σ per-pair loss and batch_weight the micro-batch's pairs, so the step loss
is the mean over the accumulated batch's pairs (TRL's mean over its batch). The metrics TRL logs (rewards/*,
logps/*; designer/dpo.py PairMetrics) go with each logged step and each evaluation.

Under torchrun (FSDP2) every rank packs the same pairs and takes its own rows, as SFT does (data/balance.py); the
step's pair count, the logged metrics and the evaluation's sums are summed over ranks. Every rank runs the same
forwards, an all-padding row set included (the evaluation's and the reference pass's last batch), so no rank waits
on a collective the others skip. The precomputed reference: each rank computes the rows of its own batches, and
the table is summed over ranks (each pair on exactly one rank), so every rank holds the whole table and the
sharded checkpoint keeps it once.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from atelier_studio.data.balance import BalancedPackedLoader
from atelier_studio.data.chat import DataError, EncodedDoc, Example, PreferencePair, encode_pair
from atelier_studio.data.chat_formats import load_data
from atelier_studio.data.packing import Batch, PackedLoader, compile_shape, pack_pairs
from atelier_studio.designer.config import DesignerConfig
from atelier_studio.designer.dpo import PairMetrics, PairTerms, doc_sums, preference_loss, token_logps
from atelier_studio.designer.lora import adapters_disabled
from atelier_studio.designer.task import DesignerTask
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.distributed import DistContext, all_reduce_sum
from atelier_studio.pipeline.progress import log


@dataclass
class PairBatch:
    """A packed micro-batch of pairs on the device, with the host-side indices the loss needs (no device sync)."""

    batch: Batch
    loss_index: torch.Tensor  # [N] positions (in the flattened B*T tokens) that carry a label
    doc_of: torch.Tensor  # [N] the batch's document (0..K-1) each of those tokens belongs to
    chosen: torch.Tensor  # [P] the batch document of each pair's chosen side
    rejected: torch.Tensor  # [P] ... and of its rejected side
    chosen_len: torch.Tensor  # [P] fp32 label tokens of each side (IPO's normalisation)
    rejected_len: torch.Tensor
    pair_ids: torch.Tensor  # [P] (host) the pairs' indices in their data set: the precomputed reference's rows
    num_docs: int

    @property
    def num_pairs(self) -> int:
        return int(self.pair_ids.numel())


def _doc_index(batch: Batch) -> tuple[torch.Tensor, list[int]]:
    """[B*T] long: the batch document of every real token (-1 on padding), and each document's label tokens."""
    b, t = batch.input_ids.shape
    doc_of = torch.full((b * t,), -1, dtype=torch.long)
    rows = batch.row_tokens if batch.row_tokens is not None else [t] * b
    k = 0
    for r, filled in enumerate(rows):  # the documents come in row order, each row's filling its real tokens
        used = 0
        while used < filled:
            n = batch.doc_lens[k]
            doc_of[r * t + used:r * t + used + n] = k
            used, k = used + n, k + 1
    has_label = batch.labels.reshape(-1).ne(-100)
    counts = torch.bincount(doc_of[has_label], minlength=len(batch.doc_lens)).tolist()
    return doc_of, counts


class PreferenceTask(DesignerTask):
    """DesignerTask with preference pairs and the DPO / IPO loss (module docstring)."""

    def __init__(self, cfg: DesignerConfig, device: torch.device, dist: DistContext | None = None):
        self.dpo = cfg.train.dpo
        super().__init__(cfg, device, dist)
        self.reference = "precomputed" if (self.lora_args is None or cfg.lora.init_adapter) else "adapters off"
        self.ref_tables: dict[str, torch.Tensor] = {}  # "train" / "eval" -> [pairs, 2] fp32, when precomputed
        self.metrics = PairMetrics()
        self._last_step: tuple[torch.Tensor | None, int] = (None, 0)
        log(f"dpo: loss_type {self.dpo.loss_type}, beta {self.dpo.beta}"
            f"{f', sft_weight {self.dpo.sft_weight}' if self.dpo.sft_weight else ''}, reference: the starting model, "
            f"{self.reference}")

    # ------------------------------------------------------------------ data

    def _build_data(self, rank: int, world_size: int) -> list[Example]:
        cfg = self.cfg
        self.train_loader = self._pair_loader(cfg.data.train, rank, world_size, drop_last=True)
        self._dropped = self._dropped_pairs
        self.eval_loader = self._pair_loader(cfg.data.eval, rank, world_size, drop_last=False) \
            if cfg.data.eval else None
        return [p.examples()[0] for p in self._eval_pairs] if cfg.data.eval else []

    def _pair_loader(self, path: str, rank: int, world_size: int, drop_last: bool) -> BalancedPackedLoader:
        cfg = self.cfg
        pairs, formats = load_data(path, cfg.data.format, cfg.data.columns.mapping(), pairs=True)
        for f in formats:
            log(f"data {f.path}: {f.examples} preference pairs read as {f.format}"
                f"{' (detected from its columns; set data.format to choose)' if f.detected else ''}")
        encoded, kept, dropped = encode_pairs(self.tokenizer, pairs, cfg.data.seq_len, cfg.data.overflow, path)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        packed = pack_pairs(encoded, cfg.data.seq_len, pad_id=pad_id)
        s = packed.stats
        log(f"data {path}: {len(encoded)} pairs → {s.num_rows} rows of {cfg.data.seq_len} tokens, "
            f"{s.padding_fraction:.1%} padding, dropped {dropped} pairs longer than a row")
        if drop_last:  # the train set
            self._dropped_pairs, self._train_pairs = dropped, kept
        else:
            self._eval_pairs = kept
        return BalancedPackedLoader(packed, cfg.train.micro_batch, cfg.train.seed, rank, world_size,
                                    drop_last=drop_last, balance=cfg.train.distributed.balance)

    def _to_device(self, batch: Batch) -> PairBatch:
        if batch.doc_ids is None:
            raise ValueError("PreferenceTask: a batch without doc_ids (not packed by pack_pairs)")
        doc_of, counts = _doc_index(batch)
        if self.cfg.train.distributed.compile:
            batch = compile_shape(batch)
        loss_index = batch.labels.reshape(-1).ne(-100).nonzero().squeeze(1)  # on the host: no device sync
        side = {d: k for k, d in enumerate(batch.doc_ids)}  # packed document id -> batch document
        pair_ids = sorted({d // 2 for d in batch.doc_ids})
        chosen, rejected = [side[2 * i] for i in pair_ids], [side[2 * i + 1] for i in pair_ids]
        move = lambda x: x.to(self.device, non_blocking=True)  # noqa: E731
        return PairBatch(batch.to(self.device), move(loss_index), move(doc_of[loss_index]),
                         move(torch.tensor(chosen, dtype=torch.long)), move(torch.tensor(rejected, dtype=torch.long)),
                         move(torch.tensor([counts[k] for k in chosen], dtype=torch.float32)),
                         move(torch.tensor([counts[k] for k in rejected], dtype=torch.float32)),
                         torch.tensor(pair_ids, dtype=torch.long), len(batch.doc_ids))

    def train_batches(self) -> Iterator[PairBatch]:
        if self.reference == "precomputed" and "train" not in self.ref_tables:  # not restored from a checkpoint
            self._precompute()
        return (self._to_device(b) for b in self.train_loader)

    # ------------------------------------------------------------------ the reference

    def _precompute(self) -> None:
        """The starting model's log-probabilities of every train and eval pair, once (module docstring)."""
        start, flops = time.perf_counter(), 0
        loaders = {"train": self.train_loader, "eval": self.eval_loader}
        for name, loader in loaders.items():
            if loader is None:
                continue
            table = torch.full((_pair_count(loader), 2), float("nan"))  # [pairs, (chosen, rejected)]
            for batch in loader.iter_eval_batches():  # an empty batch too: every rank runs the same forwards
                pb = self._to_device(batch)
                with self._reference_mode():
                    docs = self._doc_logps(pb).cpu()
                table[pb.pair_ids, 0] = docs[pb.chosen.cpu()]
                table[pb.pair_ids, 1] = docs[pb.rejected.cpu()]
                flops += self.model.forward_flops(batch.doc_lens, batch.num_loss_tokens)
            table = self._whole_table(table)
            if torch.isnan(table).any():
                raise RuntimeError(f"dpo: the reference pass missed {int(torch.isnan(table).any(1).sum())} {name} "
                                   f"pairs")
            self.ref_tables[name] = table
        log(f"dpo: reference log-probabilities of {sum(len(t) for t in self.ref_tables.values())} pairs computed "
            f"once in {time.perf_counter() - start:.1f} s ({flops / 1e12:.3g} TFLOP); checkpoints keep them")

    def _whole_table(self, table: torch.Tensor) -> torch.Tensor:
        """Under torchrun: each rank filled the rows of its own pairs (NaN elsewhere); the sum over ranks of the
        filled values (fp64: adding zeros is exact, so every rank gets the same table), NaN where no rank filled a
        row."""
        if not self.dist.enabled:
            return table
        filled = ~torch.isnan(table)
        n = table.numel()
        summed = torch.tensor(all_reduce_sum(self.dist, [*torch.where(filled, table, 0.0).flatten().tolist(),
                                                         *filled.flatten().float().tolist()]))
        values, counts = summed[:n].view_as(table).float(), summed[n:].view_as(table)
        return torch.where(counts > 0, values, float("nan"))

    @contextlib.contextmanager
    def _reference_mode(self) -> Iterator[None]:
        """π_ref: no gradients, eval mode (no dropout draws); with reference "adapters off" the adapters' scales at 0,
        while "precomputed" runs the starting model as it is (a LoRA run's loaded lora.init_adapter included)."""
        was_training = self.model.training
        self.model.eval()
        off = adapters_disabled(self.model) if self.reference == "adapters off" else contextlib.nullcontext()
        try:
            with torch.no_grad(), off:
                yield
        finally:
            self.model.train(was_training)

    def _doc_logps(self, b: PairBatch) -> torch.Tensor:
        """[K] fp32: each document's summed log-probability of its label tokens under the model as it is."""
        batch = b.batch
        with self._autocast():
            hidden = self.model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)  # [B,T,D]
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, b.loss_index)  # [N,D]
            labels = batch.labels.reshape(-1).index_select(0, b.loss_index)  # [N]
            logps = token_logps(hidden, self.model.lm_head_weight, labels)  # [N] fp32
        return doc_sums(logps, b.doc_of, b.num_docs)

    def _reference_logps(self, b: PairBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reference == "precomputed":
            rows = self.ref_tables[split][b.pair_ids].to(self.device)  # [P, 2]
            return rows[:, 0], rows[:, 1]
        with self._reference_mode():
            docs = self._doc_logps(b)
        return docs[b.chosen], docs[b.rejected]

    # ------------------------------------------------------------------ the step

    def _terms(self, b: PairBatch, split: str) -> PairTerms:
        ref_c, ref_r = self._reference_logps(b, split)
        docs = self._doc_logps(b)
        return preference_loss(docs[b.chosen], docs[b.rejected], ref_c, ref_r, b.chosen_len, b.rejected_len,
                               self.dpo.beta, self.dpo.loss_type, self.dpo.sft_weight)

    def batch_weight(self, b: PairBatch) -> int:
        return b.num_pairs

    def batch_units(self, b: PairBatch) -> int:
        return b.batch.num_tokens

    def batch_flops(self, b: PairBatch) -> int:
        """The policy's forward and backward, plus the reference forward when it runs beside it (adapters off)."""
        flops = self.family.train_flops(self.model, b.batch.doc_lens, b.batch.num_loss_tokens)
        if self.reference == "adapters off":
            flops += self.model.forward_flops(b.batch.doc_lens, b.batch.num_loss_tokens)
        return flops

    def loss_sum(self, b: PairBatch) -> torch.Tensor:
        """Σ per-pair loss of the micro-batch (the trainer divides by the accumulated batch's pairs)."""
        terms = self._terms(b, "train")
        self.metrics.add(terms)
        return terms.losses.sum()

    def after_optimizer_step(self, step: int) -> None:
        self._last_step = self.metrics.take()

    def step_metrics(self) -> dict[str, float]:
        """The last step's pair metrics, over every rank's pairs (every rank logs each step: log_step)."""
        sums, pairs = self._last_step
        values = sums.tolist() if sums is not None else [0.0] * len(PairMetrics.NAMES)
        *values, pairs = all_reduce_sum(self.dist, [*values, pairs])
        return PairMetrics.means(values, int(pairs))

    def evaluate(self) -> dict[str, float]:
        if self.eval_loader is None:
            return {}
        if self.reference == "precomputed" and "eval" not in self.ref_tables:  # before any step: the starting model
            self._precompute()
        metrics, total = PairMetrics(), torch.zeros((), device=self.device, dtype=torch.float64)
        for i, batch in enumerate(self.eval_loader.iter_eval_batches()):
            if self.cfg.data.max_eval_batches and i >= self.cfg.data.max_eval_batches:
                break
            # no skipping of an all-padding batch (the last one's filling): under FSDP every rank runs each forward
            terms = self._terms(self._to_device(batch), "eval")
            metrics.add(terms)
            total += terms.losses.double().sum()
        sums, pairs = metrics.take()
        values = sums.tolist() if sums is not None else [0.0] * len(PairMetrics.NAMES)
        *values, pairs, total_all = all_reduce_sum(self.dist, [*values, pairs, float(total)])  # over ranks
        if not pairs:
            return {}
        return {"loss": total_all / pairs, **PairMetrics.means(values, int(pairs))}

    # ------------------------------------------------------------------ state

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The precomputed reference tables. Not computed yet (a resumed run, before it loads): NaN tables of this
        run's pair counts, the shapes a sharded checkpoint loads into (DCP fills what the template names)."""
        if self.reference != "precomputed":
            return {}
        loaders = {"train": self.train_loader, "eval": self.eval_loader}
        return {f"dpo.reference.{name}": self.ref_tables.get(name, torch.full((_pair_count(loader), 2), float("nan")))
                for name, loader in loaders.items() if loader is not None}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """The loader's position, and the precomputed reference tables: the model loaded now is a trained one, so a
        table the checkpoint lacks or that does not fit this run's pairs cannot be made again; that is refused."""
        super().load_state(tensors, meta)
        if self.reference != "precomputed":
            return
        self.ref_tables = {k.removeprefix("dpo.reference."): v.float().cpu() for k, v in tensors.items()
                           if k.startswith("dpo.reference.")}
        for name, loader in (("train", self.train_loader), ("eval", self.eval_loader)):
            if loader is None:
                continue
            key = "data.train" if name == "train" else "data.eval"
            table = self.ref_tables.get(name)
            if table is not None and torch.isnan(table).any():  # a template no checkpoint filled
                self.ref_tables.pop(name)
                table = None
            if table is None or len(table) != _pair_count(loader):
                raise ConfigError(f"{key}: the checkpoint holds no reference log-probabilities for these "
                                  f"{_pair_count(loader)} pairs (it has {'none' if table is None else len(table)}), "
                                  f"and a resumed run cannot compute them from the starting model; resume with the "
                                  f"checkpoint's {key}, or start a new run in another output.dir")


def encode_pairs(tokenizer: Any, pairs: list[PreferencePair], seq_len: int, overflow: str, path: str
                 ) -> tuple[list[tuple[EncodedDoc, EncodedDoc]], list[PreferencePair], int]:
    """Every pair's (chosen, rejected) documents, checked to fit one row side by side: a longer pair is an error
    naming its line and the data.seq_len it needs, or (data.overflow = "drop") left out. Returns the documents, the
    pairs kept and how many were dropped."""
    encoded, kept, dropped = [], [], 0
    for pair in pairs:
        docs = encode_pair(tokenizer, pair)
        need = len(docs[0]) + len(docs[1])
        if need > seq_len:
            if overflow != "drop":
                raise DataError(f"data.seq_len = {seq_len} is too short for {pair.source}: its chosen and rejected "
                                f"documents, packed side by side in one row, are {need} tokens; set data.seq_len >= "
                                f"{need}, or data.overflow = \"drop\" to leave such pairs out")
            dropped += 1
            continue
        encoded.append(docs)
        kept.append(pair)
    if not encoded:
        raise DataError(f"{path}: every preference pair is longer than data.seq_len = {seq_len} tokens and "
                        f"data.overflow = \"drop\" left each one out: raise data.seq_len")
    return encoded, kept, dropped


def _pair_count(loader: PackedLoader) -> int:
    """Pairs in a loader's packed rows (documents 2i, 2i + 1 for pair i)."""
    return max((d for ids in loader.packed.doc_ids or [] for d in ids), default=-1) // 2 + 1


def designer_task(cfg: DesignerConfig, device: torch.device, dist: DistContext | None = None) -> DesignerTask:
    """The designer's task for `train.objective`: DesignerTask (sft) or PreferenceTask (dpo)."""
    cls = PreferenceTask if cfg.train.objective == "dpo" else DesignerTask
    return cls(cfg, device, dist)


__all__ = ["PreferenceTask", "PairBatch", "designer_task", "encode_pairs"]
