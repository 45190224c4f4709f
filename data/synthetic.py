"""The shapes world: briefs, captions and images a CPU can train on and a program can judge.

A sample is one coloured shape on a pale background. Three layers describe it:

    brief    "a soothing poster, round shapes, left side"            (vague: mood, kind, layout hint)
    caption  "a small blue circle in the center left on a white background"   (fixed grammar, exact)
    image    S x S RGB PNG rendered from the caption with PIL             (S = image size in pixels)

The designer LM learns brief -> caption, the imagegen learns caption -> image, and `data/judge.py`
scores both without any learned judge. Every choice is drawn from one `random.Random(seed)`, so a
world is a pure function of (n, seed, image_size, eval_fraction, held_out).

Geometry (all fractions of the image side S, origin top-left, y down):
    cell centres   0.25, 0.50, 0.75 per axis (3 x 3 grid), jittered by up to +-JITTER (0.015)
    half-extent r  SIZES[size]: half the side of the shape's bounding box
    max extent     0.75 + 0.015 + 0.20 = 0.965: inside the canvas with > 1 px to spare at S >= 32

Compositional split: the (colour, shape) pairs in HELD_OUT_PAIRS never occur in train; every colour
and every shape still does. Half of the eval split is drawn from held-out pairs, the rest in-distribution.

Text-only samples (n_text): brief/caption pairs drawn like the train split but without images, after the
train and eval splits (so they leave both unchanged), and each with a layout hint: they cycle through every
(layout, phrase) of LAYOUTS in turn. A tiny designer trained on the 1-2k train briefs alone memorises individual
briefs, and an unusual wording then gets a colour or shape outside the brief's constraints; the language side
needs many more distinct briefs than the image side needs images, and text costs nothing to render or encode.
The hints: a layout is learnt from the briefs that state it, and left/right (which decides only the caption's
second position word) is learnt all at once at a step that varies from run to run (docs/demo.md).

Files written by `generate_world(out_dir, ...)`:
    train.jsonl, eval.jsonl  {"brief","caption","image","shape","color","size","position",
                              "background","mood","kind","layout","held_out"}
    designer_train.jsonl     train.jsonl's rows, then the n_text text-only rows (the same fields, no "image"):
                             the designer's training data
    images/{split}_{i:05d}.png
    captions.jsonl           train only, {"image","caption"}: the input of the image shard writer
    briefs_eval.txt          one eval brief per line, for the end-to-end evaluation
    corpus.txt               train briefs and captions plus the vocabulary, for tokenizer training
    world.json               the WorldStats and the vocabulary
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
from pathlib import Path
from typing import Sequence

from PIL import Image, ImageDraw

from atelier_studio.pipeline.errors import UsageError

# ---------------------------------------------------------------------------------------------
# Vocabulary. RGB values are exact: the judge classifies against these same tables.
# ---------------------------------------------------------------------------------------------

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")

COLORS: dict[str, tuple[int, int, int]] = {
    "blue": (30, 80, 220),
    "teal": (0, 140, 140),
    "green": (30, 150, 50),
    "red": (215, 30, 30),
    "orange": (240, 120, 10),
    "yellow": (235, 200, 20),
    "purple": (120, 40, 170),
    "black": (25, 25, 25),
}

# Colour families: a mood allows exactly one family.
FAMILIES: dict[str, tuple[str, ...]] = {
    "cool": ("blue", "teal", "green"),
    "warm": ("red", "orange", "yellow"),
    "dark": ("purple", "black"),
}

# Pale backgrounds: >= 150 RGB units from every foreground colour, >= 45 from each other (tested).
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "pale yellow": (250, 245, 205),
    "light grey": (215, 215, 215),
    "pale blue": (195, 220, 255),
}

# Half-extent of the bounding box as a fraction of the image side.
SIZES: dict[str, float] = {"small": 0.12, "medium": 0.16, "large": 0.20}

# (row, column) of each position in the 3 x 3 grid; names read after "in the".
POSITIONS: dict[str, tuple[int, int]] = {
    "upper left": (0, 0), "top center": (0, 1), "upper right": (0, 2),
    "center left": (1, 0), "center": (1, 1), "center right": (1, 2),
    "lower left": (2, 0), "bottom center": (2, 1), "lower right": (2, 2),
}
CELL_CENTERS: tuple[float, float, float] = (0.25, 0.50, 0.75)
JITTER = 0.015  # max centre offset (fraction of the side); at 32 px the border ring still stays pure background

HELD_OUT_PAIRS: frozenset[tuple[str, str]] = frozenset({
    ("teal", "circle"), ("orange", "square"), ("black", "triangle"),
    ("green", "diamond"), ("red", "cross"), ("purple", "circle"),
})

# ---------------------------------------------------------------------------------------------
# Brief vocabulary: mood -> colour family, kind -> shapes, layout hint -> positions.
# Words are unique across the three tables so a brief parses without ambiguity.
# ---------------------------------------------------------------------------------------------

MOODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "calm": ("cool", ("calm", "serene", "soothing", "peaceful", "tranquil", "relaxed")),
    "energetic": ("warm", ("energetic", "bold", "vibrant", "lively", "fiery", "punchy")),
    "mysterious": ("dark", ("mysterious", "moody", "brooding", "gothic", "shadowy", "eerie")),
}

KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    # kind: (allowed shapes, keywords, noun phrases used in briefs)
    "round": (("circle",), ("round", "circle", "curves", "curvy"),
              ("a circle", "round shapes", "something round", "soft curves", "a curvy form")),
    "angular": (("triangle", "diamond"), ("angular", "sharp", "pointy", "spiky"),
                ("sharp angles", "something angular", "pointy shapes", "a spiky form")),
    "solid": (("square",), ("solid", "boxy", "square", "blocky"),
              ("a solid block", "something boxy", "a square", "blocky shapes")),
    "crossing": (("cross",), ("plus", "crossing", "cross", "intersecting"),
                 ("a plus sign", "crossing bars", "a cross", "intersecting lines")),
}

LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    # layout: (allowed positions, keywords, phrases used in briefs)
    "left": (("upper left", "center left", "lower left"), ("left",),
             ("on the left", "left side", "to the left")),
    "right": (("upper right", "center right", "lower right"), ("right",),
              ("on the right", "right side", "to the right")),
    "top": (("upper left", "top center", "upper right"), ("top",),
            ("at the top", "near the top", "top edge")),
    "bottom": (("lower left", "bottom center", "lower right"), ("bottom",),
               ("at the bottom", "near the bottom", "bottom edge")),
    "corner": (("upper left", "upper right", "lower left", "lower right"), ("corner",),
               ("in a corner", "tucked into a corner", "corner placement")),
    "middle": (("center",), ("middle", "centered"), ("in the middle", "centered")),
}

# {mood} is an adjective, {kind} a noun phrase, {layout} "" or ", <phrase>" / " <phrase>".
BRIEF_TEMPLATES: tuple[str, ...] = (
    "something {mood} with {kind}{layout}",
    "a {mood} poster, {kind}{layout}",
    "{kind}, feeling {mood}{layout}",
    "make it {mood}: {kind}{layout}",
    "i want a {mood} design featuring {kind}{layout}",
    "{mood} vibe, {kind}{layout}",
)
LAYOUT_PROBABILITY = 0.6  # fraction of briefs with a layout hint


@dataclasses.dataclass(frozen=True)
class CaptionSpec:
    """Everything a caption says; `render` draws it and `judge_image` checks it."""

    size: str
    color: str
    shape: str
    position: str
    background: str

    def caption(self) -> str:
        return f"a {self.size} {self.color} {self.shape} in the {self.position} on a {self.background} background"


@dataclasses.dataclass(frozen=True)
class BriefSpec:
    """The three things a brief pins down; layout is None when the brief gives no hint."""

    mood: str
    kind: str
    layout: str | None


@dataclasses.dataclass(frozen=True)
class BriefConstraints:
    """What a caption may say for a brief: one colour family, a shape set, a position set."""

    brief: BriefSpec
    family: str
    colors: frozenset[str]
    shapes: frozenset[str]
    positions: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One world sample: brief, caption spec and exact centre (fractions of the side)."""

    brief: str
    mood: str
    kind: str
    layout: str | None
    spec: CaptionSpec
    center: tuple[float, float]  # (x, y)
    held_out: bool

    def record(self, image: str | None) -> dict:
        """The JSONL record; a text-only sample (image None) has no "image" field."""
        s = self.spec
        rec = {"brief": self.brief, "caption": s.caption(), "image": image, "shape": s.shape,
               "color": s.color, "size": s.size, "position": s.position, "background": s.background,
               "mood": self.mood, "kind": self.kind, "layout": self.layout, "held_out": self.held_out}
        if image is None:
            del rec["image"]
        return rec


