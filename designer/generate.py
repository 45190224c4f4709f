"""Batched sampling for captions (greedy when temperature == 0), from a cache: K/V for attention layers and, for
Qwen3.5's Gated DeltaNet layers, the conv inputs of the last K−1 tokens and the delta rule's recurrent state.

Shape legend: B prompts in a batch, P longest prompt, T tokens fed this step (P at prefill, 1 after),
S = P + max_new_tokens cache slots, H / Hkv heads, Dh head dim, V vocab.

Prompts are LEFT-padded to P: prompt b occupies cache slots [pad_b, P). Its positions restart at 0 on
its first real token, and a key slot is visible to a query when it is a real token at or before it,
so each prompt decodes exactly as it would alone; a Gated DeltaNet layer skips the pads (its state stays
zero until the prompt's first token). The block code is the model's own (Qwen3.hidden_states with cache-aware
attends; Qwen35.decode_hidden_states, whose delta rule runs its recurrent form token by token), so generation
cannot drift from training. `generate_greedy_ref` (no cache: the packed training forward re-run for every
token) is the slow reference the tests hold both against.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from atelier_studio.designer.model import CausalLM, Qwen3
from atelier_studio.designer.qwen35 import FULL, LinearAttentionState, Qwen35


class KVCache:
    """Per-layer K/V [B, Hkv, S, Dh] and the key-visibility mask of left-padded prompts.

    `layers` are the indices of the model's attention layers (all of Qwen3's; Qwen3.5's full-attention ones):
    attends[i] is layer i's cache-aware attention, None for a layer without attention."""

    def __init__(self, model: CausalLM, pads: torch.Tensor, prompt_len: int, max_new: int,
                 layers: Sequence[int] | None = None) -> None:
        a = model.args
        layers = list(range(a.num_layers)) if layers is None else list(layers)
        b, s = pads.shape[0], prompt_len + max_new
        w = model.lm_head_weight
        self.k = torch.zeros(len(layers), b, a.num_kv_heads, s, a.head_dim, dtype=w.dtype, device=w.device)
        self.v = torch.zeros_like(self.k)
        self.valid = torch.arange(s, device=w.device)[None, :] >= pads[:, None]  # [B,S] slot holds a real token
        self.length = 0  # slots filled so far
        self.gqa = a.num_heads != a.num_kv_heads
        self.attends: list = [None] * a.num_layers
        for slot, layer in enumerate(layers):
            self.attends[layer] = functools.partial(self.attend, slot)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B,T,H,Dh], k/v [B,T,Hkv,Dh] for slots [length, length+T) → o [B,T,H,Dh]."""
        end = self.length + q.shape[1]
        self.k[layer, :, :, self.length : end] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer, :, :, self.length : end] = v.transpose(1, 2).to(self.v.dtype)
        q_slot = torch.arange(self.length, end, device=q.device)  # [T]
        k_slot = torch.arange(end, device=q.device)  # [end]
        # real key at or before the query; a pad query also sees itself so its softmax row is never empty
        # (its output is never read).
        mask = (k_slot[None, :] <= q_slot[:, None])[None] & self.valid[:, None, :end]  # [B,T,end]
        mask = mask | (k_slot[None, :] == q_slot[:, None])[None]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), self.k[layer, :, :, :end], self.v[layer, :, :, :end],
                                           attn_mask=mask[:, None], enable_gqa=self.gqa)  # [B,H,T,Dh]
        return o.transpose(1, 2).to(q.dtype)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """logits [B,V] fp32 → next ids [B]: argmax at temperature 0, else nucleus sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # mass before this token already reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


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
    if not isinstance(model, (Qwen3, Qwen35)):
        raise TypeError(f"generate: no decoding cache for {type(model).__name__} (Qwen3 and Qwen3.5 have one)")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"generate: max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"generate: need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    ids = _encode(tokenizer, prompts)
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        eos_token_id = model.args.eos_token_id if eos_token_id is None else eos_token_id
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    longest = max(len(p) for p in ids)
    if longest + max_new_tokens > model.args.max_seq_len:
        raise ValueError(f"generate: a prompt of {longest} tokens + {max_new_tokens} new exceeds max_seq_len "
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
            batch = _generate_batch if isinstance(model, Qwen3) else _generate_batch_hybrid
            for i, out in zip(chunk, batch(model, [ids[i] for i in chunk], max_new_tokens, temperature, top_p, gen,
                                           eos_t)):
                results[i] = out
    finally:
        model.train(was_training)
    return results


def _generate_batch(model: Qwen3, ids: list[list[int]], max_new: int, temperature: float, top_p: float,
                    gen: torch.Generator, eos: torch.Tensor) -> list[list[int]]:
    device = model.lm_head_weight.device
    pads, tokens, positions = _left_padded(ids, device)
    cache = KVCache(model, pads, tokens.shape[1], max_new)

    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        hidden = model.hidden_states(tok, pos, cache.attends)
        cache.length += tok.shape[1]
        return hidden

    return _decode_loop(step, len(ids), (tokens, positions), max_new, temperature, top_p, gen, eos, model.logits)


def _left_padded(ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts → pads [B], tokens [B,P] left-padded with id 0 (masked out), positions [B,P] restarting at each
    prompt's first real token."""
    b, p = len(ids), max(len(x) for x in ids)
    pads = torch.tensor([p - len(x) for x in ids], device=device)  # [B]
    tokens = torch.zeros(b, p, dtype=torch.long, device=device)
    for r, x in enumerate(ids):
        tokens[r, p - len(x):] = torch.tensor(x, device=device)
    positions = (torch.arange(p, device=device)[None, :] - pads[:, None]).clamp(min=0)  # [B,P]
    return pads, tokens, positions


def _decode_loop(step, b: int, prefill: tuple[torch.Tensor, torch.Tensor], max_new: int, temperature: float,
                 top_p: float, gen: torch.Generator, eos: torch.Tensor, lm_logits) -> list[list[int]]:
    """The sampling loop: `step(tokens, positions)` → hidden [B,T,D] advances the cache by T tokens."""
    tokens, positions = prefill
    device = tokens.device
    out = torch.zeros(b, max_new, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.full((b,), max_new, dtype=torch.long, device=device)
    for i in range(max_new):
        hidden = step(tokens, positions)  # [B,T,D]
        nxt = _sample(lm_logits(hidden[:, -1]).float(), temperature, top_p, gen)  # [B]
        hit = torch.isin(nxt, eos) & ~done
        lengths = torch.where(hit, i, lengths)
        done |= hit
        out[:, i] = nxt
        if bool(done.all()):
            break
        tokens, positions = nxt[:, None], positions[:, -1:] + 1  # [B,1]
    return [out[r, : int(lengths[r])].tolist() for r in range(b)]


def _generate_batch_hybrid(model: Qwen35, ids: list[list[int]], max_new: int, temperature: float, top_p: float,
                           gen: torch.Generator, eos: torch.Tensor) -> list[list[int]]:
    """Qwen3.5: K/V for the full-attention layers, conv and recurrent state for the Gated DeltaNet layers."""
    device = model.lm_head_weight.device
    pads, tokens, positions = _left_padded(ids, device)
    layers = model.model.layers
    cache = KVCache(model, pads, tokens.shape[1], max_new, [i for i, blk in enumerate(layers) if blk.layer_type == FULL])
    states = [None if blk.layer_type == FULL else LinearAttentionState.zeros(blk.linear_attn, len(ids), device)
              for blk in layers]

    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        valid = cache.valid[:, cache.length: cache.length + tok.shape[1]]  # [B,T]
        hidden = model.decode_hidden_states(tok, pos, cache.attends, states, valid)
        cache.length += tok.shape[1]
        return hidden

    return _decode_loop(step, len(ids), (tokens, positions), max_new, temperature, top_p, gen, eos, model.logits)


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
