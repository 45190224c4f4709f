"""Held-out shapes-world briefs the SFT designer never saw the like of, for measuring `improve-designer`.

The designer's training briefs (data/synthetic.py) come from six sentence templates with the mood first, the object
second and the layout hint last. These briefs keep the same vocabulary, so the judge's constraints still apply
(`brief_constraints` parses every one; tested), but change what the designer has to generalise over, one axis each:

    template   new sentence frames ("for the cover i need {kind}, {mood} in tone{layout}")
    order      the layout hint first and the mood last ("{layout}: {kind}, {mood}")
    context    an occasion before the request, in words outside the vocabulary ("for a jazz night flyer, ...")

`weak_briefs(n, seed)` draws n briefs per axis, mood, kind and layout uniformly as data/synthetic.py does; two seeds
give two disjoint-in-draws sets (the briefs `improve-designer` samples on, and the held-out ones it is judged on).
"""

from __future__ import annotations

import random

from atelier_studio.data.synthetic import KINDS, LAYOUT_PROBABILITY, LAYOUTS, MOODS, brief_constraints

AXES = ("template", "order", "context")

TEMPLATES = (
    "for the cover i need {kind}, {mood} in tone{layout}",
    "could you draw {kind}? keep it {mood}{layout}",
    "{kind} please, and make the whole thing {mood}{layout}",
    "the client asked for {kind} that feels {mood}{layout}",
)
ORDERED = (  # {layout} here is the bare phrase, first
    "{layout}: {kind}, {mood}",
    "{layout}, {kind} with a {mood} feel",
)
CONTEXTS = (
    "for a jazz night flyer", "for my sister's wedding card", "for a bakery window", "for a conference badge",
    "for a quarterly report", "for a museum ticket",
)


def _draw(rng: random.Random, axis: str) -> str:
    mood = rng.choice(MOODS[rng.choice(sorted(MOODS))][1])
    kind = rng.choice(KINDS[rng.choice(sorted(KINDS))][2])
    layout = rng.choice(sorted(LAYOUTS))
    phrase = rng.choice(LAYOUTS[layout][2])
    hint = rng.random() < LAYOUT_PROBABILITY
    if axis == "template":
        return rng.choice(TEMPLATES).format(kind=kind, mood=mood, layout=f", {phrase}" if hint else "")
    if axis == "order":
        return rng.choice(ORDERED).format(layout=phrase, kind=kind, mood=mood)
    if axis == "context":
        return f"{rng.choice(CONTEXTS)}: something {mood} with {kind}" + (f", {phrase}" if hint else "")
    raise ValueError(f"unknown axis {axis!r}; axes: {', '.join(AXES)}")


def weak_briefs(n: int, seed: int) -> list[dict[str, str]]:
    """n briefs per axis, as {"brief", "axis"}; each parses to the shapes world's constraints."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    rows = []
    for axis in AXES:
        for _ in range(n):
            brief = _draw(rng, axis)
            brief_constraints(brief)  # a frame that broke the grammar is a bug here, not a bad brief
            rows.append({"brief": brief, "axis": axis})
    return rows
