"""Designer chat data: brief/caption JSONL and chat messages -> token ids + loss mask.

Input, one JSON object per line, either

    {"brief": str, "caption": str, "system"?: str}                  (the designer's native form)
    {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}

A brief/caption line becomes [system, user=brief, assistant=caption], with ``DEFAULT_SYSTEM_PROMPT``
unless the line gives its own; ``prompt_ids`` uses the same constant, so training and generation
see the same prefix. A ``messages`` line is taken verbatim (no system prompt is added).

Encoding renders the whole conversation with the tokenizer's own chat template (ChatML for
Atelier's tokenizers and Qwen's), then cuts the rendered string into spans and tokenizes each span
on its own:

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n
    \\_______________________________ loss_mask False ____________________________________/
    ...<|im_start|>assistant\\n | CAPTION<|im_end|> | \\n
                                 \\_ True ________/   False

Why per span: a BPE merge may not straddle the prompt/caption boundary, so the prompt's ids are
exactly ``prompt_ids`` (what the model is conditioned on at generation time), and the loss mask is
exact per token instead of "the token that overlaps the boundary". decode(input_ids) is still the
template's string, byte for byte.

Shape legend: L tokens of one document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from atelier_studio.data.textfile import iter_json_lines
from atelier_studio.pipeline.errors import DataError  # also imported from here by the modules that read training data

DEFAULT_SYSTEM_PROMPT = "You are a designer. Expand the brief into a detailed image caption."
ROLES = ("system", "user", "assistant")
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# Text that a tokenizer would turn into control tokens: in user data it would forge turn boundaries.
RESERVED_STRINGS = (IM_START, IM_END, ENDOFTEXT)


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Example:
    """One conversation; ``source`` is ``path:line`` so later errors can point back at the input."""

    messages: tuple[Message, ...]
    source: str = "<memory>"

    @classmethod
    def from_brief(cls, brief: str, caption: str, system: str = DEFAULT_SYSTEM_PROMPT,
                   source: str = "<memory>") -> "Example":
        return cls((Message("system", system), Message("user", brief), Message("assistant", caption)), source)


@dataclass(frozen=True)
class PreferencePair:
    """One preference (train.objective = "dpo"): a prompt (system?, then user turns) answered by ``chosen``, the
    preferred caption, and by ``rejected``. Each side is a conversation of its own (``examples``), encoded like any
    example, so the two share the prompt's tokens exactly."""

    prompt: tuple[Message, ...]
    chosen: str
    rejected: str
    source: str = "<memory>"

    def examples(self) -> tuple[Example, Example]:
        """(prompt + chosen, prompt + rejected)."""
        return (Example((*self.prompt, Message("assistant", self.chosen)), self.source),
                Example((*self.prompt, Message("assistant", self.rejected)), self.source))


@dataclass(frozen=True)
class EncodedDoc:
    """input_ids [L] and loss_mask [L]; loss_mask[i] says token i is a target (assistant content or its <|im_end|>)."""

    input_ids: list[int]
    loss_mask: list[bool]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"EncodedDoc: input_ids has {len(self.input_ids)} tokens but loss_mask has "
                             f"{len(self.loss_mask)}")

    def __len__(self) -> int:
        return len(self.input_ids)


# ----------------------------------------------------------------------------------------------------------------------
# Loading and validation


