"""Designer training data in the shapes the ecosystem uses -> `Example`s (data/chat.py), one format per file.

Files: JSONL (read line by line by data/textfile.py, so errors name `file:line`), and JSON / CSV / Parquet files,
`datasets` folders written by `save_to_disk`, and folders of such files, all read through Hugging Face `datasets`
(errors name `file row N`). A folder of files is read file by file, sorted, each with its own format. A hub
dataset id (`org/name`, `org/name@revision`) that is no local path is its snapshot in the local Hugging Face cache
(pipeline/hub.py; offline, nothing is downloaded).

Formats (the fields each reads; `?` optional):

    brief_caption      brief, caption, system?            the designer's own form
    messages           messages: [{role, content}, ...]   OpenAI chat; every assistant turn is a target
    sharegpt           conversations: [{from, value}]     from: system | human/user | gpt/assistant/model
    alpaca             instruction, input?, output, system?
    prompt_completion  prompt, completion, system?        TRL's form: strings, or lists of {role, content}

Preference pairs (train.objective = "dpo"; data/chat.py PreferencePair), one prompt answered two ways:

    brief_pair         brief, chosen, rejected, system?   the designer's own form
    preference         prompt, chosen, rejected, system?  TRL's: strings, or lists of {role, content} (the prompt
                                                          system/user turns, chosen and rejected one assistant turn)
    sharegpt_pair      conversations, chosen, rejected    LLaMA-Factory's: chosen/rejected a {from, value} object

A single-turn format (alpaca, prompt_completion with strings) is a brief/caption pair: the user turn is the brief
(alpaca: the instruction, then a blank line and the input when there is one), the assistant turn the caption, and
the system prompt `DEFAULT_SYSTEM_PROMPT` unless the record has one, as for brief/caption lines, so that
`atelier designer generate` conditions the model on what it was trained on. The loss covers the assistant turns
(the completion, the output) and nothing else; a conversational prompt holding an assistant turn is refused, since
its tokens would be trained on too.

`columns` maps a format's field to the file's column (`{"brief": "question"}`); `fmt = "auto"` picks the one format
whose required fields the file's columns (JSONL: the first record's keys) hold, and says which it chose. brief/caption
and messages lines may be mixed in one JSONL file, as they always could.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from atelier_studio.data.chat import (
    DEFAULT_SYSTEM_PROMPT,
    Example,
    Message,
    PreferencePair,
    _check_text,
    make_pair,
    parse_brief_pair,
    parse_example,
)
from atelier_studio.data.textfile import iter_json_lines
from atelier_studio.pipeline.errors import DataError
from atelier_studio.pipeline.hub import resolve_dataset_path

FORMATS = ("auto", "brief_caption", "messages", "prompt_completion", "sharegpt", "alpaca", "brief_pair", "preference",
           "sharegpt_pair")
PAIR_FORMATS = ("brief_pair", "preference", "sharegpt_pair")
# the fields a format needs, then the optional ones; `columns` may rename any of them
REQUIRED = {"brief_caption": ("brief", "caption"), "messages": ("messages",), "sharegpt": ("conversations",),
            "alpaca": ("instruction", "output"), "prompt_completion": ("prompt", "completion"),
            "brief_pair": ("brief", "chosen", "rejected"), "preference": ("prompt", "chosen", "rejected"),
            "sharegpt_pair": ("conversations", "chosen", "rejected")}
OPTIONAL = {"brief_caption": ("system",), "messages": (), "sharegpt": ("system",), "alpaca": ("input", "system"),
            "prompt_completion": ("system",), "brief_pair": ("system",), "preference": ("system",),
            "sharegpt_pair": ("system",)}
FIELDS = tuple(dict.fromkeys(f for fmt in REQUIRED for f in REQUIRED[fmt] + OPTIONAL[fmt]))
DATASETS_SUFFIXES = {".json": "json", ".csv": "csv", ".parquet": "parquet"}
SUFFIXES = (".jsonl", *DATASETS_SUFFIXES)
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "chatgpt": "assistant"}
_FIX = 'set data.format to one of ' + ", ".join(FORMATS[1:]) + ', and data.columns.<field> = "<column>" to map names'


@dataclass(frozen=True)
class FileFormat:
    """What one file of a data set was read as: for the log line that states the detection."""

    path: str
    format: str
    detected: bool  # True when data.format = "auto" chose it
    examples: int


# ----------------------------------------------------------------------------------------------------------------------
# Records: (where, dict) from each kind of file


def _datasets_error(path: Path, e: Exception) -> DataError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return DataError(f"{path}: cannot be read as a data file ({first}); check that the file is complete and of the "
                     f"kind its name says ({', '.join(SUFFIXES)}), or a `datasets` folder written by save_to_disk")


def _iter_datasets_file(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    # streaming reads the file as it is, with no Arrow copy in the user's cache
    with tempfile.TemporaryDirectory(prefix="atelier-datasets-") as cache:
        try:
            ds = datasets.load_dataset(DATASETS_SUFFIXES[path.suffix], data_files=str(path), split="train",
                                       streaming=True, cache_dir=cache)
            for i, row in enumerate(ds):
                yield f"{path} row {i + 1}", row
        except DataError:
            raise
        except Exception as e:  # datasets and pyarrow raise many kinds for one cause: a file that is not what it says
            raise _datasets_error(path, e) from None


def _iter_saved_dataset(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise _datasets_error(path, e) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(ds)}); point "
                            f"data.train / data.eval at the split's folder, e.g. {path / next(iter(ds))}")
        ds = ds["train"]
    for i, row in enumerate(ds):
        yield f"{path} row {i + 1}", row


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def data_files(path: Path) -> list[Path]:
    """The files or saved datasets `path` stands for: itself, or a folder's data files, recursively, sorted."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if path.is_file() or is_saved_dataset(path):
        if path.is_file() and path.suffix not in SUFFIXES:
            raise DataError(f"{path}: unknown data file kind {path.suffix or '(no suffix)'!r}; give a "
                            f"{', '.join(SUFFIXES)} file, a folder of them, or a `datasets` save_to_disk folder")
        return [path]
    found = []
    for root, dirs, files in os.walk(path):  # a saved dataset inside the folder is one unit, its own files not data
        here = Path(root)
        saved = sorted(d for d in dirs if is_saved_dataset(here / d))
        dirs[:] = [d for d in dirs if d not in saved]
        found += [here / d for d in saved] + [here / f for f in files if Path(f).suffix in SUFFIXES]
    found.sort()
    if not found:
        raise DataError(f"{path}: a folder with no data files ({', '.join(SUFFIXES)}) and no `datasets` save_to_disk "
                        f"folder (state.json)")
    return found


def iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    if path.is_dir():
        return _iter_saved_dataset(path)
    if path.suffix == ".jsonl":
        return iter_json_lines(path)
    return _iter_datasets_file(path)


# ----------------------------------------------------------------------------------------------------------------------
# Detection and column mapping


def _rename(record: dict, columns: Mapping[str, str]) -> dict:
    """The record with the user's columns under the format's field names; None values count as absent."""
    out = {k: v for k, v in record.items() if v is not None and k not in columns.values()}
    out.update({field: record[col] for field, col in columns.items() if record.get(col) is not None})
    return out


def detect_format(keys: set[str], where: str) -> str:
    """The one format whose required fields are all in ``keys``; brief/caption and messages together are the
    native form (each line then says which it is)."""
    full = [fmt for fmt, req in REQUIRED.items() if set(req) <= keys]
    if set(full) == {"brief_caption", "messages"}:
        full = ["brief_caption"]  # parse_example refuses a line with both, naming it
    if "sharegpt_pair" in full:
        full.remove("sharegpt")  # conversations + chosen + rejected: the pair form
    if len(full) == 1:
        return full[0]
    seen = ", ".join(sorted(keys)) or "none"
    if len(full) > 1:
        raise DataError(f"{where}: the columns ({seen}) fit the formats {' and '.join(full)}; {_FIX}")
    partial = [fmt for fmt, req in REQUIRED.items() if set(req) & keys]
    if keys & {"chosen", "rejected"}:  # a pair with a field missing: name the pair format's field
        partial = [fmt for fmt in partial if fmt in PAIR_FORMATS] or partial
    if partial:
        fmt = partial[0]
        missing = [f for f in REQUIRED[fmt] if f not in keys]
        if fmt in ("brief_caption", "messages"):
            return "brief_caption"  # parse_example names the missing field, as it always did
        raise DataError(f"{where}: looks like {fmt} but has no column {missing[0]!r} (columns: {seen}); rename it, or "
                        f'set data.columns.{missing[0]} = "<your column>"')
    raise DataError(f"{where}: no known format in the columns ({seen}); expected brief+caption, messages, "
                    f"conversations (ShareGPT), instruction+output (Alpaca), prompt+completion, or a preference "
                    f"pair (brief or prompt or conversations, with chosen+rejected); {_FIX}")


