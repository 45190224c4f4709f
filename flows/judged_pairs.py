"""Judged preference pairs for `improve-designer` (flows/improve.py): k sampled captions per brief → renders → judge
scores → best-vs-worst pairs, written as a dataset.

One round's sampling folder, <round>/samples/, is brief-to-image-eval's steps run on every brief repeated k times:
`write_captions` (the designer's own decoding, designer/generate.py, at `temperature` from one generator seeded
with `seed`, so a round is reproducible), `render_images` (the imagegen sampler, batched, on the GPU when there is
one) and `judge` (the shapes-world judge for a shapes-world brief; with `clip`, the CLIP score against the brief for
any other). A sample's score is the judged brief-to-image score (0..1, image against brief), else its CLIP score
against the brief; a sample no scorer applies to, or with an empty caption, takes part in no pair. With `renders`
r > 1 every caption is rendered r times, from seeds seed, seed + 1, ... (other noise, the same caption), each render
judged, and the sample's score is the mean of its renders' scores: a render that misses a shape its caption names
correctly then costs the caption 1/r of a miss instead of all of it, so fewer pairs rank two correct captions by the
render's luck (the first render in <round>/samples/, the others in <round>/samples/render-2/ ...; the pair dataset
keeps the first render's image).

`select_pairs` keeps, per brief, the best and the worst sample when the best beats the worst by more than `margin`
(a tie, or a gap of at most `margin`, drops the brief; so does a best and worst of the same text). `write_pairs`
writes <round>/pairs/ whole or not at all: pairs.jsonl ({brief, chosen, rejected}: the `brief_pair` format DPO
reads), scores.jsonl (each pair's scores and images), images/ (the pair's two renders) and costs.json.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from atelier_studio.pipeline.atomic import atomic_dir, atomic_write_text


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sampled caption of a brief, its render (None: empty caption) and its score (None: not scored)."""

    brief: str
    caption: str
    image: str | None
    score: float | None


@dataclasses.dataclass(frozen=True)
class Pair:
    brief: str
    chosen: Sample
    rejected: Sample

    @property
    def gap(self) -> float:
        return float(self.chosen.score) - float(self.rejected.score)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The pairs kept and why the other briefs gave none."""

    pairs: list[Pair]
    ties: int           # best and worst scored the same (or the same caption text)
    within_margin: int  # the best beat the worst by more than 0 but at most the margin
    too_few: int        # fewer than two scored, non-empty samples


def select_pairs(groups: Sequence[Sequence[Sample]], margin: float) -> Selection:
    """Best vs worst of each brief's samples, kept when best − worst > margin (module docstring). Among equal
    scores the earlier sample is the best and the later the worst, so the choice is deterministic."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    pairs, ties, within, few = [], 0, 0, 0
    for group in groups:
        usable = [s for s in group if s.score is not None and s.caption.strip()]
        if len(usable) < 2:
            few += 1
            continue
        best = max(usable, key=lambda s: s.score)  # first of the highest
        worst = min(reversed(usable), key=lambda s: s.score)  # last of the lowest
        gap = best.score - worst.score
        if gap == 0 or best.caption.strip() == worst.caption.strip():
            ties += 1
        elif gap <= margin:
            within += 1
        else:
            pairs.append(Pair(best.brief, best, worst))
    return Selection(pairs, ties, within, few)


def sample_score(entry: dict[str, Any]) -> float | None:
    """A judged sample's score (flows/evaluate.py `judge`'s per-brief entry): the shapes-world score, else CLIP's."""
    from atelier_studio.flows.evaluate import SHAPES_JUDGE

    if entry["scorer"] == SHAPES_JUDGE:
        return float(entry["score"])
    return None if entry.get("clip_brief") is None else float(entry["clip_brief"])


def mean_score(scores: Sequence[float | None]) -> float | None:
    """A caption's score over its renders: the mean of those a scorer judged (None when none was)."""
    judged = [s for s in scores if s is not None]
    return sum(judged) / len(judged) if judged else None


def sample_and_judge(designer: str | Path, imagegen: str | Path, briefs: Sequence[str], k: int, out_dir: str | Path,
                     temperature: float, seed: int, max_new_tokens: int, steps: int, guidance: float,
                     clip: str | Path | None = None, renders: int = 1) -> tuple[list[list[Sample]], dict[str, Any]]:
    """k captions per brief → `renders` renders each → scores under out_dir; returns the samples grouped by brief
    (each scored by the mean over its renders: module docstring) and the costs (samples, renders, seconds of each
    step)."""
    from atelier_studio.flows.evaluate import judge, read_captions, render_images, write_captions

    if renders < 1:
        raise ValueError(f"renders must be >= 1, got {renders}")
    out = Path(out_dir)
    repeated = [b for b in briefs for _ in range(k)]  # brief-major: sample j of brief i is row i·k + j
    t0 = time.perf_counter()
    captions = write_captions(designer, repeated, out, seed, max_new_tokens, temperature, 1.0)
    t1 = time.perf_counter()
    render_s, judge_s, per_render = 0.0, 0.0, []
    for j in range(renders):  # render j of every caption from seed + j: the first in out/ itself
        where = out if j == 0 else out / f"render-{j + 1}"
        t = time.perf_counter()
        index = render_images(imagegen, captions, where, seed + j, steps, guidance)
        render_s += time.perf_counter() - t
        t = time.perf_counter()
        judge(captions, index, where, clip)
        judge_s += time.perf_counter() - t
        per_render.append(json.loads((where / "scores.json").read_text())["per_brief"])
    rows = read_captions(captions)
    samples = [Sample(r["brief"], r["caption"], entries[0]["image"], mean_score([sample_score(e) for e in entries]))
               for r, *entries in zip(rows, *per_render)]
    groups = [samples[i * k:(i + 1) * k] for i in range(len(briefs))]
    costs = {"samples": len(samples), "renders_per_caption": renders,
             "renders": sum(s.image is not None for s in samples) * renders,
             "sample_s": round(t1 - t0, 3), "render_s": round(render_s, 3), "judge_s": round(judge_s, 3)}
    return groups, costs


def write_pairs(selection: Selection, out_dir: str | Path, costs: dict[str, Any] | None = None) -> Path:
    """<out>/pairs.jsonl, scores.jsonl, images/ (module docstring) and costs.json (`costs`, what making them took),
    installed whole; returns pairs.jsonl."""
    final = Path(out_dir)
    with atomic_dir(final, "pairs dataset") as tmp:
        (tmp / "images").mkdir()
        rows, scored = [], []
        for i, p in enumerate(selection.pairs):
            rows.append({"brief": p.brief, "chosen": p.chosen.caption, "rejected": p.rejected.caption})
            images = {}
            for side, s in (("chosen", p.chosen), ("rejected", p.rejected)):
                name = f"images/{i:05d}-{side}.png"
                shutil.copyfile(s.image, tmp / name)  # a scored sample with a caption always has its render
                images[side] = name
            scored.append({"brief": p.brief, "chosen_score": p.chosen.score, "rejected_score": p.rejected.score,
                           "chosen_image": images["chosen"], "rejected_image": images["rejected"]})
        atomic_write_text(tmp / "scores.jsonl", "".join(json.dumps(r) + "\n" for r in scored), what="pair scores")
        atomic_write_text(tmp / "pairs.jsonl", "".join(json.dumps(r) + "\n" for r in rows), what="pairs")
        atomic_write_text(tmp / "costs.json", json.dumps(costs or {}, indent=1), what="pair costs")
    return final / "pairs.jsonl"
