"""SD3's three text encoders (imagegen/sd3_text.py) against diffusers' StableDiffusion3Pipeline.encode_prompt, on a
tiny random pipeline built here (tests/imagegen/test_sd3_pipeline.py checks what `imagegen cache` stores from it).

Equality is exact where both sides run the same transformers modules on the same token ids in the same batch
(Atelier calls the pipeline's own CLIP and T5 models; the join is a concat and a zero pad, which round nothing).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from atelier_studio.imagegen.sd3_text import SD3TextEncoders
from atelier_studio.imagegen.text import TextEncoderError

from tests.imagegen._sd3 import (
    CLIP_G,
    CLIP_L,
    MAX_SEQUENCE_LENGTH,
    POOLED,
    T5_WIDTH,
    WORDS,
    build_pipeline,
    load_pipeline,
)


def random_captions(n: int, seed: int, lengths=(1, 12)) -> list[str]:
    """Fresh random captions of known and unknown words (unknown ones tokenize into letters)."""
    rng = random.Random(seed)
    pool = [*WORDS, "zebra", "quixotic", "mauve"]
    return [" ".join(rng.choice(pool) for _ in range(rng.randint(*lengths))) for _ in range(n)]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    return build_pipeline(tmp_path_factory.getbasetemp() / "sd3-pipe")


@pytest.fixture(scope="module")
def pipe(pipe_dir):
    return load_pipeline(pipe_dir)


def _diffusers(pipe, captions, **kw):
    with torch.no_grad():
        states, neg, pooled, neg_pooled = pipe.encode_prompt(captions, None, None, device="cpu", **kw)
    return states, pooled, neg, neg_pooled


def test_states_and_pooled_equal_encode_prompt(pipe_dir, pipe):
    # 3 short captions, one of 100 words (past CLIP's 77 tokens and T5's 16): truncation on both sides
    captions = random_captions(3, seed=1) + [" ".join(random_captions(100, seed=2, lengths=(1, 1)))]
    enc = SD3TextEncoders(pipe_dir, max_sequence_length=MAX_SEQUENCE_LENGTH)
    states, pooled, mask = enc.encode(captions)
    want_states, want_pooled, want_neg, want_neg_pooled = _diffusers(pipe, captions,
                                                                     max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert states.shape == (4, 77 + MAX_SEQUENCE_LENGTH, T5_WIDTH) and pooled.shape == (4, POOLED)
    torch.testing.assert_close(states, want_states, rtol=0, atol=0)  # same modules, same ids, same batch
    torch.testing.assert_close(pooled, want_pooled, rtol=0, atol=0)
    assert states[:, :77, CLIP_L + CLIP_G:].abs().max() == 0  # encode_prompt's zero padding of the CLIP part
    assert states[:, 77:].abs().max() > 0  # T5's part is there
    # the negative: diffusers encodes B copies of "", Atelier one; a projection matmul of another batch size may
    # round differently in fp32 (a few ulp of values ~1: 1e-6)
    neg_states, neg_pooled = enc.negative()
    torch.testing.assert_close(neg_states.expand(4, -1, -1), want_neg, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(neg_pooled.expand(4, -1), want_neg_pooled, rtol=1e-5, atol=1e-6)
    assert mask.shape == (4, 77 + MAX_SEQUENCE_LENGTH) and mask[3].all() and not mask[0].all()
    assert enc.truncated == {"clip": 1, "t5": 1}  # the long caption, once for the CLIPs and once for T5
    assert (enc.states_width, enc.pooled_width, enc.num_tokens) == (T5_WIDTH, POOLED, 77 + MAX_SEQUENCE_LENGTH)
    parts = {p.name: p for p in enc.parts}
    assert (parts["clip_g"].cols, parts["clip_g"].pooled_cols) == (slice(CLIP_L, CLIP_L + CLIP_G),
                                                                   slice(CLIP_L, POOLED))
    assert parts["t5"].rows == slice(77, 77 + MAX_SEQUENCE_LENGTH) and parts["t5"].pooled_cols is None


def test_default_is_diffusers_333_tokens_and_clip_skip_matches(pipe_dir, pipe):
    captions = random_captions(2, seed=3)
    enc = SD3TextEncoders(pipe_dir)  # max_sequence_length 256 as diffusers: 77 + 256 = 333 text tokens
    states, pooled, _ = enc.encode(captions)
    want_states, want_pooled, _, _ = _diffusers(pipe, captions)
    assert states.shape[1] == 333
    torch.testing.assert_close(states, want_states, rtol=0, atol=0)
    torch.testing.assert_close(pooled, want_pooled, rtol=0, atol=0)
    skip = SD3TextEncoders(pipe_dir, max_sequence_length=MAX_SEQUENCE_LENGTH, clip_skip=1)
    states, pooled, _ = skip.encode(captions)
    want_states, want_pooled, want_neg, _ = _diffusers(pipe, captions, clip_skip=1,
                                                       max_sequence_length=MAX_SEQUENCE_LENGTH)
    torch.testing.assert_close(states, want_states, rtol=0, atol=0)
    torch.testing.assert_close(pooled, want_pooled, rtol=0, atol=0)
    # diffusers encodes its negative prompt at the penultimate layer whatever clip_skip is; so does negative()
    torch.testing.assert_close(skip.negative()[0].expand(2, -1, -1), want_neg, rtol=1e-5, atol=1e-6)  # batch 1 vs 2
    assert not torch.equal(skip.empty()[0], skip.negative()[0])  # caption dropout's "" does take clip_skip


def test_without_t5_equals_the_t5_less_pipeline(pipe_dir, pipe):
    from diffusers import StableDiffusion3Pipeline

    no_t5 = StableDiffusion3Pipeline(**{**pipe.components, "text_encoder_3": None, "tokenizer_3": None})
    captions = random_captions(3, seed=4)
    enc = SD3TextEncoders(pipe_dir, max_sequence_length=MAX_SEQUENCE_LENGTH, use_t5=False)
    assert enc.t5 is None  # never loaded
    states, pooled, mask = enc.encode(captions)
    want_states, want_pooled, _, _ = _diffusers(no_t5, captions, max_sequence_length=MAX_SEQUENCE_LENGTH)
    torch.testing.assert_close(states, want_states, rtol=0, atol=0)
    torch.testing.assert_close(pooled, want_pooled, rtol=0, atol=0)
    assert states[:, 77:].abs().max() == 0 and mask[:, 77:].sum() == 0


def test_bad_pipeline_directories_are_named(pipe_dir, tmp_path):
    import shutil

    from atelier_studio.pipeline.errors import AtelierError

    with pytest.raises(TextEncoderError, match="not found"):
        SD3TextEncoders(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AtelierError, match="model_index.json"):
        SD3TextEncoders(tmp_path / "empty")
    copy = tmp_path / "no-t5"
    shutil.copytree(pipe_dir, copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["text_encoder_3"] = [None, None]
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(TextEncoderError, match="no text_encoder_3.*text.use_t5 = false"):
        SD3TextEncoders(copy)
    shutil.rmtree(copy / "text_encoder_2")
    with pytest.raises(AtelierError, match="text_encoder_2: missing"):
        SD3TextEncoders(copy, use_t5=False)
    index["_class_name"] = "FluxPipeline"
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(AtelierError, match="_class_name is 'FluxPipeline'"):
        SD3TextEncoders(copy, use_t5=False)
    with pytest.raises(TextEncoderError, match="max_sequence_length"):
        SD3TextEncoders(pipe_dir, max_sequence_length=513)
    with pytest.raises(TextEncoderError, match="text.clip_skip = 2: .*text_encoder_2 has 2 layers"):
        SD3TextEncoders(pipe_dir, clip_skip=2, use_t5=False)
