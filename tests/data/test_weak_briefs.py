"""data/weak_briefs.py: every held-out brief parses to the shapes world's constraints, none is a training brief's
frame, and a seed gives the same briefs."""

from __future__ import annotations

import re

import pytest

from atelier_studio.data.synthetic import BRIEF_TEMPLATES, brief_constraints, generate_world
from atelier_studio.data.weak_briefs import AXES, weak_briefs


def test_weak_briefs_parse_are_deterministic_and_new(tmp_path):
    rows = weak_briefs(40, seed=3)
    assert [r["axis"] for r in rows] == [a for a in AXES for _ in range(40)]
    for r in rows:
        brief_constraints(r["brief"])  # raises for a brief the judge cannot constrain
    assert weak_briefs(40, seed=3) == rows and weak_briefs(40, seed=4) != rows
    generate_world(tmp_path, n=60, seed=0, image_size=32, n_text=60)
    seen = {line.split('"brief": "')[1].split('"')[0] for line in (tmp_path / "designer_train.jsonl").open()}
    assert not seen & {r["brief"] for r in rows}
    # no weak brief fits a training template's frame (its fixed words, anything in the slots)
    frames = [re.compile(re.sub(r"\\\{\w+\\\}", ".*", re.escape(t))) for t in BRIEF_TEMPLATES]
    assert frames[0].fullmatch("something calm with a circle, on the left")  # the frames do match training briefs
    assert not [r for r in rows if any(f.fullmatch(r["brief"]) for f in frames)]
    with pytest.raises(ValueError, match="n must be"):
        weak_briefs(0, seed=0)
