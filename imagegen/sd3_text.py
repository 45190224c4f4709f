"""SD3's three frozen text encoders, encoding captions exactly as `StableDiffusion3Pipeline.encode_prompt` does.

Shape legend: B captions, Lc = 77 CLIP tokens (the CLIP-L tokenizer's model_max_length, used for both CLIPs),
T = max_sequence_length T5 tokens, L = Lc + T, Dl / Dg the CLIP-L / CLIP-G widths (768 / 1280 in SD3),
E the T5 width (4096; the MMDiT's joint_attention_dim), Pl / Pg the CLIP projection widths (768 / 1280),
P = Pl + Pg (2048; the MMDiT's pooled_projection_dim).

Per caption (diffusers' `_get_clip_prompt_embeds`, `_get_t5_prompt_embeds`, `encode_prompt`):
- each CLIP tokenizes to exactly Lc tokens (padded, truncated) and runs without an attention mask (CLIP's own
  causal mask keeps the padding from changing a real token); its states are `hidden_states[-(clip_skip + 2)]`
  (clip_skip 0: the penultimate layer) and its pooled vector is the projected end-of-text state (`text_embeds`);
- the two CLIPs' states are concatenated on the feature axis [B, Lc, Dl + Dg] and zero-padded to E;
- T5 tokenizes to exactly T tokens and runs without an attention mask (diffusers passes none, so T5's padding
  is attended and changes the real tokens' states: matched here on purpose); without T5 (`use_t5=False`, SD3's
  T5-less mode) its part is zeros [B, T, E] and T5 is never loaded;
- states = [CLIP part; T5 part] along the sequence [B, L, E]; pooled = [CLIP-L pooled, CLIP-G pooled] [B, P].

The unconditional input of classifier-free guidance (`negative`) is the empty caption encoded as diffusers
encodes its negative prompt: always at the penultimate CLIP layer, whatever clip_skip is. `empty` is the empty
caption encoded like any caption (clip_skip applied): what caption dropout to "" trains on.

`parts` tells which rows and columns of the states (and columns of the pooled vector) come from which encoder,
so caption dropout can drop the encoders independently (imagegen/task.py).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from atelier_studio.imagegen.pipeline_text import load_text_part, open_text_pipeline
from atelier_studio.imagegen.sd3_dir import MAX_T5_TOKENS, check_pipeline_files, has_part, transformer_config
from atelier_studio.imagegen.text import CaptionTokens, TextEncoder, TextEncoderError, TextPart, text_encoder_dir
from atelier_studio.pipeline.hf_files import check_vocab_size


def join_prompt_embeds(clip_l: torch.Tensor, clip_g: torch.Tensor, t5: torch.Tensor) -> torch.Tensor:
    """CLIP-L [B, Lc, Dl] and CLIP-G [B, Lc, Dg] states side by side, zero-padded to T5's width E, then T5's
    [B, T, E] after them along the sequence -> [B, Lc + T, E] (encode_prompt's layout)."""
    clip = torch.cat([clip_l, clip_g], dim=-1)  # [B, Lc, Dl + Dg]
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))  # [B, Lc, E]
    return torch.cat([clip, t5], dim=-2)  # [B, Lc + T, E]


