"""FLUX.1's two frozen text encoders, encoding captions exactly as `FluxPipeline.encode_prompt` does.

Shape legend: B captions, Lc = 77 CLIP tokens (the CLIP tokenizer's model_max_length), T = max_sequence_length T5
tokens, E the T5 width (4096: the transformer's joint_attention_dim), P the CLIP-L width (768: its
pooled_projection_dim).

Per caption (diffusers' `FluxPipeline._get_clip_prompt_embeds`, `_get_t5_prompt_embeds`):
- CLIP-L (`CLIPTextModel`, text_encoder/) tokenizes to exactly Lc tokens and gives only its pooled output (the
  final-norm state of the end-of-text token, no projection) [B, P]: the conditioning vector's text part;
- T5 (text_encoder_2/) tokenizes to exactly T tokens and runs without an attention mask, as diffusers does (T5's
  padding is attended and changes the real tokens' states: matched on purpose); its last hidden state [B, T, E] is
  the text stream. FLUX.1-dev takes T <= 512, schnell <= 256 (FluxPipeline's default is 512 for both).

The text ids FluxPipeline passes (zeros [T, 3]) are the transformer's (imagegen/flux.py position_ids). CFG's
unconditional input and caption dropout's "" input are the empty caption encoded the same way. `parts`: CLIP-L
owns the pooled vector, T5 the states, so caption dropout can drop them independently (imagegen/task.py).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from atelier_studio.imagegen.config import FLUX_T5_TOKENS as MAX_T5_TOKENS
from atelier_studio.imagegen.pipeline_text import load_text_part, open_text_pipeline
from atelier_studio.imagegen.text import CaptionTokens, TextEncoderError, TextPart
from atelier_studio.pipeline.hf_files import check_vocab_size

PIPELINE = "FluxPipeline"


class FluxTextEncoders(CaptionTokens, nn.Module):
    """CLIP-L + T5 of a FLUX pipeline directory. `encode(captions)` -> (states [B, T, E], pooled [B, P],
    mask [B, T] int64: T5's attention mask, 1 = a real token)."""

    kind = "flux"

    def __init__(self, path: str | os.PathLike, max_sequence_length: int = 512, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel

        self.path, _ = open_text_pipeline(path, PIPELINE, "FLUX", max_sequence_length, MAX_T5_TOKENS,
                                          "diffusers' limit for FLUX")
        self.max_sequence_length, self.device, self.dtype = max_sequence_length, torch.device(device), dtype

        def encoder(cls):
            return lambda p: cls.from_pretrained(p, local_files_only=True, dtype=dtype, use_safetensors=True)

        self.clip_tokenizer = load_text_part(self.path, "tokenizer",
                                             lambda p: CLIPTokenizer.from_pretrained(p, local_files_only=True), "clip")
        self.t5_tokenizer = load_text_part(self.path, "tokenizer_2",
                                           lambda p: AutoTokenizer.from_pretrained(p, local_files_only=True), "t5")
        clip = load_text_part(self.path, "text_encoder", encoder(CLIPTextModel))
        t5 = load_text_part(self.path, "text_encoder_2", encoder(T5EncoderModel))
        check_vocab_size(self.clip_tokenizer, self.path / "tokenizer", int(clip.config.vocab_size),
                         self.path / "text_encoder")
        check_vocab_size(self.t5_tokenizer, self.path / "tokenizer_2", int(t5.config.vocab_size),
                         self.path / "text_encoder_2")
        self.clip = clip.to(self.device).eval().requires_grad_(False)
        self.t5 = t5.to(self.device).eval().requires_grad_(False)
        self.clip_length = int(self.clip_tokenizer.model_max_length)  # diffusers' tokenizer_max_length
        if clip.config.max_position_embeddings < self.clip_length:
            raise TextEncoderError(f"{self.path / 'text_encoder'}: max_position_embeddings "
                                   f"{clip.config.max_position_embeddings} < the tokenizer's model_max_length "
                                   f"{self.clip_length}")
        self.states_width, self.pooled_width = int(t5.config.d_model), int(clip.config.hidden_size)
        self.num_tokens = self.max_length = max_sequence_length
        self.hidden_size = self.states_width
        T, E, P = max_sequence_length, self.states_width, self.pooled_width
        self.parts = (TextPart("clip_l", slice(0, 0), slice(0, 0), slice(0, P)),
                      TextPart("t5", slice(0, T), slice(0, E), None))
        self.truncated = {"clip": 0, "t5": 0}  # captions cut at the CLIP / T5 token limit so far
        self._empty: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """captions (B) -> states [B, T, E], pooled [B, P] (in `dtype`), mask [B, T] (1 = a real T5 token)."""
        if not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
            raise TextEncoderError(f"FluxTextEncoders.encode expects a list of strings, got {type(captions).__name__}")
        captions = list(captions)
        clip_tok = self._tokens(self.clip_tokenizer, captions, self.clip_length, "clip")
        pooled = self.clip(clip_tok["input_ids"].to(self.device), output_hidden_states=False).pooler_output  # [B, P]
        t5_tok = self._tokens(self.t5_tokenizer, captions, self.max_sequence_length, "t5")
        states = self.t5(t5_tok["input_ids"].to(self.device), output_hidden_states=False)[0]  # [B, T, E]
        return states.to(self.dtype), pooled.to(self.dtype), t5_tok["attention_mask"].to(self.device)

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty caption: (states [T, E], pooled [P]); caption dropout's "" input."""
        if self._empty is None:
            states, pooled, _ = self.encode([""])
            self._empty = states[0], pooled[0]
        return self._empty

    def negative(self) -> tuple[torch.Tensor, torch.Tensor]:
        """CFG's unconditional input (FluxPipeline's negative_prompt "" under true_cfg_scale): the empty caption."""
        return self.empty()

    def settings(self) -> dict:
        """What produced the states (written to cache.json and imagegen.json)."""
        return {"text_encoder": str(self.path.resolve()), "text_kind": self.kind,
                "max_sequence_length": self.max_sequence_length, "text_tokens": self.num_tokens,
                "states_width": self.states_width, "pooled_width": self.pooled_width}


__all__ = ["FluxTextEncoders", "MAX_T5_TOKENS"]
