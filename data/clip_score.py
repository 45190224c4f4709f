"""CLIP score: how well an image matches a text, from a local transformers CLIP directory (nothing is downloaded).

    score(image, text) = 100 · max(cos(E_img(image), E_txt(text)), 0)

with E_img / E_txt CLIP's projected image and text embeddings (CLIPModel.get_image_features / get_text_features),
the convention of torchmetrics' CLIPScore (Hessel et al. 2021, "CLIPScore", arXiv:2104.08718, use the same cosine
scaled by 2.5). Texts longer than CLIP's 77 tokens are truncated, as CLIP was trained. The directory is anything
`CLIPModel.from_pretrained` and `CLIPProcessor.from_pretrained` read (e.g. a local copy of
openai/clip-vit-large-patch14); the evaluation flow (flows/evaluate.py) scores briefs outside the shapes world with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.hf_files import check_tokenizer_dir, check_vocab_size, check_weights_dir


class ClipScorer:
    """A CLIP model and its processor, loaded once; `scores(images, texts)` for pairs."""

    def __init__(self, path: str | os.PathLike, device: str | torch.device = "cpu", batch_size: int = 32):
        from transformers import CLIPModel, CLIPProcessor

        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ModelLoadError(f"CLIP directory {self.path}: no config.json (a local transformers CLIP directory: "
                                 f"CLIPModel + CLIPProcessor files)")
        check_weights_dir(self.path, "CLIP directory")
        check_tokenizer_dir(self.path, "clip")
        try:
            self.model = CLIPModel.from_pretrained(self.path, local_files_only=True, use_safetensors=True)
            self.model = self.model.to(device).eval()
            self.processor = CLIPProcessor.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"CLIP directory {self.path}: {str(e).splitlines()[0]}") from None
        check_vocab_size(self.processor.tokenizer, self.path, int(self.model.config.text_config.vocab_size), self.path)
        self.device, self.batch_size = torch.device(device), batch_size

    def scores(self, images: Sequence[str | os.PathLike], texts: Sequence[str]) -> list[float]:
        """CLIP score, 100 · max(cosine, 0), of each (image file, text) pair, in order."""
        return [100.0 * max(c, 0.0) for c in self.cosines(images, texts)]

    @torch.no_grad()
    def cosines(self, images: Sequence[str | os.PathLike], texts: Sequence[str]) -> list[float]:
        """The cosine of CLIP's image and text embeddings of each (image file, text) pair, in order."""
        from PIL import Image

        if len(images) != len(texts):
            raise ValueError(f"ClipScorer: {len(images)} images for {len(texts)} texts")
        out: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            pictures = []
            for p in images[i:i + self.batch_size]:
                with Image.open(p) as im:
                    pictures.append(im.convert("RGB"))
            batch = self.processor(text=list(texts[i:i + self.batch_size]), images=pictures, return_tensors="pt",
                                   padding=True, truncation=True, max_length=self.max_length)
            batch = {k: v.to(self.device) for k, v in batch.items()}
            img = _features(self.model.get_image_features(pixel_values=batch["pixel_values"]))  # [b, P]
            txt = _features(self.model.get_text_features(input_ids=batch["input_ids"],
                                                         attention_mask=batch["attention_mask"]))  # [b, P]
            out += torch.nn.functional.cosine_similarity(img.float(), txt.float(), dim=-1).tolist()  # [b]
        return out

    @property
    def max_length(self) -> int:
        return self.model.config.text_config.max_position_embeddings


def _features(x) -> torch.Tensor:
    """get_*_features' projected embeddings (a tensor, or in newer transformers an output holding them)."""
    return x if isinstance(x, torch.Tensor) else x.pooler_output


__all__ = ["ClipScorer"]