@dataclasses.dataclass(frozen=True)
class WorldStats:
    out_dir: str
    n_train: int
    n_eval: int
    n_eval_held_out: int
    n_text: int
    image_size: int
    seed: int
    held_out_pairs: tuple[tuple[str, str], ...]


# ---------------------------------------------------------------------------------------------
# Parsing: the exact inverse of the caption grammar, and keyword parsing of briefs.
# ---------------------------------------------------------------------------------------------

def _alternation(words) -> str:
    # Longest first so "pale yellow" wins over a hypothetical "yellow" prefix match.
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_CAPTION_RE = re.compile(
    rf"a (?P<size>{_alternation(SIZES)}) (?P<color>{_alternation(COLORS)}) (?P<shape>{_alternation(SHAPES)})"
    rf" in the (?P<position>{_alternation(POSITIONS)}) on a (?P<background>{_alternation(BACKGROUNDS)}) background"
)


def parse_caption(text: str) -> CaptionSpec | None:
    """Caption -> CaptionSpec, or None if `text` is not exactly one caption of the grammar.

    Tolerant to case, surrounding/extra whitespace and one trailing period (a generating LM adds those).
    """
    if not isinstance(text, str):
        return None
    norm = " ".join(text.lower().split()).rstrip(".").strip()
    m = _CAPTION_RE.fullmatch(norm)
    return CaptionSpec(**m.groupdict()) if m else None


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def parse_brief(brief: str) -> BriefSpec | None:
    """Brief -> BriefSpec by keywords, or None when the mood or kind is missing or ambiguous.

    Several layout hints in one brief is ambiguous too (None); no hint gives layout=None.
    """
    if not isinstance(brief, str):
        return None
    words = set(_words(brief))
    moods = {m for m, (_, adjs) in MOODS.items() if words & set(adjs)}
    kinds = {k for k, (_, keys, _) in KINDS.items() if words & set(keys)}
    layouts = {l for l, (_, keys, _) in LAYOUTS.items() if words & set(keys)}
    if len(moods) != 1 or len(kinds) != 1 or len(layouts) > 1:
        return None
    return BriefSpec(mood=moods.pop(), kind=kinds.pop(), layout=layouts.pop() if layouts else None)


