"""Designer tokenizers: train a Qwen-style byte-level BPE locally, and load any local HF tokenizer directory.

Nothing is downloaded: real runs point ``load_tokenizer`` at a local model directory; tests and the demo train a
small tokenizer here with the ``tokenizers`` library on their own corpus.

The trained tokenizer copies Qwen2/3's choices:
  - pre-tokenizer: Qwen's split regex (contractions, letter runs with one leading non-letter, single digits,
    punctuation runs, newline runs, spaces), then byte-level mapping, so every string is encodable;
  - special tokens, in this order at ids 0, 1, 2: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos);
  - a ChatML chat template (``CHAT_TEMPLATE``) in tokenizer_config.json.
Deliberate difference: no NFC normalizer, so decode(encode(s)) == s for every string (the chat encoder relies
on exact round trips).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from atelier_studio.data.chat import DEFAULT_SYSTEM_PROMPT, ENDOFTEXT, IM_END, IM_START, DataError
from atelier_studio.data.chat_formats import SUFFIXES, load_data
from atelier_studio.data.textfile import iter_lines
from atelier_studio.pipeline.atomic import atomic_dir

SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen2/Qwen3's pre-tokenization regex (tokenizer.json of Qwen/Qwen3-*), see Qwen2Tokenizer.
QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# ChatML as Qwen renders it without tools. The {% generation %} markers are ignored when rendering; they let
# transformers' `return_assistant_tokens_mask` compute the assistant mask, which the tests use as a reference.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class TokenizerError(DataError):
    """A tokenizer that cannot be trained or loaded; the message names the path."""


def iter_corpus_texts(corpus_files: list[Path]) -> Iterator[str]:
    """Texts of a corpus: .txt one text per non-blank line; designer data (data/chat_formats.py: .jsonl, .json, .csv,
    .parquet, a folder of them or a datasets folder, in any of its formats) the contents of every message."""
    for path in map(Path, corpus_files):
        if not path.exists():
            raise TokenizerError(f"{path}: corpus file not found")
        if path.suffix == ".txt":
            yield from (line for _, line in iter_lines(path) if line.strip())  # non-UTF-8: named path:line
        elif path.is_dir() or path.suffix in SUFFIXES:
            examples, _ = load_data(path)
            for example in examples:
                yield from (m.content for m in example.messages)
        else:
            raise TokenizerError(f"{path}: corpus files must be .txt or designer data ({', '.join(SUFFIXES)}, or a "
                                 f"folder of them), got {path.suffix or 'no suffix'!r}")


def train_tokenizer(corpus_files: list[Path], vocab_size: int, out_dir: Path) -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens (specials included) and save it as an HF tokenizer directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    min_vocab = 256 + len(SPECIAL_TOKENS)  # every byte plus the specials must fit
    if vocab_size < min_vocab:
        raise TokenizerError(f"train_tokenizer: vocab_size={vocab_size} is below the byte alphabet + specials "
                             f"({min_vocab})")
    if not corpus_files:
        raise TokenizerError("train_tokenizer: no corpus files given")
    texts = list(iter_corpus_texts(corpus_files))
    if not texts:
        raise TokenizerError(f"train_tokenizer: corpus {[str(p) for p in corpus_files]} has no text")
    # The chat scaffolding is in every training document, so let BPE see it too.
    texts += [DEFAULT_SYSTEM_PROMPT, "system\n", "user\n", "assistant\n"]

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                 additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
                                 clean_up_tokenization_spaces=False, model_max_length=131072)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, what="tokenizer directory") as tmp:  # all of it, or nothing (pipeline/atomic.py)
        hf.save_pretrained(str(tmp))
        _finish_config(tmp)
    return out_dir


def _finish_config(out_dir: Path) -> None:
    """Keep the template inside tokenizer_config.json (as Qwen ships it), whatever save_pretrained's default, and
    name the class every transformers version loads (v5 writes "TokenizersBackend", which v4 does not know)."""
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    side_file = out_dir / "chat_template.jinja"
    if side_file.exists():  # one source of truth: the config
        side_file.unlink()


def load_tokenizer(model_or_tokenizer_dir: Path | str) -> Any:
    """AutoTokenizer from a local directory only; a missing or unreadable directory is a TokenizerError."""
    from transformers import AutoTokenizer

    path = Path(model_or_tokenizer_dir)
    if not path.is_dir():
        raise TokenizerError(f"{path}: tokenizer directory not found")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise TokenizerError(f"{path}: no tokenizer.json / tokenizer_config.json / vocab.json in this directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; keep the cause, say where
        raise TokenizerError(f"{path}: could not load tokenizer ({type(e).__name__}: {e})") from e
    if tokenizer.eos_token_id is None:
        raise TokenizerError(f"{path}: tokenizer has no eos token")
    return tokenizer