def _check_text(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: {what} is empty")
    for reserved in RESERVED_STRINGS:
        if reserved in value:
            raise DataError(f"{where}: {what} contains the reserved control string {reserved!r}")
    return value


def parse_example(obj: Any, where: str) -> Example:
    """Validate one decoded JSON value; ``where`` ("path:line") prefixes every error."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        if "brief" in obj or "caption" in obj:
            raise DataError(f"{where}: give either 'messages' or 'brief'/'caption', not both")
        raw = obj["messages"]
        if not isinstance(raw, list) or not raw:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        messages = []
        for i, m in enumerate(raw):
            at = f"{where}: messages[{i}]"
            if not isinstance(m, dict):
                raise DataError(f"{at} must be an object with 'role' and 'content', got {type(m).__name__}")
            for key in ("role", "content"):
                if key not in m:
                    raise DataError(f"{at} is missing '{key}'")
            role = m["role"]
            if role not in ROLES:
                raise DataError(f"{at}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
            if role == "system" and i != 0:
                raise DataError(f"{at}: a system message may only come first")
            messages.append(Message(role, _check_text(m["content"], f"messages[{i}].content", where)))
        if not any(m.role == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant turn, so the example has nothing to learn")
        return Example(tuple(messages), where)
    for key in ("brief", "caption"):
        if key not in obj:
            raise DataError(f"{where}: missing field '{key}' (or give 'messages')")
    brief = _check_text(obj["brief"], "brief", where)
    caption = _check_text(obj["caption"], "caption", where)
    system = _check_text(obj["system"], "system", where) if "system" in obj else DEFAULT_SYSTEM_PROMPT
    return Example.from_brief(brief, caption, system, where)


def make_pair(prompt: Sequence[Message], chosen: Any, rejected: Any, where: str) -> PreferencePair:
    """A checked PreferencePair: the prompt ends with a user turn and holds no assistant turn (its tokens would be
    scored too), each answer a non-empty string, and the two answers differ (an identical pair has no preference:
    its margin is 0 whatever the model does)."""
    if not prompt or prompt[-1].role != "user":
        raise DataError(f"{where}: the prompt must end with a user turn (the brief) that chosen and rejected answer")
    if any(m.role == "assistant" for m in prompt):
        raise DataError(f"{where}: the prompt holds an assistant turn; a preference pair scores only the two answers, "
                        f"so give the prompt as system and user turns")
    chosen = _check_text(chosen, "chosen", where)
    rejected = _check_text(rejected, "rejected", where)
    if chosen.strip() == rejected.strip():
        raise DataError(f"{where}: chosen and rejected are the same text, so the pair prefers nothing; drop the line "
                        f"or give a different rejected answer")
    return PreferencePair(tuple(prompt), chosen, rejected, where)


def parse_brief_pair(obj: Any, where: str) -> PreferencePair:
    """A {brief, chosen, rejected, system?} line: [system, user=brief] answered both ways, the system prompt
    ``DEFAULT_SYSTEM_PROMPT`` unless the line gives its own (as for brief/caption lines)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("brief", "chosen", "rejected"):
        if key not in obj:
            raise DataError(f"{where}: missing field '{key}' (a preference pair is brief, chosen, rejected)")
    system = _check_text(obj["system"], "system", where) if "system" in obj else DEFAULT_SYSTEM_PROMPT
    prompt = (Message("system", system), Message("user", _check_text(obj["brief"], "brief", where)))
    return make_pair(prompt, obj["chosen"], obj["rejected"], where)


def load_examples(path: Path | str) -> list[Example]:
    """Read and validate a JSONL file. Blank lines are skipped; any bad line, or no example at all, is a DataError."""
    path = Path(path)
    # a missing file, a non-UTF-8 line or a line that is not JSON is a DataError naming it
    examples = [parse_example(obj, where) for where, obj in iter_json_lines(path)]
    if not examples:
        raise DataError(f"{path}: file has no examples")
    return examples


# ----------------------------------------------------------------------------------------------------------------------
# Encoding


def _render(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool, **kwargs: Any) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
    return tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                         tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def assistant_spans(tokenizer: Any, example: Example) -> tuple[str, list[tuple[int, int]]]:
    """Render ``example``; return the string and the [start, end) character spans of each assistant content +
    <|im_end|>.

    The header end of assistant turn i is the length of the conversation up to i rendered with the generation
    prompt (a prefix of the full rendering for ChatML templates); the turn ends at the next <|im_end|>. Inside it
    the content is located from the end, so a template that inserts something before it (Qwen3's empty
    <think></think> block) or strips its leading newlines still masks exactly the content.
    """
    text = _render(tokenizer, example.messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(example.messages):
        if m.role != "assistant":
            continue
        head = _render(tokenizer, example.messages[:i], add_generation_prompt=True)
        if not text.startswith(head):
            raise DataError(f"{example.source}: chat template is not prefix-stable at assistant turn {i} "
                            "(rendering the turns before it plus the generation prompt is not a prefix of the whole)")
        end = text.find(IM_END, len(head))
        if end < 0:
            raise DataError(f"{example.source}: chat template does not close assistant turn {i} with {IM_END!r}")
        body = text[len(head):end]
        for content in (m.content, m.content.lstrip("\n"), m.content.strip()):
            if content and body.endswith(content):
                spans.append((end - len(content), end + len(IM_END)))
                break
        else:
            raise DataError(f"{example.source}: assistant turn {i}'s content is not where the chat template renders it")
    return text, spans


def encode_example(tokenizer: Any, example: Example, max_len: int | None = None) -> EncodedDoc:
    """Token ids and loss mask of one conversation; with ``max_len`` the document is cut to its first max_len tokens."""
    text, spans = assistant_spans(tokenizer, example)
    ids: list[int] = []
    mask: list[bool] = []
    pos = 0
    for start, end in spans:
        for piece, is_target in ((text[pos:start], False), (text[start:end], True)):
            piece_ids = _ids(tokenizer, piece)
            ids += piece_ids
            mask += [is_target] * len(piece_ids)
        pos = end
    tail = _ids(tokenizer, text[pos:])
    ids += tail
    mask += [False] * len(tail)
    if max_len is not None:
        if max_len < 2:
            raise ValueError(f"encode_example: max_len must be >= 2, got {max_len}")
        ids, mask = ids[:max_len], mask[:max_len]
        if not any(mask):
            raise DataError(f"{example.source}: the prompt alone fills max_len={max_len} tokens; "
                            "no caption token is left")
    return EncodedDoc(ids, mask)


def encode_examples(tokenizer: Any, examples: Sequence[Example], max_len: int | None = None) -> list[EncodedDoc]:
    return [encode_example(tokenizer, ex, max_len) for ex in examples]


def encode_pair(tokenizer: Any, pair: PreferencePair) -> tuple[EncodedDoc, EncodedDoc]:
    """The (chosen, rejected) documents of a pair: each its conversation encoded as `encode_example` does, so both
    begin with the same prompt tokens (checked: a template that renders the answer into the prompt is refused)."""
    chosen, rejected = (encode_example(tokenizer, ex) for ex in pair.examples())
    first = chosen.loss_mask.index(True)
    if chosen.input_ids[:first] != rejected.input_ids[:first]:
        raise DataError(f"{pair.source}: the chosen and rejected conversations do not share their prompt tokens "
                        f"under this tokenizer's chat template")
    return chosen, rejected


def prompt_ids(tokenizer: Any, brief: str, system: str = DEFAULT_SYSTEM_PROMPT) -> list[int]:
    """Ids of [system, user=brief] + the assistant header: what generation continues from.

    Equal to the first tokens of ``encode_example`` on the same brief (the prompt span is tokenized the same way).
    ``enable_thinking=False`` only matters for Qwen3's template, where it appends the empty think block that the
    template also writes into the training rendering of the last assistant turn; other templates ignore it.
    """
    _check_text(brief, "brief", "prompt_ids")
    messages = (Message("system", system), Message("user", brief))
    return _ids(tokenizer, _render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False))