def brief_constraints(brief: str) -> BriefConstraints:
    """Brief -> the allowed colours, shapes and positions. ValueError names the brief if it does not parse."""
    spec = parse_brief(brief)
    if spec is None:
        raise ValueError(
            f"brief {brief!r} does not name exactly one mood ({sorted(MOODS)}), one object kind "
            f"({sorted(KINDS)}) and at most one layout hint ({sorted(LAYOUTS)})")
    family = MOODS[spec.mood][0]
    positions = LAYOUTS[spec.layout][0] if spec.layout else tuple(POSITIONS)
    return BriefConstraints(brief=spec, family=family, colors=frozenset(FAMILIES[family]),
                            shapes=frozenset(KINDS[spec.kind][0]), positions=frozenset(positions))


# ---------------------------------------------------------------------------------------------
# Rendering. One function draws both the dataset images and the judge's templates.
# ---------------------------------------------------------------------------------------------

SUPERSAMPLE = 4  # draw at 4x, box-downsample: pixel value = exact-ish area coverage (anti-aliasing)


def shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    """Vertices of `shape` with bounding box [cx-r, cx+r] x [cy-r, cy+r] (pixels, y down); None for circle."""
    if shape == "circle":
        return None
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":  # apex up, base down: centroid sits r/3 below the box centre
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "cross":  # plus sign, arms one third of the box wide
        a = r / 3
        return [(cx - a, cy - r), (cx + a, cy - r), (cx + a, cy - a), (cx + r, cy - a), (cx + r, cy + a),
                (cx + a, cy + a), (cx + a, cy + r), (cx - a, cy + r), (cx - a, cy + a), (cx - r, cy + a),
                (cx - r, cy - a), (cx - a, cy - a)]
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def render_mask(shape: str, cx: float, cy: float, r: float, size: int) -> Image.Image:
    """Anti-aliased coverage mask (mode "L", size x size) of a shape; centre and r in pixels."""
    k = SUPERSAMPLE
    canvas = Image.new("L", (size * k, size * k), 0)
    draw = ImageDraw.Draw(canvas)
    # PIL fills pixel (i, j) when its centre is inside; shifting by -0.5 makes pixel i cover [i, i+1).
    scx, scy, sr = cx * k - 0.5, cy * k - 0.5, r * k
    poly = shape_polygon(shape, scx, scy, sr)
    if poly is None:
        draw.ellipse([scx - sr, scy - sr, scx + sr, scy + sr], fill=255)
    else:
        draw.polygon(poly, fill=255)
    return canvas.resize((size, size), Image.Resampling.BOX)


