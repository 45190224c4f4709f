"""Briefs file → captions file, from a model directory or an adapter directory."""

from __future__ import annotations

import json

import pytest
import torch

from atelier_studio.data.chat import DataError, prompt_ids
from atelier_studio.data.tokenizer import load_tokenizer
from atelier_studio.designer.captions import generate_captions, load_designer, read_briefs
from atelier_studio.designer.generate import generate
from atelier_studio.designer.hf import load_pretrained
from atelier_studio.designer.lora import LoraArgs, apply_lora, save_peft_adapter
from atelier_studio.flows.cli import main


def test_read_briefs_plain_and_jsonl(tmp_path):
    f = tmp_path / "b.txt"
    f.write_text("a calm circle\n\n{\"brief\": \"something bold, square\"}\n")
    assert read_briefs(f) == ["a calm circle", "something bold, square"]


@pytest.mark.parametrize("text, where", [("ok\n{bad json\n", ":2: invalid JSON"), ('{"brief": ""}\n', ":1: expected"),
                                         ("\n\n", "no briefs")])
def test_read_briefs_errors_name_the_line(tmp_path, text, where):
    f = tmp_path / "b.txt"
    f.write_text(text)
    with pytest.raises(DataError, match=where):
        read_briefs(f)


def test_model_dir_and_adapter_dir_give_the_captions_of_generate(world, tmp_path):
    briefs = tmp_path / "briefs.txt"
    briefs.write_text("a calm circle\nsomething bold with a square, top left\n")
    tok = load_tokenizer(world / "model")
    # an adapter with non-zero B so it changes the output
    model = load_pretrained(world / "model")
    args = LoraArgs(rank=4, alpha=8.0, dropout=0.0, targets=("q", "v", "down"), rslora=False, dtype="float32")
    apply_lora(model, args)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    save_peft_adapter(model, args, tmp_path / "adapter", base_model_path=str(world / "model"))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    expected = generate(model.eval(), tok, [prompt_ids(tok, b) for b in read_briefs(briefs)], max_new_tokens=12,
                        eos_token_id=eos)
    rows = generate_captions(tmp_path / "adapter", None, briefs, tmp_path / "out.jsonl", max_new_tokens=12)
    assert [r["caption"] for r in rows] == [tok.decode(ids, skip_special_tokens=True).strip() for ids in expected]
    assert [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()] == rows
    base_rows = generate_captions(world / "model", None, briefs, tmp_path / "base.jsonl", max_new_tokens=12)
    assert base_rows != rows  # the adapter was applied
    assert main(["designer", "generate", "--model", str(world / "model"), "--adapter", str(tmp_path / "adapter"),
                 "--briefs", str(briefs), "--out", str(tmp_path / "cli.jsonl"), "--max-new-tokens", "12"]) == 0
    assert [json.loads(l) for l in (tmp_path / "cli.jsonl").read_text().splitlines()] == rows


def test_adapter_with_missing_base_is_named(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/no/such"}))
    with pytest.raises(FileNotFoundError, match="/no/such"):
        load_designer(tmp_path / "adapter", torch.device("cpu"))
