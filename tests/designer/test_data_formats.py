"""Designer training through the CLI on data in other formats (data/chat_formats.py): a ShareGPT parquet file and a
CSV with mapped columns train, the log states what each file was read as; a file of no known format is exit 2."""
from __future__ import annotations

import json

from atelier_studio.flows.cli import main

from tests.data.test_chat_formats import write
from tests.designer.test_train import FIXTURE, train_args, train_losses


def fixture_pairs() -> list[tuple[str, str]]:
    return [(r["brief"], r["caption"]) for r in map(json.loads, FIXTURE.read_text().splitlines()) if "brief" in r]


def test_sharegpt_parquet_and_a_mapped_csv_train(world, tmp_path, capsys):
    pairs = fixture_pairs()
    train = write(tmp_path / "train.parquet", [{"conversations": [{"from": "human", "value": b},
                                                                   {"from": "gpt", "value": c}]} for b, c in pairs])
    evals = write(tmp_path / "eval.csv", [{"question": b, "answer": c} for b, c in pairs[:4]])
    out = tmp_path / "run"
    assert main(train_args(world, out, "--set", f"data.train={train}", "--set", f"data.eval={evals}",
                           "--set", "data.columns.brief=question", "--set", "data.columns.caption=answer",
                           "--set", "lora.rank=4", "--set", "train.max_steps=2", "--set", "train.eval_every=2")) == 0
    assert [s for s, _ in train_losses(out)] == [1, 2]
    log = capsys.readouterr()
    text = log.out + log.err
    assert f"data {train}: {len(pairs)} examples read as sharegpt (detected from its columns" in text, text[-2000:]
    assert f"data {evals}: 4 examples read as brief_caption (detected" in text


def test_a_folder_of_every_format_trains(world, tmp_path, capsys):
    """Alpaca JSON, prompt/completion JSONL, an OpenAI messages parquet and a saved dataset of brief/caption rows, in
    one folder: each read in its own format, all trained on."""
    import datasets

    pairs = fixture_pairs()
    quarter = len(pairs) // 4
    parts = [pairs[i * quarter:(i + 1) * quarter] for i in range(4)]
    data = tmp_path / "data"
    (data / "more").mkdir(parents=True)
    write(data / "a.json", [{"instruction": b, "input": "", "output": c} for b, c in parts[0]])
    write(data / "b.jsonl", [{"prompt": b, "completion": c} for b, c in parts[1]])
    write(data / "more" / "c.parquet", [{"messages": [{"role": "user", "content": b},
                                                      {"role": "assistant", "content": c}]} for b, c in parts[2]])
    datasets.Dataset.from_list([{"brief": b, "caption": c} for b, c in parts[3]]).save_to_disk(str(data / "saved"))
    out = tmp_path / "run"
    assert main(train_args(world, out, "--set", f"data.train={data}", "--set", "lora.rank=4",
                           "--set", "train.max_steps=2")) == 0
    assert [s for s, _ in train_losses(out)] == [1, 2]
    text = capsys.readouterr().out
    for name, fmt in (("a.json", "alpaca"), ("b.jsonl", "prompt_completion"), ("more/c.parquet", "messages"),
                      ("saved", "brief_caption")):
        assert f"data {data / name}: {quarter} examples read as {fmt}" in text, text[-3000:]


def test_a_file_of_no_known_format_is_one_line(world, tmp_path, capsys):
    train = write(tmp_path / "t.csv", [{"question": "q", "answer": "a"}])
    assert main(train_args(world, tmp_path / "run", "--set", f"data.train={train}", "--set", "lora.rank=4")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"atelier: error: {train} row 1: no known format in the columns "
                                               f"(answer, question)"), err
    assert "data.columns.<field>" in err[0]