def shape_center(spec: CaptionSpec, rng: random.Random) -> tuple[float, float]:
    """Box centre (x, y) as fractions of the side: the cell centre plus uniform jitter."""
    row, col = POSITIONS[spec.position]
    return (CELL_CENTERS[col] + rng.uniform(-JITTER, JITTER), CELL_CENTERS[row] + rng.uniform(-JITTER, JITTER))


def render(spec: CaptionSpec, image_size: int, center: tuple[float, float] | None = None) -> Image.Image:
    """Draw `spec` as an RGB image_size x image_size image; center defaults to the exact cell centre."""
    if image_size < 24:
        raise ValueError(f"image_size={image_size} is too small for the shapes world; use >= 24 (32 or 64)")
    if center is None:
        row, col = POSITIONS[spec.position]
        center = (CELL_CENTERS[col], CELL_CENTERS[row])
    r = SIZES[spec.size]
    cx, cy = center
    if min(cx - r, cy - r) < 0 or max(cx + r, cy + r) > 1:
        raise ValueError(f"shape of {spec} at centre {center} leaves the canvas")
    s = image_size
    mask = render_mask(spec.shape, cx * s, cy * s, r * s, s)
    bg = Image.new("RGB", (s, s), BACKGROUNDS[spec.background])
    fg = Image.new("RGB", (s, s), COLORS[spec.color])
    return Image.composite(fg, bg, mask)


# ---------------------------------------------------------------------------------------------
# Sampling and the world on disk.
# ---------------------------------------------------------------------------------------------

def _brief_text(rng: random.Random, mood: str, kind: str, layout: str | None, phrase: str | None = None) -> str:
    template = rng.choice(BRIEF_TEMPLATES)
    adj = rng.choice(MOODS[mood][1])
    noun = rng.choice(KINDS[kind][2])
    hint = f", {phrase or rng.choice(LAYOUTS[layout][2])}" if layout else ""
    return template.format(mood=adj, kind=noun, layout=hint)


# Every (layout, phrase) of the briefs, in a fixed order: the text-only samples cycle through it (see generate_world).
LAYOUT_PHRASES: tuple[tuple[str, str], ...] = tuple((l, p) for l in sorted(LAYOUTS) for p in LAYOUTS[l][2])


def sample_one(rng: random.Random, held_out: frozenset[tuple[str, str]], want_held_out: bool | None,
               hint: tuple[str, str] | None = None) -> Sample:
    """Draw one sample. want_held_out: True forces a held-out (colour, shape) pair, False forbids one,
    None allows both (rejection sampling keeps the brief distribution otherwise unchanged).
    hint: a (layout, phrase) of LAYOUT_PHRASES the brief must end with; None draws the layout as the splits do
    (no hint with probability 1 - LAYOUT_PROBABILITY)."""
    while True:
        mood = rng.choice(sorted(MOODS))
        kind = rng.choice(sorted(KINDS))
        if hint is not None:
            layout = hint[0]
        else:
            layout = rng.choice(sorted(LAYOUTS)) if rng.random() < LAYOUT_PROBABILITY else None
        color = rng.choice(FAMILIES[MOODS[mood][0]])
        shape = rng.choice(KINDS[kind][0])
        is_held = (color, shape) in held_out
        if want_held_out is None or want_held_out == is_held:
            break
    positions = LAYOUTS[layout][0] if layout else tuple(POSITIONS)
    spec = CaptionSpec(size=rng.choice(tuple(SIZES)), color=color, shape=shape,
                       position=rng.choice(positions), background=rng.choice(tuple(BACKGROUNDS)))
    brief = _brief_text(rng, mood, kind, layout, hint[1] if hint else None)
    return Sample(brief=brief, mood=mood, kind=kind, layout=layout, spec=spec, center=shape_center(spec, rng),
                  held_out=is_held)


def _check_held_out(held_out: frozenset[tuple[str, str]]) -> None:
    for pair in held_out:
        if len(pair) != 2 or pair[0] not in COLORS or pair[1] not in SHAPES:
            raise ValueError(f"held-out pair {pair!r} is not (colour in {tuple(COLORS)}, shape in {SHAPES})")
    # Every colour and every shape must stay trainable, and every held-out pair must be reachable.
    for c in COLORS:
        if all((c, s) in held_out for s in SHAPES):
            raise ValueError(f"held-out pairs remove colour {c!r} from train entirely")
    for s in SHAPES:
        if all((c, s) in held_out for c in COLORS):
            raise ValueError(f"held-out pairs remove shape {s!r} from train entirely")


