"""Tests for data/synthetic.py: vocabulary, grammar round trips, determinism, held-out split, files."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from atelier_studio.data import synthetic as syn
from atelier_studio.data.synthetic import (
    BACKGROUNDS,
    COLORS,
    FAMILIES,
    HELD_OUT_PAIRS,
    KINDS,
    LAYOUT_PHRASES,
    LAYOUTS,
    MOODS,
    POSITIONS,
    SHAPES,
    SIZES,
    CaptionSpec,
    brief_constraints,
    generate_world,
    parse_brief,
    parse_caption,
    render,
)


def _dist(a, b) -> float:
    return float(np.linalg.norm(np.subtract(a, b, dtype=np.float64)))


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, syn.WorldStats]:
    out = tmp_path_factory.mktemp("world")
    return out, generate_world(out, n=400, seed=3, image_size=32, eval_fraction=0.2)


# --- vocabulary ------------------------------------------------------------------------------------

def test_palette_contrast():
    # Every foreground must stand out on every background, and colours must be far enough apart to classify.
    assert min(_dist(c, b) for c in COLORS.values() for b in BACKGROUNDS.values()) >= 150
    assert min(_dist(a, b) for a, b in itertools.combinations(COLORS.values(), 2)) >= 80
    assert min(_dist(a, b) for a, b in itertools.combinations(BACKGROUNDS.values(), 2)) >= 45
    assert sorted(c for fam in FAMILIES.values() for c in fam) == sorted(COLORS)


def test_brief_keywords_are_unambiguous():
    keys = [*(w for _, adjs in MOODS.values() for w in adjs), *(w for _, ks, _ in KINDS.values() for w in ks),
            *(w for _, ks, _ in LAYOUTS.values() for w in ks)]
    assert len(keys) == len(set(keys))
    # Template filler words must not carry a keyword, or every brief would gain a second mood/kind/layout.
    filler = set(re.findall(r"[a-z]+", " ".join(syn.BRIEF_TEMPLATES).replace("{mood}", "").replace("{kind}", "")
                            .replace("{layout}", "")))
    assert not filler & set(keys)
    for mood, (_, adjs) in MOODS.items():
        for kind, (_, _, phrases) in KINDS.items():
            for adj, phrase in itertools.product(adjs, phrases):
                assert parse_brief(f"something {adj} with {phrase}") == syn.BriefSpec(mood, kind, None)
    for layout, (_, _, phrases) in LAYOUTS.items():
        for phrase in phrases:
            assert parse_brief(f"a calm poster, a circle, {phrase}").layout == layout


def test_shapes_fit_the_canvas_at_every_jitter():
    r_max = max(SIZES.values())
    assert min(syn.CELL_CENTERS) - syn.JITTER - r_max > 0
    assert max(syn.CELL_CENTERS) + syn.JITTER + r_max < 1


# --- caption grammar ---------------------------------------------------------------------------------

def test_every_caption_parses_back():
    for size, color, shape, pos, bg in itertools.product(SIZES, COLORS, SHAPES, POSITIONS, BACKGROUNDS):
        spec = CaptionSpec(size, color, shape, pos, bg)
        assert parse_caption(spec.caption()) == spec


def test_parse_caption_tolerates_whitespace_case_and_period():
    spec = CaptionSpec("small", "blue", "circle", "upper left", "pale yellow")
    assert parse_caption("  A small  Blue circle\tin the upper   left on a pale\nyellow background. ") == spec


@pytest.mark.parametrize("text", [
    "", "a small blue circle", "a tiny blue circle in the upper left on a white background",
    "a small magenta circle in the upper left on a white background",
    "a small blue circle in the upper left on a white background and a red square",
    "small blue circle in the upper left on a white background", None, 42,
])
def test_parse_caption_rejects_non_captions(text):
    assert parse_caption(text) is None


def test_brief_constraints_and_errors():
    c = brief_constraints("a soothing poster, round shapes, left side")
    assert c.family == "cool" and c.colors == frozenset(FAMILIES["cool"])
    assert c.shapes == {"circle"} and c.positions == {"upper left", "center left", "lower left"}
    assert brief_constraints("something bold and angular").positions == frozenset(POSITIONS)
    assert parse_brief("calm and bold with a circle") is None             # two moods
    assert parse_brief("something calm, on the left, at the top, a circle") is None  # two layouts
    with pytest.raises(ValueError, match="a poster for a jazz night"):
        brief_constraints("a poster for a jazz night")


# --- rendering --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [32, 64])
def test_render_shape_inside_canvas_with_exact_colours(size):
    rng = random.Random(0)
    for _ in range(50):
        s = syn.sample_one(rng, HELD_OUT_PAIRS, None)
        a = np.asarray(render(s.spec, size, s.center))
        assert a.shape == (size, size, 3)
        border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
        assert (border == BACKGROUNDS[s.spec.background]).all()   # nothing touches the edge
        assert (a == COLORS[s.spec.color]).all(axis=2).sum() >= 9  # a solid core of the exact colour


def test_render_rejects_bad_input():
    spec = CaptionSpec("large", "red", "square", "upper left", "white")
    with pytest.raises(ValueError, match="leaves the canvas"):
        render(spec, 32, center=(0.1, 0.5))
    with pytest.raises(ValueError, match="image_size=8"):
        render(spec, 8)
    with pytest.raises(ValueError, match="unknown shape 'hexagon'"):
        syn.shape_polygon("hexagon", 0, 0, 1)


# --- the world on disk --------------------------------------------------------------------------------------

def test_world_files_and_records(world):
    out, stats = world
    train, ev = _read_jsonl(out / "train.jsonl"), _read_jsonl(out / "eval.jsonl")
    assert (len(train), len(ev)) == (stats.n_train, stats.n_eval) == (320, 80)
    keys = {"brief", "caption", "image", "shape", "color", "size", "position", "background", "mood", "kind",
            "layout", "held_out"}
    for rec in train + ev:
        assert set(rec) == keys
        spec = parse_caption(rec["caption"])
        assert spec == CaptionSpec(rec["size"], rec["color"], rec["shape"], rec["position"], rec["background"])
        c = brief_constraints(rec["brief"])
        assert (c.brief.mood, c.brief.kind, c.brief.layout) == (rec["mood"], rec["kind"], rec["layout"])
        assert spec.color in c.colors and spec.shape in c.shapes and spec.position in c.positions
        with Image.open(out / rec["image"]) as im:
            assert im.size == (32, 32) and im.mode == "RGB"
    assert (out / "briefs_eval.txt").read_text().splitlines() == [r["brief"] for r in ev]
    caps = _read_jsonl(out / "captions.jsonl")
    assert caps == [{"image": r["image"], "caption": r["caption"]} for r in train]
    corpus = (out / "corpus.txt").read_text()
    for word in [*SHAPES, *COLORS, *BACKGROUNDS, *POSITIONS]:
        assert word in corpus
    assert json.loads((out / "world.json").read_text())["stats"]["n_eval_held_out"] == stats.n_eval_held_out


def test_held_out_pairs_only_in_eval(world):
    out, stats = world
    train, ev = _read_jsonl(out / "train.jsonl"), _read_jsonl(out / "eval.jsonl")
    train_pairs = {(r["color"], r["shape"]) for r in train}
    assert not train_pairs & HELD_OUT_PAIRS
    assert {r["color"] for r in train} == set(COLORS) and {r["shape"] for r in train} == set(SHAPES)
    held = [r for r in ev if r["held_out"]]
    assert len(held) == stats.n_eval_held_out == 40
    assert all((r["color"], r["shape"]) in HELD_OUT_PAIRS for r in held)
    assert all((r["color"], r["shape"]) not in HELD_OUT_PAIRS for r in ev if not r["held_out"])
    assert len({(r["color"], r["shape"]) for r in held}) >= 4  # several held-out pairs, not one


def test_text_only_samples_extend_the_designer_data_and_leave_the_splits_alone(world, tmp_path):
    """designer_train.jsonl = train.jsonl's rows, then n_text rows drawn like train but with no image; the image
    splits and every image file are those of the same world without text-only samples."""
    out, stats = world
    assert _read_jsonl(out / "designer_train.jsonl") == _read_jsonl(out / "train.jsonl")  # n_text = 0
    more = tmp_path / "more"
    more_stats = generate_world(more, n=400, seed=3, image_size=32, eval_fraction=0.2, n_text=150)
    assert more_stats.n_text == 150 and (more_stats.n_train, more_stats.n_eval) == (stats.n_train, stats.n_eval)
    for name in ("train.jsonl", "eval.jsonl", "captions.jsonl", "briefs_eval.txt", "corpus.txt"):
        assert (more / name).read_bytes() == (out / name).read_bytes(), name
    assert sorted(p.name for p in (more / "images").iterdir()) == sorted(p.name for p in (out / "images").iterdir())
    rows = _read_jsonl(more / "designer_train.jsonl")
    assert rows[:stats.n_train] == _read_jsonl(out / "train.jsonl")
    text = rows[stats.n_train:]
    assert len(text) == 150 and all("image" not in r and not r["held_out"] for r in text)
    for r in text:  # each caption is one the brief allows, and no held-out pair appears
        spec, c = parse_caption(r["caption"]), brief_constraints(r["brief"])
        assert spec.color in c.colors and spec.shape in c.shapes and spec.position in c.positions
        assert (spec.color, spec.shape) not in HELD_OUT_PAIRS
    assert len({r["brief"] for r in text}) > 100  # new briefs, not copies of the train ones
    # every text-only brief states a layout, and every (layout, phrase) is stated as often as any other (+-1)
    said = [next((p for _, p in LAYOUT_PHRASES if r["brief"].endswith(", " + p)), None) for r in text]
    assert None not in said and all(parse_brief(r["brief"]).layout == r["layout"] for r in text)
    phrases = Counter(said)
    assert sorted(phrases) == sorted(p for _, p in LAYOUT_PHRASES)
    assert max(phrases.values()) - min(phrases.values()) <= 1
    with pytest.raises(ValueError, match="n_text=-1"):
        generate_world(tmp_path / "bad", n=10, seed=0, n_text=-1)


def test_determinism_by_seed(tmp_path):
    def files(d: Path) -> dict[str, bytes]:
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    a, b, c = (generate_world(tmp_path / name, n=40, seed=seed, image_size=32, eval_fraction=0.25)
               for name, seed in (("a", 7), ("b", 7), ("c", 8)))
    fa, fb, fc = files(tmp_path / "a"), files(tmp_path / "b"), files(tmp_path / "c")
    assert fa.keys() == fb.keys() and all(fa[k] == fb[k] for k in fa if k != "world.json")
    assert fa["train.jsonl"] != fc["train.jsonl"]
    assert (a.n_train, a.n_eval) == (b.n_train, b.n_eval) == (30, 10)


def test_generate_world_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="eval_fraction=1.5"):
        generate_world(tmp_path, n=10, seed=0, eval_fraction=1.5)
    with pytest.raises(ValueError, match="n=1"):
        generate_world(tmp_path, n=1, seed=0)
    with pytest.raises(ValueError, match="remove colour 'blue'"):
        generate_world(tmp_path, n=10, seed=0, held_out=frozenset(("blue", s) for s in SHAPES))
    with pytest.raises(ValueError, match="'magenta'"):
        generate_world(tmp_path, n=10, seed=0, held_out=frozenset({("magenta", "circle")}))


def test_main_cli(tmp_path, capsys):
    assert syn.main(["--out", str(tmp_path / "w"), "--n", "12", "--seed", "1", "--image-size", "32",
                     "--n-text", "5"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["n_train"], stats["n_eval"], stats["image_size"], stats["n_text"]) == (11, 1, 32, 5)
    assert len((tmp_path / "w" / "train.jsonl").read_text().splitlines()) == 11
    assert len((tmp_path / "w" / "designer_train.jsonl").read_text().splitlines()) == 16
    assert syn.main(["--out", str(tmp_path / "x"), "--n", "12", "--eval-fraction", "0"]) == 2
    assert "eval_fraction=0.0" in capsys.readouterr().err
