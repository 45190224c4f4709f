"""Generation: KV-cache batched greedy == no-cache recompute == transformers' generate; sampling contracts."""
from __future__ import annotations

import pytest
import torch

from atelier_studio.designer.generate import generate, generate_greedy_ref
from atelier_studio.designer.hf import load_pretrained

from tests.designer.test_model import load_hf, make_model_dir

V = 113
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_model_dir(tmp_path_factory.mktemp("gen"), V, seed=11, tie_embeddings=False)
    return path


def _prompts():
    g = torch.Generator().manual_seed(12)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 1, 12, 8, 3)]


def test_greedy_batched_cache_equals_recompute_and_transformers(model_dir):
    model = load_pretrained(model_dir).eval()
    prompts = _prompts()
    # batch_size 3 with 5 prompts: two batches of different widths, left padding in both
    got = generate(model, None, prompts, max_new_tokens=14, temperature=0.0, eos_token_id=EOS, batch_size=3)
    hf = load_hf(model_dir)
    for p, out in zip(prompts, got):
        assert out == generate_greedy_ref(model, p, 14, eos_token_id=EOS)
        seq = hf.generate(torch.tensor([p]), max_new_tokens=14, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        new = seq[0, len(p):].tolist()
        assert out == (new[: new.index(EOS)] if EOS in new else new)
    assert any(len(o) == 14 for o in got)  # not everything stopped at once


def test_eos_stops_and_is_excluded(model_dir):
    model = load_pretrained(model_dir).eval()
    prompt = _prompts()[2]
    free = generate(model, None, [prompt], max_new_tokens=10, eos_token_id=[])[0]
    stop_at = free[4]
    out = generate(model, None, [prompt], max_new_tokens=10, eos_token_id=[stop_at, 10_000])[0]
    assert out == free[: free.index(stop_at)]


def test_sampling_is_seeded_and_top_p_limits(model_dir):
    model = load_pretrained(model_dir).eval()
    prompts = _prompts()
    a = generate(model, None, prompts, max_new_tokens=9, temperature=1.5, top_p=0.95, seed=7, eos_token_id=None)
    b = generate(model, None, prompts, max_new_tokens=9, temperature=1.5, top_p=0.95, seed=7, eos_token_id=None)
    c = generate(model, None, prompts, max_new_tokens=9, temperature=1.5, top_p=0.95, seed=8, eos_token_id=None)
    assert a == b and a != c
    # a nucleus smaller than any single token keeps only the most likely one: greedy
    tiny_p = generate(model, None, prompts, max_new_tokens=9, temperature=1.0, top_p=1e-9, seed=1, eos_token_id=None)
    assert tiny_p == generate(model, None, prompts, max_new_tokens=9, temperature=0.0, eos_token_id=None)


def test_string_prompts_and_bad_input(tmp_path):
    from atelier_studio.designer.hf import init_random

    from tests.designer.test_model import make_tokenizer_dir

    tok_dir = make_tokenizer_dir(tmp_path)
    path = init_random("tiny", tok_dir, tmp_path / "m", seed=0, dtype=torch.float32)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = load_pretrained(path).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "a calm poster"}], tokenize=False,
                                   add_generation_prompt=True)
    by_text = generate(model, tok, [text], max_new_tokens=6)
    by_ids = generate(model, tok, [tok.encode(text, add_special_tokens=False)], max_new_tokens=6)
    assert by_text == by_ids and all(t < len(tok) for t in by_text[0])
    with pytest.raises(ValueError, match="prompt 0 is a string"):
        generate(model, None, ["hello"], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, tok, [[3], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, tok, [[3] * 10], max_new_tokens=model.args.max_seq_len)
