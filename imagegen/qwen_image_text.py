"""Qwen-Image's frozen text encoder (Qwen2.5-VL), encoding captions exactly as `QwenImagePipeline.encode_prompt` does.

Shape legend: B captions, L = max_sequence_length text tokens (QwenImagePipeline's default 1024), E the Qwen2.5-VL
hidden size (3584: the transformer's joint_attention_dim), T = L + DROP template tokens.

Per caption (diffusers' `QwenImagePipeline._get_qwen_prompt_embeds` and `encode_prompt`):
- the caption is put into the pipeline's chat template (a system turn asking for a detailed description, then the
  caption as the user turn, then the assistant's turn opened) and tokenized, cut at T tokens;
- Qwen2.5-VL's language model runs on the tokens (right padding, the attention mask given; the vision tower is
  loaded with the checkpoint but never runs) and its last hidden state (after the final norm) is taken;
- the first DROP = 34 states, the template's system turn and the user turn's header, are dropped, and the rest cut
  at L: the caption's states, then the template's closing tokens.
diffusers pads a batch's states with zeros to its longest caption and returns the mask (None when nothing is padded);
here every caption is padded to L, so every batch has the same shape. The transformer masks padded text out of its
attention and places the text's RoPE positions after the image's whatever L is (imagegen/qwen_image.py), so the
longer zero padding changes nothing the image sees.

Qwen-Image has no pooled text vector: the "pooled" output, the per-caption vector the generic code caches and passes
as the model's third argument, is the text mask [B, L] as floats (1: a caption token, 0: padding); `pooled_width`
is L. Caption dropout's "" and CFG's unconditional input are the empty caption encoded the same way (its template
tokens are real states: QwenImagePipeline encodes a negative prompt as any other).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from atelier_studio.imagegen.config import QWEN_IMAGE_TOKENS as MAX_TOKENS
from atelier_studio.imagegen.pipeline_text import open_text_pipeline
from atelier_studio.imagegen.sd3_dir import part_dir
from atelier_studio.imagegen.text import TextEncoderError, TextPart
from atelier_studio.pipeline.hf_files import check_vocab_size

PIPELINE = "QwenImagePipeline"
# QwenImagePipeline.__init__: prompt_template_encode, prompt_template_encode_start_idx (its tokenizer_max_length is
# config.py's QWEN_IMAGE_TOKENS)
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
DROP = 34


class QwenImageTextEncoder(nn.Module):
    """Qwen2.5-VL of a QwenImagePipeline directory. `encode(captions)` -> (states [B, L, E], pooled = the text mask as
    floats [B, L], mask [B, L] int64, 1 = a caption token)."""

    kind = "qwen-image"

    def __init__(self, path: str | os.PathLike, max_sequence_length: int = MAX_TOKENS,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        self.path, _ = open_text_pipeline(path, PIPELINE, "Qwen-Image", max_sequence_length, MAX_TOKENS,
                                          "QwenImagePipeline's limit")
        self.max_sequence_length, self.device, self.dtype = max_sequence_length, torch.device(device), dtype
        tok_dir, enc_dir = part_dir(self.path, "tokenizer"), part_dir(self.path, "text_encoder")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(enc_dir), local_files_only=True,
                                                                       dtype=dtype, use_safetensors=True)
        except (OSError, ValueError) as e:
            raise TextEncoderError(f"{self.path}: cannot load the Qwen2.5-VL text encoder ({type(e).__name__}: "
                                   f"{e})") from e
        text_config = model.config.get_text_config()
        check_vocab_size(self.tokenizer, tok_dir, int(text_config.vocab_size), enc_dir)
        self.tokenizer.padding_side = "right"  # the caption's states do not depend on the padding after them
        # the base model (no LM head: its [B, T, 151k] logits are never needed)
        self.model = model.model.to(self.device).eval().requires_grad_(False)
        self.states_width = int(text_config.hidden_size)
        self.num_tokens = self.pooled_width = max_sequence_length
        self.hidden_size = self.states_width
        L, E = max_sequence_length, self.states_width
        self.parts = (TextPart("qwen2.5-vl", slice(0, L), slice(0, E), slice(0, L)),)
        self.truncated = 0  # captions cut at max_sequence_length so far
        self._empty: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """captions (B) -> states [B, L, E] (in `dtype`, zeros past each caption), pooled = mask [B, L] as floats,
        mask [B, L] int64 (1 = a caption token)."""
        if not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
            raise TextEncoderError(f"QwenImageTextEncoder.encode expects a list of strings, got "
                                   f"{type(captions).__name__}")
        L = self.max_sequence_length
        texts = [TEMPLATE.format(c) for c in captions]
        full = self.tokenizer(texts, padding=False, truncation=False)["input_ids"]
        self.truncated += sum(len(ids) - DROP > L for ids in full)
        tok = self.tokenizer(texts, max_length=L + DROP, padding=True, truncation=True, return_tensors="pt")
        ids, attn = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device)  # [B, T]
        hidden = self.model(input_ids=ids, attention_mask=attn, output_hidden_states=True,
                            use_cache=False).hidden_states[-1]  # [B, T, E]
        states = hidden.new_zeros(len(captions), L, self.states_width)  # [B, L, E]
        mask = torch.zeros(len(captions), L, dtype=torch.long, device=self.device)  # [B, L]
        for i, n in enumerate(attn.sum(1).tolist()):  # right padding: the first n tokens are the caption's
            kept = min(max(n - DROP, 0), L)
            states[i, :kept] = hidden[i, DROP:DROP + kept]
            mask[i, :kept] = 1
        return states.to(self.dtype), mask.to(self.dtype), mask

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty caption: (states [L, E], pooled = its mask [L]); caption dropout's "" input."""
        if self._empty is None:
            states, pooled, _ = self.encode([""])
            self._empty = states[0], pooled[0]
        return self._empty

    def negative(self) -> tuple[torch.Tensor, torch.Tensor]:
        """CFG's unconditional input (QwenImagePipeline's negative_prompt "" under true_cfg_scale): the empty
        caption."""
        return self.empty()

    def report_truncation(self, where: str) -> None:
        """One log line when captions were cut at max_sequence_length (diffusers cuts them silently)."""
        if self.truncated:
            from atelier_studio.pipeline.progress import log

            log(f"{where}: {self.truncated} caption(s) longer than text.max_sequence_length = "
                f"{self.max_sequence_length} tokens (after the template's) were truncated")

    def settings(self) -> dict:
        """What produced the states (written to cache.json and imagegen.json)."""
        return {"text_encoder": str(self.path.resolve()), "text_kind": self.kind,
                "max_sequence_length": self.max_sequence_length, "text_tokens": self.num_tokens,
                "states_width": self.states_width, "pooled_width": self.pooled_width}


__all__ = ["QwenImageTextEncoder", "TEMPLATE", "DROP", "MAX_TOKENS", "PIPELINE"]
