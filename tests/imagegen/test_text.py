"""Frozen text encoders: the encoder kind (the real MiniLM) and the causal-lm kind (a tiny random Qwen3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atelier_studio.imagegen.text import TextEncoder, TextEncoderError, default_text_encoder_path, pool_ref

CAPTIONS = ["a small blue circle in the upper left on a pale yellow background", "a red square", ""]


@pytest.fixture(scope="module")
def minilm() -> TextEncoder:
    return TextEncoder(None, "encoder", max_length=20, pooled="mean")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3ForCausalLM saved with transformers, plus a locally trained byte-level BPE."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from atelier_studio.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("qwen3")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(CAPTIONS[:2] * 4 + ["a green triangle at the bottom right on white"]) + "\n")
    tok = train_tokenizer([corpus], 300, d / "model")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(tok)
    return tok


def test_encoder_kind_shapes_mask_and_determinism(minilm):
    states, pooled, mask = minilm.encode(CAPTIONS)
    assert states.shape == (3, 20, 384) and pooled.shape == (3, 384) and mask.shape == (3, 20)
    assert minilm.hidden_size == 384
    assert mask[0].sum() > mask[1].sum() > mask[2].sum() > 0  # [CLS] [SEP] remain for ""
    assert mask[1, mask[1].sum():].eq(0).all()  # right padding
    again = minilm.encode(CAPTIONS)
    assert torch.equal(states, again[0]) and torch.equal(pooled, again[1])
    # the reference: transformers' BertModel on the same tokens, and masked mean pooling by hand
    tok = minilm.tokenize(CAPTIONS)
    with torch.no_grad():
        want = minilm.model(**tok).last_hidden_state
    torch.testing.assert_close(states, want)
    m = tok["attention_mask"][1].bool()
    torch.testing.assert_close(pooled[1], want[1][m].mean(0), rtol=1e-5, atol=1e-6)


def test_padding_does_not_change_real_tokens(minilm):
    """A caption alone and in a batch with a longer one: the same states on its real tokens and the same pooled."""
    alone, p_alone, m_alone = minilm.encode([CAPTIONS[1]])
    batch, p_batch, _ = minilm.encode([CAPTIONS[0], CAPTIONS[1]])
    n = int(m_alone.sum())
    torch.testing.assert_close(batch[1, :n], alone[0, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p_batch[1], p_alone[0], rtol=1e-5, atol=1e-5)


def test_truncation_and_empty_caption_cached(minilm):
    long = " ".join(["circle"] * 100)
    states, _, mask = minilm.encode([long])
    assert states.shape[1] == 20 and mask.sum() == 20
    e1, e2 = minilm.empty(), minilm.empty()
    assert e1[0] is e2[0] or e1[0].data_ptr() == e2[0].data_ptr()  # encoded once
    torch.testing.assert_close(e1[0], minilm.encode([""])[0][0])


def test_causal_lm_kind_matches_transformers_hidden_states(qwen_dir):
    from transformers import AutoModelForCausalLM

    enc = TextEncoder(qwen_dir, "causal-lm", max_length=16, layer=-1, pooled="last")
    pen = TextEncoder(qwen_dir, "causal-lm", max_length=16, layer=-2, pooled="mean")
    states, pooled, mask = enc.encode(CAPTIONS[:2])
    assert states.shape == (2, 16, 32) and pooled.shape == (2, 32)
    ref = AutoModelForCausalLM.from_pretrained(qwen_dir, local_files_only=True, dtype=torch.float32).eval()
    tok = enc.tokenize(CAPTIONS[:2])
    with torch.no_grad():
        hs = ref(**tok, output_hidden_states=True).hidden_states
    torch.testing.assert_close(states, hs[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pen.encode(CAPTIONS[:2])[0], hs[-2], rtol=1e-5, atol=1e-5)
    last = int(mask[1].sum()) - 1
    torch.testing.assert_close(pooled[1], states[1, last])
    # causal + right padding: a caption's real tokens are exact whatever it is batched with
    alone, p_alone, m = enc.encode([CAPTIONS[1]])
    n = int(m.sum())
    torch.testing.assert_close(states[1, :n], alone[0, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled[1], p_alone[0], rtol=1e-5, atol=1e-5)


def test_pool_ref_on_random_states():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 4, generator=g)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(pool_ref(s, m, "mean")[0], s[0, :3].mean(0))
    assert torch.equal(pool_ref(s, m, "last")[0], s[0, 2]) and torch.equal(pool_ref(s, m, "cls"), s[:, 0])
    with pytest.raises(TextEncoderError, match="pooled"):
        pool_ref(s, m, "max")


def test_bad_paths_and_settings_are_named(tmp_path):
    with pytest.raises(TextEncoderError, match=str(tmp_path / "nope")):
        TextEncoder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TextEncoderError, match="no config.json"):
        TextEncoder(tmp_path / "empty")
    with pytest.raises(TextEncoderError, match="text.kind"):
        TextEncoder(None, kind="decoder")
    assert (default_text_encoder_path() / "model.safetensors").is_file()