# ----------------------------------------------------------------------------------------------------------------------
# One record of each format -> Example


def _sharegpt(rec: dict, where: str) -> Example:
    turns = rec.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects")
    messages = [{"role": "system", "content": rec["system"]}] if "system" in rec else []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise DataError(f"{where}: conversations[{i}] must be an object with 'from' and 'value'")
        if t["from"] not in SHAREGPT_ROLES:
            raise DataError(f"{where}: conversations[{i}]: unknown 'from' {t['from']!r} (expected one of "
                            f"{', '.join(SHAREGPT_ROLES)})")
        messages.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
    return parse_example({"messages": messages}, where)


def _single_turn(rec: dict, where: str, user: str, assistant: str, fields: tuple[str, str]) -> Example:
    system = _check_text(rec["system"], "system", where) if "system" in rec else DEFAULT_SYSTEM_PROMPT
    return Example.from_brief(_check_text(user, fields[0], where), _check_text(assistant, fields[1], where), system,
                              where)


def _alpaca(rec: dict, where: str) -> Example:
    for key in REQUIRED["alpaca"]:
        if key not in rec:
            raise DataError(f"{where}: missing field {key!r}")
    instruction = _check_text(rec["instruction"], "instruction", where)
    extra = rec.get("input", "")
    if not isinstance(extra, str):
        raise DataError(f"{where}: input must be a string, got {type(extra).__name__}")
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return _single_turn(rec, where, user, rec["output"], ("instruction", "output"))


def _prompt_completion(rec: dict, where: str) -> Example:
    for key in REQUIRED["prompt_completion"]:
        if key not in rec:
            raise DataError(f"{where}: missing field {key!r}")
    prompt, completion = rec["prompt"], rec["completion"]
    if isinstance(prompt, list) or isinstance(completion, list):  # TRL's conversational prompt-completion
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise DataError(f"{where}: prompt and completion must both be strings or both lists of {{role, content}}")
        if any(isinstance(m, dict) and m.get("role") == "assistant" for m in prompt):
            raise DataError(f"{where}: the prompt holds an assistant turn, which would be trained on as well; put the "
                            f"conversation in a 'messages' column (every assistant turn a target) instead")
        return parse_example({"messages": [*prompt, *completion]}, where)
    return _single_turn(rec, where, prompt, completion, ("prompt", "completion"))


def _require(rec: dict, fmt: str, where: str) -> None:
    for key in REQUIRED[fmt]:
        if key not in rec:
            raise DataError(f"{where}: missing field {key!r} (a {fmt} record has {', '.join(REQUIRED[fmt])})")


def _answer(value: Any, side: str, where: str) -> Any:
    """A conversational answer (a list of one {role: assistant, content} message) → its content; a string as is."""
    if not isinstance(value, list):
        return value
    if len(value) != 1 or not isinstance(value[0], dict) or value[0].get("role") != "assistant":
        raise DataError(f"{where}: {side} must be a string or a list of one {{role: assistant, content}} message")
    return value[0].get("content")


def _preference(rec: dict, where: str) -> PreferencePair:
    _require(rec, "preference", where)
    prompt = rec["prompt"]
    if isinstance(prompt, list):  # TRL's conversational form: the prompt's turns as messages
        turns = parse_example({"messages": [*prompt, {"role": "assistant", "content": "-"}]}, where).messages[:-1]
        if "system" in rec and turns[0].role != "system":
            turns = (Message("system", _check_text(rec["system"], "system", where)), *turns)
    else:
        system = _check_text(rec["system"], "system", where) if "system" in rec else DEFAULT_SYSTEM_PROMPT
        turns = (Message("system", system), Message("user", _check_text(prompt, "prompt", where)))
    return make_pair(turns, _answer(rec["chosen"], "chosen", where), _answer(rec["rejected"], "rejected", where),
                     where)


