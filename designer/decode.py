"""Decoding caches for designer/generate.py: K/V for attention layers, the sampling loop, left-padded prompts.

Shape legend: B prompts in a batch, P longest prompt, T tokens fed this step (P at prefill, 1 after),
S = P + max_new_tokens cache slots, H / Hkv heads, Dh head dim, V vocab.

Prompts are LEFT-padded to P: prompt b occupies cache slots [pad_b, P). Its positions restart at 0 on
its first real token, and a key slot is visible to a query when it is a real token at or before it,
so each prompt decodes exactly as it would alone. The block code is the model's own (the cache only supplies
cache-aware attends), so generation cannot drift from training.

A family names its decoding cache in its Family record (designer/family.py, `decode_batch`):
`kv_cache_batch` here serves every model whose layers all attend (`model.hidden_states(ids, positions,
attends)`: Qwen3); a family with other state builds its own from these parts (Qwen3.5's Gated DeltaNet
state, designer/qwen35.py `hybrid_cache_batch`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from atelier_studio.designer.decoder import CausalLM


class KVCache:
    """Per-layer K/V [B, Hkv, S, Dh] and the key-visibility mask of left-padded prompts.

    `layers` are the indices of the model's attention layers (all of them by default; Qwen3.5's full-attention
    ones): attends[i] is layer i's cache-aware attention, None for a layer without attention."""

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


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
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


def left_padded(ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts → pads [B], tokens [B,P] left-padded with id 0 (masked out), positions [B,P] restarting at each
    prompt's first real token."""
    b, p = len(ids), max(len(x) for x in ids)
    pads = torch.tensor([p - len(x) for x in ids], device=device)  # [B]
    tokens = torch.zeros(b, p, dtype=torch.long, device=device)
    for r, x in enumerate(ids):
        tokens[r, p - len(x):] = torch.tensor(x, device=device)
    positions = (torch.arange(p, device=device)[None, :] - pads[:, None]).clamp(min=0)  # [B,P]
    return pads, tokens, positions


def decode_loop(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], b: int,
                prefill: tuple[torch.Tensor, torch.Tensor], max_new: int, temperature: float, top_p: float,
                gen: torch.Generator, eos: torch.Tensor,
                lm_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[list[int]]:
    """The sampling loop: `step(tokens, positions)` → hidden [B,T,D] advances the cache by T tokens."""
    tokens, positions = prefill
    device = tokens.device
    out = torch.zeros(b, max_new, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.full((b,), max_new, dtype=torch.long, device=device)
    for i in range(max_new):
        hidden = step(tokens, positions)  # [B,T,D]
        nxt = sample_next(lm_logits(hidden[:, -1]).float(), temperature, top_p, gen)  # [B]
        hit = torch.isin(nxt, eos) & ~done
        lengths = torch.where(hit, i, lengths)
        done |= hit
        out[:, i] = nxt
        if bool(done.all()):
            break
        tokens, positions = nxt[:, None], positions[:, -1:] + 1  # [B,1]
    return [out[r, : int(lengths[r])].tolist() for r in range(b)]


def kv_cache_batch(model: CausalLM, ids: list[list[int]], max_new: int, temperature: float, top_p: float,
                   gen: torch.Generator, eos: torch.Tensor) -> list[list[int]]:
    """Decode one batch of prompts from a K/V cache of every layer, through `model.hidden_states`."""
    device = model.lm_head_weight.device
    pads, tokens, positions = left_padded(ids, device)
    cache = KVCache(model, pads, tokens.shape[1], max_new)

    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        hidden = model.hidden_states(tok, pos, cache.attends)
        cache.length += tok.shape[1]
        return hidden

    return decode_loop(step, len(ids), (tokens, positions), max_new, temperature, top_p, gen, eos, model.logits)
