"""Caption dropout (imagegen/caption_dropout.py) against an element-by-element reference, and in the trainer on a tiny
SD3 pipeline: the default replaces a dropped caption by diffusers' encoding of the empty prompt (the scripts' "");
"zero" zeroes it; "independent" drops CLIP-L, CLIP-G and T5 each on its own draw.

Comparisons are exact: dropout only selects between stored tensors (no arithmetic), except where Atelier's empty
caption is compared with diffusers' encode_prompt(""), a batch of 1 on both sides through the same modules.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from atelier_studio.imagegen.caption_dropout import drop_captions, drop_mask
from atelier_studio.imagegen.text import TextPart

from tests.imagegen._sd3 import MAX_SEQUENCE_LENGTH, SD3_CONFIG, build_pipeline, build_shards, config_overrides

# SD3's layout at small widths: CLIP-L 3 columns, CLIP-G 2, padded to 6; 2 CLIP rows, then 3 T5 rows
PARTS = (TextPart("clip_l", slice(0, 2), slice(0, 3), slice(0, 3)),
         TextPart("clip_g", slice(0, 2), slice(3, 5), slice(3, 5)),
         TextPart("t5", slice(2, 5), slice(0, 6), None))


def _sd3_like(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    states = torch.randn(batch, 5, 6, generator=gen)
    states[:, :2, 5:] = 0  # encode_prompt's zero padding of the CLIP rows
    return states, torch.randn(batch, 5, generator=gen)


def _reference(states, pooled, drop, empty_states, empty_pooled):
    """Element by element: which encoder made entry (l, e) of the states, and entry j of the pooled vector."""
    out_s, out_p = states.clone(), pooled.clone()
    for b in range(states.shape[0]):
        for k, part in enumerate(PARTS):
            if not drop[b, k]:
                continue
            for i in range(part.rows.start, part.rows.stop):
                for e in range(part.cols.start, part.cols.stop):
                    out_s[b, i, e] = 0.0 if empty_states is None else empty_states[i, e]
            if part.pooled_cols is not None:
                for j in range(part.pooled_cols.start, part.pooled_cols.stop):
                    out_p[b, j] = 0.0 if empty_pooled is None else empty_pooled[j]
    return out_s, out_p


@pytest.mark.parametrize("fill", ["empty", "zero"])
def test_drop_captions_equals_the_elementwise_reference(fill):
    g = torch.Generator().manual_seed(0)
    states, pooled = _sd3_like(6, g)
    empty_states, empty_pooled = _sd3_like(1, g)
    empty_states, empty_pooled = (empty_states[0], empty_pooled[0]) if fill == "empty" else (None, None)
    drop = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 1]], dtype=torch.bool)
    got = drop_captions(states, pooled, drop, PARTS, empty_states, empty_pooled)
    want = _reference(states, pooled, drop, empty_states, empty_pooled)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][1], states[1]) and torch.equal(got[1][1], pooled[1])  # nothing dropped: unchanged
    if fill == "empty":  # every part dropped: the empty caption's encoding, whole
        assert torch.equal(got[0][0], empty_states) and torch.equal(got[1][0], empty_pooled)
    else:
        assert got[0][0].abs().max() == 0 and got[1][0].abs().max() == 0


def test_drop_mask_joint_and_independent():
    g = torch.Generator().manual_seed(1)
    joint = drop_mask(torch.rand(10_000, generator=g), 0.1, "joint", 3)
    assert joint.shape == (10_000, 3) and torch.equal(joint, joint[:, :1].expand(-1, 3))  # all parts at once
    assert abs(joint[:, 0].float().mean().item() - 0.1) < 0.01  # binomial sd 0.003
    indep = drop_mask(torch.rand(10_000, 3, generator=g), 0.3, "independent", 3)
    rates = indep.float().mean(0)
    assert ((rates - 0.3).abs() < 0.02).all()  # sd 0.0046
    both = (indep[:, 0] & indep[:, 2]).float().mean().item()
    assert abs(both - 0.09) < 0.01  # independent draws: 0.3 x 0.3
    with pytest.raises(ValueError, match="independent dropout takes"):
        drop_mask(torch.rand(4), 0.3, "independent", 3)


@pytest.fixture(scope="module")
def sd3_latents(tmp_path_factory):
    from atelier_studio.imagegen.cache import cache_latents
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.pipeline.config import load_config

    base = tmp_path_factory.getbasetemp()
    pipe = build_pipeline(base / "sd3-pipe")
    shards = build_shards(base / "sd3-world")
    latents = tmp_path_factory.mktemp("dropout") / "latents"
    cfg = load_config(ImagegenConfig, SD3_CONFIG, config_overrides(pipe, shards, latents, latents.parent / "run"))
    cache_latents(cfg, latents, shard_size=100)
    return cfg


def _states_seen(cfg, **text):
    """The task's first training batch, the text states and pooled vectors its model call receives, the drop mask."""
    from atelier_studio.imagegen.task import ImagegenTask

    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, **text))
    task = ImagegenTask(cfg, torch.device("cpu"))
    seen = {}

    def capture(b, t, noise, states, pooled):
        seen["states"], seen["pooled"] = states, pooled
        return torch.zeros(b.size)

    task._losses = capture
    batch = next(iter(task.train_batches()))
    task.loss_sum(batch)
    return task, batch, seen["states"], seen["pooled"], task._draws(batch)[2]


def test_the_default_drops_to_diffusers_empty_prompt(sd3_latents):
    from tests.imagegen._sd3 import load_pipeline

    task, batch, states, pooled, drop = _states_seen(sd3_latents, caption_dropout=0.5)
    assert drop.shape == (4, 3) and 0 < drop[:, 0].sum() < 4  # the seed drops some captions, not all
    with torch.no_grad():
        want, _, want_pooled, _ = load_pipeline(sd3_latents.model.path).encode_prompt(
            "", None, None, device="cpu", do_classifier_free_guidance=False, max_sequence_length=MAX_SEQUENCE_LENGTH)
    for b in range(4):
        if drop[b, 0]:  # every encoder together: the empty prompt, as encode_prompt("") gives it
            torch.testing.assert_close(states[b], want[0], rtol=0, atol=0)
            torch.testing.assert_close(pooled[b], want_pooled[0], rtol=0, atol=0)
        else:
            assert torch.equal(states[b], batch.text_states[b]) and torch.equal(pooled[b], batch.pooled[b])


def test_zero_fill_and_independent_encoders(sd3_latents):
    _, batch, states, pooled, drop = _states_seen(sd3_latents, caption_dropout=0.5, caption_dropout_fill="zero")
    for b in range(4):
        if drop[b, 0]:
            assert states[b].abs().max() == 0 and pooled[b].abs().max() == 0
        else:
            assert torch.equal(states[b], batch.text_states[b])
    task, batch, states, pooled, drop = _states_seen(sd3_latents, caption_dropout=0.5,
                                                     caption_dropout_encoders="independent")
    assert drop.shape == (4, 3) and not torch.equal(drop, drop[:, :1].expand(-1, 3))  # parts dropped apart
    empty_states, empty_pooled = task.empty_states, task.empty_pooled
    for b in range(4):
        for k, part in enumerate(task.text.parts):
            src_s = empty_states if drop[b, k] else batch.text_states[b]
            assert torch.equal(states[b, part.rows, part.cols], src_s[part.rows, part.cols]), (b, part.name)
            if part.pooled_cols is not None:
                src_p = empty_pooled if drop[b, k] else batch.pooled[b]
                assert torch.equal(pooled[b, part.pooled_cols], src_p[part.pooled_cols]), (b, part.name)