def _sharegpt_pair(rec: dict, where: str) -> PreferencePair:
    _require(rec, "sharegpt_pair", where)
    answers = []
    for side in ("chosen", "rejected"):
        value = rec[side]
        if not isinstance(value, dict) or SHAREGPT_ROLES.get(value.get("from")) != "assistant" or "value" not in value:
            raise DataError(f"{where}: {side} must be an object {{from: gpt, value: ...}}")
        answers.append(value["value"])
    turns = _sharegpt({**rec, "conversations": [*rec["conversations"], {"from": "gpt", "value": "-"}]},
                      where).messages[:-1]
    return make_pair(turns, *answers, where)


def to_example(fmt: str, record: Any, where: str) -> Example | PreferencePair:
    """One record as `fmt`: an Example, or a PreferencePair for the pair formats (PAIR_FORMATS)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if fmt in ("brief_caption", "messages"):
        return parse_example(record, where)
    return {"sharegpt": _sharegpt, "alpaca": _alpaca, "prompt_completion": _prompt_completion,
            "brief_pair": parse_brief_pair, "preference": _preference,
            "sharegpt_pair": _sharegpt_pair}[fmt](record, where)


# ----------------------------------------------------------------------------------------------------------------------
# Entry point


def check_columns(columns: Mapping[str, str]) -> None:
    for field in columns:
        if field not in FIELDS:
            raise DataError(f"data.columns.{field}: unknown field (known: {', '.join(FIELDS)})")


def _choose(fmt: str, first: dict, columns: Mapping[str, str], where: str) -> str:
    """The file's format from its first record; a mapped column the format reads must be there (a data set whose
    files differ, e.g. train ShareGPT and eval CSV, may map columns only some of its files have)."""
    absent = {field: col for field, col in columns.items() if col not in first}

    def refuse(field: str) -> DataError:
        return DataError(f'{where}: data.columns.{field} = "{absent[field]}", but there is no column '
                         f"{absent[field]!r} (columns: {', '.join(sorted(first))})")

    try:
        chosen = detect_format(set(_rename(first, columns)), where) if fmt == "auto" else fmt
    except DataError:
        if absent:
            raise refuse(next(iter(absent))) from None
        raise
    for field in REQUIRED[chosen] + OPTIONAL[chosen]:
        if field in absent:
            raise refuse(field)
    return chosen


def load_file(path: Path, fmt: str = "auto", columns: Mapping[str, str] | None = None
              ) -> tuple[list[Any], FileFormat]:
    """Every example of one file or saved dataset, read as ``fmt`` ("auto": detected from its columns)."""
    columns = dict(columns or {})
    check_columns(columns)
    if fmt not in FORMATS:
        raise DataError(f"data.format: unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")
    examples: list[Any] = []
    chosen = fmt
    for where, raw in iter_records(path):
        if not isinstance(raw, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        if not examples:  # the first record fixes the file's format
            chosen = _choose(fmt, raw, columns, where)
        examples.append(to_example(chosen, _rename(raw, columns), where))
    if not examples:
        raise DataError(f"{path}: file has no examples")
    return examples, FileFormat(str(path), chosen, fmt == "auto", len(examples))


def load_data(path: str | Path, fmt: str = "auto", columns: Mapping[str, str] | None = None, *,
              pairs: bool = False) -> tuple[list[Any], list[FileFormat]]:
    """The examples of data.train / data.eval: a file, a saved dataset or a folder of files, in order. With
    ``pairs`` (train.objective = "dpo") every file must hold preference pairs (PreferencePair), else examples."""
    examples: list[Any] = []
    formats = []
    path = resolve_dataset_path(str(path), "data file or folder")  # a hub dataset id: its cached snapshot
    for file in data_files(Path(path)):
        got, how = load_file(file, fmt, columns)
        if pairs and how.format not in PAIR_FORMATS:
            raise DataError(f"{file}: read as {how.format}, one answer per prompt, but train.objective = "
                            f"\"dpo\" learns from preference pairs; give {{brief, chosen, rejected}} records (or TRL's "
                            f"{{prompt, chosen, rejected}}; docs/data-in.md)")
        if not pairs and how.format in PAIR_FORMATS:
            raise DataError(f"{file}: holds preference pairs ({how.format}); set train.objective = \"dpo\" to learn "
                            f"from them, or give brief/caption data")
        examples += got
        formats.append(how)
    return examples, formats


__all__ = ["FORMATS", "PAIR_FORMATS", "FIELDS", "FileFormat", "load_data", "load_file", "detect_format", "to_example",
           "data_files"]
