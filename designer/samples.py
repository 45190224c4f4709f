"""Captions the designer writes during training: the same held-out briefs at each evaluation, decoded greedily.

The briefs are the user turns of the first `sample.briefs` examples of data.eval (a fixed set: a caption that gets
worse from one evaluation to the next is visible while the run goes on). Each evaluation decodes them with the
model as it is (LoRA adapters applied), greedy, up to `sample.max_new_tokens`, stopping at the chat template's end of
turn; the trainer logs the table (brief, caption, step) to every tracker (pipeline/trackers.py). When every brief is a
shapes-world brief (data/synthetic.py's parse_brief reads it), the shapes-world judge scores the captions against
their briefs (data/judge.py's judge_caption_batch: colour, shape and position each allowed by the brief) and the mean
goes to the same step's eval record as `caption_score`.
"""

from __future__ import annotations

from typing import Any, Sequence

from atelier_studio.data.chat import IM_END, Example, prompt_ids
from atelier_studio.data.judge import judge_caption_batch
from atelier_studio.data.synthetic import parse_brief
from atelier_studio.designer.generate import generate
from atelier_studio.pipeline.task import SampleTable


def sample_briefs(examples: Sequence[Example], count: int) -> list[str]:
    """The user turn that each of the first `count` examples answers (the last user message before its reply)."""
    briefs = []
    for example in examples[:count]:
        users = [m.content for m in example.messages if m.role == "user"]
        if users:
            briefs.append(users[-1])
    return briefs


class CaptionSampler:
    """Greedy captions of fixed briefs as a SampleTable, scored by the shapes-world judge when it can read them."""

    def __init__(self, tokenizer: Any, briefs: Sequence[str], max_new_tokens: int, max_seq_len: int):
        self.tokenizer = tokenizer
        self.briefs = list(briefs)
        self.prompts = [prompt_ids(tokenizer, b) for b in self.briefs]
        # a prompt and its caption must fit the model's context: the longest prompt bounds the new tokens
        self.max_new_tokens = min(max_new_tokens, max_seq_len - max(len(p) for p in self.prompts))
        self.judged = all(parse_brief(b) is not None for b in self.briefs)
        self.eos = tokenizer.convert_tokens_to_ids(IM_END)

    def table(self, model: Any, step: int, lockstep: bool = False) -> SampleTable | None:
        """The captions at `step`. lockstep: every prompt decodes all max_new_tokens and is cut at its end of turn
        afterwards, so each process of a sharded model runs the same number of forwards (each one gathers weights
        from all of them: a process that stopped first would leave the others waiting)."""
        if self.max_new_tokens < 1:
            return None
        outputs = generate(model, self.tokenizer, self.prompts, max_new_tokens=self.max_new_tokens,
                           eos_token_id=[] if lockstep else self.eos)
        if lockstep:
            outputs = [ids[:ids.index(self.eos)] if self.eos in ids else ids for ids in outputs]
        captions = [self.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in outputs]
        scores = {"caption_score": judge_caption_batch(captions, self.briefs).score} if self.judged else {}
        return SampleTable("captions", ("brief", "caption", "step"),
                           tuple((b, c, step) for b, c in zip(self.briefs, captions)), scores)


__all__ = ["CaptionSampler", "sample_briefs"]
