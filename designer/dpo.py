"""Direct preference optimisation for the designer: per-document log-probabilities and the DPO / IPO losses.

Shape legend: N label tokens of a micro-batch, D hidden dim, V vocab, K documents, P pairs (K = 2P).

A pair i is its prompt answered by chosen c_i and rejected r_i; log π(c_i) is the sum over c_i's caption tokens
(its loss-masked tokens: the caption and its <|im_end|>) of log p(token | everything before it in the document).
With the reference model's log π_ref, the log-ratios ρc = log π(c) − log π_ref(c), ρr likewise, and

    sigmoid (DPO, Rafailov et al. 2023, eq. 7):   loss_i = −log σ(β · (ρc − ρr))
    ipo     (IPO, Azar et al. 2023, eq. 17):      loss_i = (ρc / |c| − ρr / |r| − 1 / (2β))²

IPO on log-ratios averaged over each caption's tokens (|c| tokens) is TRL's DPOTrainer's `loss_type="ipo"` (the
IPO authors' normalised form); the names are TRL's. With `sft_weight` w > 0 every pair's loss also gets

    w · (−Σ_i log π(c_i)) / Σ_i |c_i|   (the micro-batch's chosen captions' mean NLL per token)

the anchor RPO adds (Pang et al. 2024): TRL's `loss_type=[<type>, "sft"]`, `loss_weights=[1, w]`. DPO alone only
asks that the chosen caption gain on the rejected one, and on a small model both may fall while the margin grows
(a sampled caption's every token, its size and background words too, is pushed); the NLL term keeps the chosen
captions likely. The rewards TRL logs are β·ρc and β·ρr; accuracy is the
share of pairs with β·ρc > β·ρr, the margin their difference.

`token_logps` runs the LM head in chunks of tokens, each under activation checkpointing, so the [N, V] logits
never exist at once (forward or backward): the head of each chunk is recomputed in the backward (overhead, not
counted in MFU). Reductions are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_TYPES = ("sigmoid", "ipo")
CHUNK = 1024  # label tokens per LM-head chunk: [CHUNK, V] fp32 logits at a time


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()  # [C, V]
    return logits.gather(1, labels[:, None]).squeeze(1) - torch.logsumexp(logits, dim=1)  # [C]


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """log p(labels[n] | hidden[n]) under the LM head `weight` [V, D], fp32 [N]; differentiable in hidden and weight."""
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start:start + chunk], labels[start:start + chunk]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            parts.append(checkpoint(_chunk_logps, h, weight, y, use_reentrant=False))
        else:
            parts.append(_chunk_logps(h, weight, y))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def doc_sums(values: torch.Tensor, doc_of: torch.Tensor, num_docs: int) -> torch.Tensor:
    """Σ values over each document: values [N], doc_of [N] (document of each value) → [K] fp32."""
    return torch.zeros(num_docs, dtype=torch.float32, device=values.device).index_add(0, doc_of, values.float())


@dataclass
class PairTerms:
    """A micro-batch's pairs: the per-pair loss [P] (with grad) and the detached terms the metrics read."""

    losses: torch.Tensor  # [P]
    chosen_rewards: torch.Tensor  # [P] β·ρc
    rejected_rewards: torch.Tensor  # [P] β·ρr
    chosen_logps: torch.Tensor  # [P] log π(c)
    rejected_logps: torch.Tensor  # [P] log π(r)


def preference_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                    ref_rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor,
                    beta: float, loss_type: str, sft_weight: float = 0.0) -> PairTerms:
    """The per-pair loss of `loss_type` (+ the NLL anchor at `sft_weight`; module docstring) from summed
    log-probabilities [P] and caption lengths [P]."""
    rho_c, rho_r = chosen - ref_chosen, rejected - ref_rejected
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (rho_c - rho_r))
    elif loss_type == "ipo":
        losses = (rho_c / chosen_len.clamp(min=1) - rho_r / rejected_len.clamp(min=1) - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"preference_loss: unknown loss_type {loss_type!r} (expected one of {', '.join(LOSS_TYPES)})")
    if sft_weight:
        losses = losses + sft_weight * (-chosen.sum() / chosen_len.sum().clamp(min=1))
    return PairTerms(losses, beta * rho_c.detach(), beta * rho_r.detach(), chosen.detach(), rejected.detach())


class PairMetrics:
    """Sums of the metrics TRL logs over the pairs seen since the last `take`: rewards/chosen, rewards/rejected,
    rewards/accuracies, rewards/margins, logps/chosen, logps/rejected (means over pairs), on the device until read."""

    NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # [6] fp64
        self.pairs = 0

    def add(self, t: PairTerms) -> None:
        rows = torch.stack([t.chosen_rewards, t.rejected_rewards, (t.chosen_rewards > t.rejected_rewards).float(),
                            t.chosen_rewards - t.rejected_rewards, t.chosen_logps, t.rejected_logps])  # [6, P]
        s = rows.double().sum(dim=1)
        self.sums = s if self.sums is None else self.sums + s
        self.pairs += t.losses.shape[0]

    def take(self) -> tuple[torch.Tensor | None, int]:
        """(sums [6] or None, pairs), and start again."""
        out = (self.sums, self.pairs)
        self.sums, self.pairs = None, 0
        return out

    @classmethod
    def means(cls, sums: list[float], pairs: int) -> dict[str, float]:
        return {name: v / pairs for name, v in zip(cls.NAMES, sums)} if pairs else {}


__all__ = ["LOSS_TYPES", "token_logps", "doc_sums", "preference_loss", "PairTerms", "PairMetrics"]
