"""data/clip_score.py on a tiny random CLIP built here (nothing is downloaded): the cosine is CLIP's own forward's,
in any batch size, and the score 100 · max(cosine, 0); bad directories are named.

Tolerance: the scorer and CLIPModel's forward run the same fp32 modules on the same inputs, the forward normalising
the embeddings and multiplying them in one matmul, the scorer through cosine_similarity: a few ulp of a cosine
(< 1e-6).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from atelier_studio.data.clip_score import ClipScorer
from atelier_studio.pipeline.errors import ModelLoadError

TEXTS = ["a small blue circle in the upper left", "a poster for a jazz night, moody blues",
         "a large red square in the center on a pale yellow background"]


def build_clip(out: Path, seed: int = 0) -> Path:
    """A random CLIPModel (32-px images, 77 text positions) with a CLIPProcessor, saved to `out`; idempotent."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from tests.imagegen._sd3 import clip_tokenizer

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    tokenizer = clip_tokenizer()
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4),
        projection_dim=24)
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=tokenizer)
    tmp = out.with_name(out.name + ".tmp")
    CLIPModel(config).save_pretrained(tmp)
    processor.save_pretrained(tmp)
    tmp.rename(out)
    return out


def images(tmp_path: Path, n: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        path = tmp_path / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, size=(40, 48, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_scores_are_clips_own_cosine(tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    clip = build_clip(tmp_path / "clip")
    pics = images(tmp_path, 3)
    scorer = ClipScorer(clip, batch_size=2)  # two batches: 2 + 1
    got = scorer.cosines(pics, TEXTS)
    model, processor = CLIPModel.from_pretrained(clip).eval(), CLIPProcessor.from_pretrained(clip)
    batch = processor(text=TEXTS, images=[Image.open(p).convert("RGB") for p in pics], return_tensors="pt",
                      padding=True)
    with torch.no_grad():
        out = model(**batch)
    want = (out.logits_per_image / model.logit_scale.exp()).diagonal().tolist()  # image i against text i
    assert all(abs(w) > 1e-3 for w in want)  # a real comparison, not of zeros
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # module docstring
    assert scorer.scores(pics, TEXTS) == [100 * max(c, 0.0) for c in got]


def test_bad_clip_directories_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"CLIP directory .*nowhere: no config.json"):
        ClipScorer(tmp_path / "nowhere")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "clip"}')
    with pytest.raises(ModelLoadError, match=r"CLIP directory .*broken"):
        ClipScorer(broken)
    with pytest.raises(ValueError, match="2 images for 3 texts"):
        ClipScorer(build_clip(tmp_path / "clip")).scores(images(tmp_path, 2), TEXTS)
