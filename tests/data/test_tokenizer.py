"""data/tokenizer.py: local BPE training, loading through AutoTokenizer, Qwen-style specials and template."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from atelier_studio.data.chat import DEFAULT_SYSTEM_PROMPT
from atelier_studio.data.tokenizer import (
    CHAT_TEMPLATE,
    TokenizerError,
    iter_corpus_texts,
    load_tokenizer,
    train_tokenizer,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "designer" / "briefs.jsonl"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return train_tokenizer([FIXTURE], vocab_size=400, out_dir=tmp_path_factory.mktemp("tok"))


def test_loads_with_autotokenizer_and_has_qwen_specials(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    assert len(tok) == 400
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    # specials are single tokens even glued to text
    ids = tok("x<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    assert 1 in ids and tok.decode(ids) == "x<|im_start|>user\n"
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE


def test_chat_template_is_chatml(tok_dir):
    tok = load_tokenizer(tok_dir)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n")
    assert tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")


def test_round_trip_is_exact_and_bpe_compresses(tok_dir):
    tok = load_tokenizer(tok_dir)
    for text in ["a small blue circle in the upper left", "  spaces\n\n\ttabs, ünïcödé 🎨 ÅÅ", "x'll 12345"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    corpus_text = "a small blue circle in the upper left on a pale yellow background"
    assert len(tok(corpus_text, add_special_tokens=False)["input_ids"]) < len(corpus_text.encode()) / 2
    # the system prompt is in the BPE training texts, so it is cheap
    assert len(tok(DEFAULT_SYSTEM_PROMPT)["input_ids"]) < len(DEFAULT_SYSTEM_PROMPT) / 2


def test_training_is_deterministic_and_reads_txt(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("red circle\n\nblue square\nred circle on white\n")
    assert list(iter_corpus_texts([txt])) == ["red circle", "blue square", "red circle on white"]
    a = train_tokenizer([txt, FIXTURE], 300, tmp_path / "a")
    b = train_tokenizer([txt, FIXTURE], 300, tmp_path / "b")
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_jsonl_corpus_takes_message_texts(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]})
                 + "\n" + json.dumps({"brief": "b", "caption": "c", "system": "s"}) + "\n")
    assert list(iter_corpus_texts([p])) == ["u1", "a1", "s", "b", "c"]


def test_corpus_of_other_designer_formats(tmp_path):
    import csv

    (tmp_path / "s.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                                     {"from": "gpt", "value": "a red star"}]}) + "\n")
    with open(tmp_path / "a.csv", "w", newline="") as f:
        csv.writer(f).writerows([["instruction", "output"], ["draw", "a blue moon"]])
    texts = list(iter_corpus_texts([tmp_path / "s.jsonl", tmp_path / "a.csv"]))
    assert texts == ["hi", "a red star", DEFAULT_SYSTEM_PROMPT, "draw", "a blue moon"]


def test_bad_inputs(tmp_path):
    with pytest.raises(TokenizerError, match="vocab_size=100"):
        train_tokenizer([FIXTURE], 100, tmp_path / "t")
    with pytest.raises(TokenizerError, match="nope.txt: corpus file not found"):
        train_tokenizer([tmp_path / "nope.txt"], 300, tmp_path / "t")
    bad = tmp_path / "c.bin"
    bad.write_text("a,b\n")
    with pytest.raises(TokenizerError, match=r"c\.bin: corpus files must be \.txt or designer data \(\.jsonl, \.json"):
        train_tokenizer([bad], 300, tmp_path / "t")
    empty = tmp_path / "e.txt"
    empty.write_text("\n\n")
    with pytest.raises(TokenizerError, match="has no text"):
        train_tokenizer([empty], 300, tmp_path / "t")
    with pytest.raises(TokenizerError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "blank").mkdir()
    with pytest.raises(TokenizerError, match="blank: no tokenizer.json"):
        load_tokenizer(tmp_path / "blank")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="broken: could not load tokenizer"):
        load_tokenizer(tmp_path / "broken")