def generate_world(out_dir: str | Path, n: int, seed: int, image_size: int = 64, eval_fraction: float = 0.1,
                   held_out: frozenset[tuple[str, str]] = HELD_OUT_PAIRS, n_text: int = 0) -> WorldStats:
    """Write a world of `n` samples with images (train + eval) and `n_text` text-only train samples to out_dir;
    deterministic in all arguments."""
    if n < 2:
        raise UsageError(f"n={n}: need at least 2 samples (one train, one eval)")
    if n_text < 0:
        raise UsageError(f"n_text={n_text}: the number of text-only samples cannot be negative")
    if not 0.0 < eval_fraction < 1.0:
        raise UsageError(f"eval_fraction={eval_fraction} must lie in (0, 1)")
    if image_size < 24:
        raise UsageError(f"image_size={image_size} is too small for the shapes world; use >= 24 (32 or 64)")
    held_out = frozenset(tuple(p) for p in held_out)
    _check_held_out(held_out)
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    n_train = n - n_eval
    n_held = (n_eval + 1) // 2 if held_out else 0
    rng = random.Random(seed)
    splits = {
        "train": [sample_one(rng, held_out, False) for _ in range(n_train)],
        "eval": [sample_one(rng, held_out, i < n_held) for i in range(n_eval)],
    }
    # Drawn last, so the image splits stay the same. Each text-only brief carries a layout hint, cycling through
    # every (layout, phrase) in turn: drawn like the splits' (none in 40% of briefs, else 1 of 6 layouts), only 19%
    # of the designer's briefs said left or right, 32% now (every phrase in n_text/17 text-only briefs). More
    # signal for the layout learnt last; the demo's designer also needs its 4500 steps for it (docs/demo.md).
    text_only = [sample_one(rng, held_out, False, LAYOUT_PHRASES[i % len(LAYOUT_PHRASES)]) for i in range(n_text)]
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    records: dict[str, list[dict]] = {}
    for split, samples in splits.items():
        records[split] = []
        for i, sample in enumerate(samples):
            rel = f"images/{split}_{i:05d}.png"
            render(sample.spec, image_size, sample.center).save(out / rel, format="PNG")
            records[split].append(sample.record(rel))

    def write_lines(name: str, lines: Sequence[str]) -> None:
        (out / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")

    for split in ("train", "eval"):
        write_lines(f"{split}.jsonl", [json.dumps(r) for r in records[split]])
    designer_rows = records["train"] + [sample.record(None) for sample in text_only]
    write_lines("designer_train.jsonl", [json.dumps(r) for r in designer_rows])
    write_lines("captions.jsonl",
                [json.dumps({"image": r["image"], "caption": r["caption"]}) for r in records["train"]])
    write_lines("briefs_eval.txt", [r["brief"] for r in records["eval"]])
    vocab_line = " ".join([*SHAPES, *COLORS, *BACKGROUNDS, *SIZES, *POSITIONS])
    write_lines("corpus.txt", [t for r in records["train"] for t in (r["brief"], r["caption"])] + [vocab_line])
    stats = WorldStats(out_dir=str(out), n_train=n_train, n_eval=n_eval,
                       n_eval_held_out=sum(r["held_out"] for r in records["eval"]), n_text=n_text,
                       image_size=image_size, seed=seed, held_out_pairs=tuple(sorted(held_out)))
    world = {"stats": dataclasses.asdict(stats), "colors": COLORS, "backgrounds": BACKGROUNDS, "sizes": SIZES,
             "shapes": SHAPES, "positions": list(POSITIONS), "families": FAMILIES}
    (out / "world.json").write_text(json.dumps(world, indent=1) + "\n", encoding="utf-8")
    return stats


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atelier_studio.data.synthetic",
                                description="Write a shapes world to disk.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--n", type=int, required=True, help="total samples, train + eval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=64, help="pixels per side (the CPU demo uses 32)")
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--n-text", type=int, default=0, help="text-only train samples (briefs and captions, no images)")
    args = p.parse_args(argv)
    try:
        stats = generate_world(args.out, args.n, args.seed, args.image_size, args.eval_fraction, n_text=args.n_text)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(stats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