class SD3TextEncoders(CaptionTokens, nn.Module):
    """CLIP-L + CLIP-G + T5 of an SD3 pipeline directory. `encode(captions)` -> (states [B, L, E], pooled [B, P],
    mask [B, L] int64: each tokenizer's attention mask, zeros for a dropped T5)."""

    kind = "sd3"

    def __init__(self, path: str | os.PathLike, max_sequence_length: int = 256, clip_skip: int = 0,
                 use_t5: bool = True, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel

        if clip_skip < 0:
            raise TextEncoderError(f"text.clip_skip: must be >= 0, got {clip_skip}")
        self.path, index = open_text_pipeline(path, "StableDiffusion3Pipeline", "SD3", max_sequence_length,
                                              MAX_T5_TOKENS, "diffusers' limit", check_files=False)
        if use_t5 and not has_part(index, "text_encoder_3"):
            raise TextEncoderError(f"{self.path}: this pipeline has no text_encoder_3 (T5); set text.use_t5 = false "
                                   f"to train with T5's part as zeros")
        check_pipeline_files(self.path)  # every part's files, before the first is loaded
        self.max_sequence_length, self.clip_skip, self.use_t5 = max_sequence_length, clip_skip, use_t5
        self.device, self.dtype = torch.device(device), dtype

        def load(what: str, fn, tokenizer: str = ""):
            return load_text_part(self.path, what, fn, tokenizer)

        def encoder(cls):
            return lambda p: cls.from_pretrained(p, local_files_only=True, dtype=dtype, use_safetensors=True)

        self.tokenizers = [load(n, lambda p: CLIPTokenizer.from_pretrained(p, local_files_only=True), "clip")
                           for n in ("tokenizer", "tokenizer_2")]
        clips = [load(n, encoder(CLIPTextModelWithProjection)) for n in ("text_encoder", "text_encoder_2")]
        for t, e, tok, m in zip(("tokenizer", "tokenizer_2"), ("text_encoder", "text_encoder_2"), self.tokenizers,
                                clips):
            check_vocab_size(tok, self.path / t, int(m.config.vocab_size), self.path / e)
        self.clips = nn.ModuleList(m.to(self.device).eval().requires_grad_(False) for m in clips)
        # diffusers' tokenizer_max_length: the CLIP-L tokenizer's model_max_length, for both CLIPs
        self.clip_length = int(self.tokenizers[0].model_max_length)
        for name, m in zip(("text_encoder", "text_encoder_2"), self.clips):
            if m.config.max_position_embeddings < self.clip_length:
                raise TextEncoderError(f"{self.path / name}: max_position_embeddings {m.config.max_position_embeddings}"
                                       f" < the tokenizer's model_max_length {self.clip_length}")
            if clip_skip + 1 > m.config.num_hidden_layers:  # hidden_states[-(clip_skip + 2)] must exist
                raise TextEncoderError(f"text.clip_skip = {clip_skip}: {self.path / name} has "
                                       f"{m.config.num_hidden_layers} layers (clip_skip <= "
                                       f"{m.config.num_hidden_layers - 1})")
        self.t5_tokenizer = self.t5 = None
        if use_t5:
            self.t5_tokenizer = load("tokenizer_3", lambda p: AutoTokenizer.from_pretrained(p, local_files_only=True),
                                     "t5")
            t5 = load("text_encoder_3", encoder(T5EncoderModel))
            check_vocab_size(self.t5_tokenizer, self.path / "tokenizer_3", int(t5.config.vocab_size),
                             self.path / "text_encoder_3")
            self.t5 = t5.to(self.device).eval().requires_grad_(False)
            width = int(self.t5.config.d_model)
        else:  # diffusers' zeros have the transformer's joint_attention_dim
            width = int(transformer_config(self.path).get("joint_attention_dim", 4096))
        widths = [int(m.config.hidden_size) for m in self.clips]
        projections = [int(m.config.projection_dim) for m in self.clips]
        if sum(widths) > width:
            raise TextEncoderError(f"{self.path}: CLIP widths {widths} add up to more than T5's width {width}; "
                                   f"encode_prompt pads the CLIP states to T5's width")
        self.states_width, self.pooled_width = width, sum(projections)
        self.num_tokens = self.clip_length + max_sequence_length
        self.max_length = self.num_tokens  # the TextEncoder name of L
        self.hidden_size = width
        Lc, (Dl, Dg), (Pl, Pg) = self.clip_length, widths, projections
        self.parts = (TextPart("clip_l", slice(0, Lc), slice(0, Dl), slice(0, Pl)),
                      TextPart("clip_g", slice(0, Lc), slice(Dl, Dl + Dg), slice(Pl, Pl + Pg)),
                      TextPart("t5", slice(Lc, Lc + max_sequence_length), slice(0, width), None))
        self.truncated = {"clip": 0, "t5": 0}  # captions cut at the CLIP / T5 token limit so far
        self._empty: tuple[torch.Tensor, torch.Tensor] | None = None
        self._negative: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ the encoders

    def _clip(self, i: int, captions: list[str], clip_skip: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CLIP i (0: CLIP-L, 1: CLIP-G) -> (states [B, Lc, D], pooled [B, P], mask [B, Lc])."""
        tok = self._tokens(self.tokenizers[i], captions, self.clip_length, "clip" if i == 0 else None)  # count once
        out = self.clips[i](tok["input_ids"].to(self.device), output_hidden_states=True)
        return out.hidden_states[-(clip_skip + 2)], out.text_embeds, tok["attention_mask"]

    def _t5(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """T5 -> (states [B, T, E], mask [B, T]); zeros (and a zero mask) when T5 is not used."""
        B, T = len(captions), self.max_sequence_length
        if self.t5 is None:
            return (torch.zeros(B, T, self.states_width, device=self.device, dtype=self.dtype),
                    torch.zeros(B, T, dtype=torch.int64))
        tok = self._tokens(self.t5_tokenizer, captions, T, "t5")
        return self.t5(tok["input_ids"].to(self.device))[0], tok["attention_mask"]

    @torch.no_grad()
    def encode(self, captions: list[str], clip_skip: int | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
        """captions (B) -> states [B, L, E], pooled [B, P] (in `dtype`), mask [B, L] (1 = a real token)."""
        if not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
            raise TextEncoderError(f"SD3TextEncoders.encode expects a list of strings, got {type(captions).__name__}")
        captions = list(captions)
        skip = self.clip_skip if clip_skip is None else clip_skip
        (s_l, p_l, m_l), (s_g, p_g, _) = self._clip(0, captions, skip), self._clip(1, captions, skip)
        s_t5, m_t5 = self._t5(captions)
        states = join_prompt_embeds(s_l.to(self.dtype), s_g.to(self.dtype), s_t5.to(self.dtype))  # [B, L, E]
        pooled = torch.cat([p_l, p_g], dim=-1).to(self.dtype)  # [B, P]
        return states, pooled, torch.cat([m_l, m_t5], dim=1).to(self.device)

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty caption encoded like every caption: (states [L, E], pooled [P]); caption dropout's "" input."""
        if self._empty is None:
            states, pooled, _ = self.encode([""])
            self._empty = states[0], pooled[0]
        return self._empty

    def negative(self) -> tuple[torch.Tensor, torch.Tensor]:
        """CFG's unconditional input, as StableDiffusion3Pipeline encodes its default negative prompt "": the
        penultimate CLIP layer whatever clip_skip is. (states [L, E], pooled [P])."""
        if self._negative is None:
            states, pooled, _ = self.encode([""], clip_skip=0)
            self._negative = states[0], pooled[0]
        return self._negative

    def settings(self) -> dict:
        """What produced the states (written to cache.json and imagegen.json)."""
        return {"text_encoder": str(self.path.resolve()), "text_kind": self.kind,
                "max_sequence_length": self.max_sequence_length, "clip_skip": self.clip_skip, "use_t5": self.use_t5,
                "text_tokens": self.num_tokens, "states_width": self.states_width, "pooled_width": self.pooled_width}


def load_text_encoder(cfg, device: str | torch.device = "cpu", model_path: str = ""):
    """The text encoder of an `imagegen.config.TextConfig`, any kind: for "sd3" the three encoders of the SD3
    pipeline at text.encoder ("" = `model_path`, the run's model.path), for "flux" the two of a FLUX pipeline
    (imagegen/flux_text.py), for "qwen-image" the Qwen2.5-VL of a Qwen-Image pipeline (imagegen/qwen_image_text.py),
    else a TextEncoder (imagegen/text.py)."""
    path = text_encoder_dir(cfg, model_path)
    if cfg.kind == "qwen-image":
        from atelier_studio.imagegen.qwen_image_text import QwenImageTextEncoder

        return QwenImageTextEncoder(path, cfg.max_sequence_length, device, getattr(torch, cfg.dtype))
    if cfg.kind == "flux":
        from atelier_studio.imagegen.flux_text import FluxTextEncoders

        return FluxTextEncoders(path, cfg.max_sequence_length, device, getattr(torch, cfg.dtype))
    if cfg.kind == "sd3":
        return SD3TextEncoders(path, cfg.max_sequence_length, cfg.clip_skip, cfg.use_t5, device,
                               getattr(torch, cfg.dtype))
    return TextEncoder(path or None, cfg.kind, cfg.max_length, cfg.layer, cfg.pooled, device,
                       getattr(torch, cfg.dtype))


__all__ = ["SD3TextEncoders", "join_prompt_embeds", "load_text_encoder"]
