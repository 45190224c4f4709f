"""Batched sampling for captions (greedy when temperature == 0), from each family's decoding cache.

Prompts are batched longest first and decoded by the family's `decode_batch` (designer/family.py): K/V for
attention layers (designer/decode.py) and, for Qwen3.5's Gated DeltaNet layers, the conv inputs of the last
K−1 tokens and the delta rule's recurrent state (designer/qwen35.py). Each prompt decodes exactly as it would
alone (left padding is masked out). `generate_greedy_ref` (no cache: the packed training forward re-run for
every token) is the slow reference the tests hold every cache against.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from atelier_studio.designer.decoder import CausalLM
from atelier_studio.designer.registry import family_of_args
from atelier_studio.pipeline.errors import UsageError


def _encode(tokenizer, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"generate: prompt {i} is a string but no tokenizer was given")
            p = tokenizer.encode(p, add_special_tokens=False)
        p = [int(x) for x in p]
        if not p:
            raise ValueError(f"generate: prompt {i} is empty")
        out.append(p)
    return out


@torch.no_grad()
def generate(
    model: CausalLM,
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    batch_size: int = 16,
) -> list[list[int]]:
    """New token ids for each prompt, stopping before the first eos (which is not included).

    prompts: already chat-formatted, as token-id lists or as strings (encoded with
    `tokenizer.encode(s, add_special_tokens=False)`, so the text must already carry its template).
    eos_token_id: int or list; None → tokenizer.eos_token_id (then model.args.eos_token_id).
    Prompts are run in batches of `batch_size`, longest first (less padding); results keep prompt order.
    Sampling draws from one torch.Generator seeded with `seed`, so a call is reproducible.
    """
    decode_batch = family_of_args(model.args).decode_batch  # TypeError for a model of no registered family
    if max_new_tokens < 1 or batch_size < 1:
        raise UsageError(f"generate: max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise UsageError(f"generate: need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    ids = _encode(tokenizer, prompts)
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        eos_token_id = model.args.eos_token_id if eos_token_id is None else eos_token_id
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    longest = max(len(p) for p in ids)
    if longest + max_new_tokens > model.args.max_seq_len:
        raise UsageError(f"generate: a prompt of {longest} tokens + {max_new_tokens} new exceeds max_seq_len "
                         f"{model.args.max_seq_len}")
    device = model.lm_head_weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    eos_t = torch.tensor(eos, device=device, dtype=torch.long)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    results: list[list[int]] = [[] for _ in ids]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            for i, out in zip(chunk, decode_batch(model, [ids[i] for i in chunk], max_new_tokens, temperature, top_p,
                                                  gen, eos_t)):
                results[i] = out
    finally:
        model.train(was_training)
    return results


@torch.no_grad()
def generate_greedy_ref(model: CausalLM, prompt: Sequence[int], max_new_tokens: int,
                        eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """Greedy decoding with no cache: re-run the packed forward over the whole sequence for every token."""
    eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
    device = model.lm_head_weight.device
    seq, new = list(prompt), []
    for _ in range(max_new_tokens):
        n = len(seq)
        hidden = model(torch.tensor([seq], device=device), torch.arange(n, device=device)[None],
                       torch.tensor([0, n], dtype=torch.int32, device=device), n)  # [1,n,D]
        nxt = int(model.logits(hidden[0, -1]).argmax())
        if nxt in eos:
            break
        seq.append(nxt)
        new.append(nxt)
    return new
