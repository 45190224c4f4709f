"""A programmatic judge for the shapes world: classical image analysis, numpy only.

Shape legend: S image side (pixels), image arrays are S x S x 3 float RGB in 0..255, masks S x S.

`read_image` recovers what an image shows, in five steps:
    1. background = per-channel median of the border ring -> nearest named background
    2. foreground = pixels farther than FG_DISTANCE from the background; keep the largest
       8-connected component (stray noise pixels and specks never win)
    3. colour     = median of the component's core pixels -> nearest named colour (within COLOR_TOLERANCE)
    4. coverage   = alpha in [0, 1]: each pixel's projection on the background -> colour line, inside the
       component dilated by 2 px, so anti-aliased and blurred edges count by how much they are covered
    5. shape      = analysis by synthesis: for every shape, the area of alpha fixes its half-extent r and
       the centroid of alpha fixes its box centre (one calibration render corrects both for the
       rasteriser); render that shape with the dataset's own renderer, sharp and slightly blurred, and
       keep the one with the least L1 error. The winner gives position (grid cell of the box centre) and
       size (nearest half-extent). A best error above MAX_TEMPLATE_ERROR means "no shape here" (noise).

`judge_image(image, spec)` compares a reading with a caption, `judge_image_brief(image, brief)` with a
brief's constraints, `judge_caption(caption, brief)` a caption with a brief; `judge_batch` and
`judge_caption_batch` average them.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence, Union

import numpy as np
from PIL import Image, ImageFilter

from atelier_studio.data.synthetic import (
    BACKGROUNDS,
    CELL_CENTERS,
    COLORS,
    POSITIONS,
    SHAPES,
    SIZES,
    CaptionSpec,
    brief_constraints,
    parse_caption,
    render_mask,
)

ImageLike = Union[Image.Image, np.ndarray, str, Path]

FG_DISTANCE = 70.0          # RGB distance from the background that marks foreground; >= 150 separates every pair
COLOR_TOLERANCE = 70.0      # a colour farther than this from every named colour is no named colour
BACKGROUND_TOLERANCE = 45.0  # same for backgrounds; named backgrounds are >= 45 apart, so nearest still decides
MAX_TEMPLATE_ERROR = 0.45   # L1(alpha - template) / template area: clean ~0.01, noisy+blurred <= 0.36, noise > 1
TEMPLATE_BLURS = (0.0, 0.6, 1.0)  # Gaussian sigmas (pixels) tried for every template
MIN_PIXELS = 6              # a component smaller than this is a speck, not a shape

# Area of each shape's coverage in units of r^2 (r = half-extent of the bounding box).
AREA_FACTOR = {"circle": math.pi, "square": 4.0, "triangle": 2.0, "diamond": 2.0, "cross": 20.0 / 9.0}
# Box centre minus alpha centroid, in units of r, along y: the triangle's centroid is r/3 below its box centre.
CENTROID_OFFSET_Y = {"circle": 0.0, "square": 0.0, "triangle": -1.0 / 3.0, "diamond": 0.0, "cross": 0.0}


@dataclasses.dataclass(frozen=True)
class ImageReading:
    """What the judge sees. Names are None where nothing in the vocabulary fits."""

    detected: bool
    shape: str | None
    color: str | None
    size: str | None
    position: str | None
    background: str | None
    template_error: float            # best L1 template error (inf when nothing was found)
    center: tuple[float, float] | None  # box centre (x, y), fractions of the side
    radius: float | None             # half-extent, fraction of the side
    fg_rgb: tuple[float, float, float] | None
    bg_rgb: tuple[float, float, float]


@dataclasses.dataclass(frozen=True)
class ImageScore:
    """An image against a caption; score = mean of the five checks."""

    shape_ok: bool
    color_ok: bool
    position_ok: bool
    size_ok: bool
    background_ok: bool
    score: float
    reading: ImageReading


@dataclasses.dataclass(frozen=True)
class BriefImageScore:
    """An image against a brief (colour family, shape set, position set); score = mean of the three."""

    detected: bool
    color_ok: bool
    shape_ok: bool
    position_ok: bool
    score: float
    reading: ImageReading


@dataclasses.dataclass(frozen=True)
class CaptionScore:
    """A caption against a brief; unparsable captions score 0 everywhere."""

    parsed: bool
    color_ok: bool
    shape_ok: bool
    position_ok: bool
    score: float


@dataclasses.dataclass(frozen=True)
class BatchScore:
    """Means over a batch: `fields` maps each check (e.g. "shape_ok") to its accuracy."""

    n: int
    fields: dict[str, float]
    score: float


# ---------------------------------------------------------------------------------------------
# Image analysis
# ---------------------------------------------------------------------------------------------

def to_array(image: ImageLike) -> np.ndarray:
    """PIL image, path, or S x S x 3 array (uint8 in 0..255, float in 0..1) -> S x S x 3 float64 in 0..255."""
    if isinstance(image, (str, Path)):
        with Image.open(image) as im:
            return np.asarray(im.convert("RGB"), dtype=np.float64)
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.float64)
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.shape[0] != image.shape[1] or image.shape[0] < 8:
            raise ValueError(f"image array has shape {image.shape}; expected (S, S, 3) with S >= 8")
        if image.dtype == np.uint8:
            return image.astype(np.float64)
        if np.issubdtype(image.dtype, np.floating):
            if not np.isfinite(image).all():
                raise ValueError("image array contains NaN or inf")
            return np.clip(image.astype(np.float64), 0.0, 1.0) * 255.0
        raise ValueError(f"image array has dtype {image.dtype}; expected uint8 (0..255) or float (0..1)")
    raise TypeError(f"cannot judge a {type(image).__name__}; pass a PIL image, a path or an (S, S, 3) array")


def _nearest(rgb: np.ndarray, table: dict[str, tuple[int, int, int]], tolerance: float) -> str | None:
    names = list(table)
    d = np.linalg.norm(np.asarray([table[n] for n in names], dtype=np.float64) - rgb, axis=1)
    i = int(np.argmin(d))
    return names[i] if d[i] <= tolerance else None


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """Largest 8-connected component of a boolean S x S mask (iterative flood fill over mask pixels)."""
    h, w = mask.shape
    label = np.zeros((h, w), dtype=np.int32)
    best, best_size, current = 0, 0, 0
    for y0, x0 in np.argwhere(mask):
        if label[y0, x0]:
            continue
        current += 1
        label[y0, x0] = current
        stack, size = [(y0, x0)], 0
        while stack:
            y, x = stack.pop()
            size += 1
            for yy in range(max(y - 1, 0), min(y + 2, h)):
                for xx in range(max(x - 1, 0), min(x + 2, w)):
                    if mask[yy, xx] and not label[yy, xx]:
                        label[yy, xx] = current
                        stack.append((yy, xx))
        if size > best_size:
            best, best_size = current, size
    return label == best if best else np.zeros_like(mask)


def _dilate(mask: np.ndarray, steps: int) -> np.ndarray:
    for _ in range(steps):
        p = np.pad(mask, 1)
        mask = np.zeros_like(mask)
        for dy in range(3):
            for dx in range(3):
                mask |= p[dy:dy + mask.shape[0], dx:dx + mask.shape[1]]
    return mask


def _floats(v: np.ndarray) -> tuple[float, float, float]:
    return tuple(float(x) for x in v)  # plain floats so a reading serialises to JSON


def _cell(v: float) -> int:
    # Boundaries halfway between the cell centres (0.375 and 0.625).
    return int(np.searchsorted([(CELL_CENTERS[0] + CELL_CENTERS[1]) / 2, (CELL_CENTERS[1] + CELL_CENTERS[2]) / 2], v))


def read_image(image: ImageLike) -> ImageReading:
    """Recover shape, colour, size, position and background from one image (see the module docstring)."""
    px = to_array(image)  # S x S x 3
    s = px.shape[0]
    ring = max(1, s // 32)
    border = np.concatenate([px[:ring].reshape(-1, 3), px[-ring:].reshape(-1, 3),
                             px[:, :ring].reshape(-1, 3), px[:, -ring:].reshape(-1, 3)])  # N x 3
    bg = np.median(border, axis=0)
    background = _nearest(bg, BACKGROUNDS, BACKGROUND_TOLERANCE)
    nothing = ImageReading(False, None, None, None, None, background, math.inf, None, None, None, _floats(bg))

    dist = np.linalg.norm(px - bg, axis=2)  # S x S
    comp = _largest_component(dist > FG_DISTANCE)
    if comp.sum() < MIN_PIXELS:
        return nothing
    # Core pixels (far from the background) carry the pure colour; edges are blends with the background.
    d = dist[comp]
    core = px[comp][d >= 0.8 * np.percentile(d, 90)]  # K x 3
    fg = np.median(core, axis=0)
    color = _nearest(fg, COLORS, COLOR_TOLERANCE)

    # Small or blurred shapes have few pure pixels, so the median is pulled towards the background; the
    # palette's exact RGB is the better end point of the alpha axis whenever the colour was recognised.
    axis = (np.asarray(COLORS[color], dtype=np.float64) if color else fg) - bg
    alpha = ((px - bg) @ axis) / float(axis @ axis)  # S x S
    # Unclipped inside the region: pixel noise then averages out of area and centroid instead of adding a
    # positive bias (clipping at 0 inflates a small shape's area by ~10% at noise sigma 0.08).
    alpha = np.where(_dilate(comp, 2), alpha, 0.0)
    area = alpha.sum()
    if not area > 0:  # the region leans away from its own colour (a noisy render): no shape to read, not a crash
        return dataclasses.replace(nothing, fg_rgb=_floats(fg))
    ys, xs = np.mgrid[0:s, 0:s] + 0.5  # pixel centres; pixel i covers [i, i+1)
    cx, cy = (alpha * xs).sum() / area, (alpha * ys).sum() / area

    best = (math.inf, None, 0.0, 0.0, 0.0)
    for shape in SHAPES:
        r = math.sqrt(area / AREA_FACTOR[shape])
        bx, by = cx, cy + CENTROID_OFFSET_Y[shape] * r
        # One calibration step: the rasteriser's area and centroid differ from the ideal shape's by a
        # fraction of a pixel, which matters at 32 px; match both exactly before comparing.
        t = np.asarray(render_mask(shape, bx, by, r, s), dtype=np.float64) / 255.0
        t_area = t.sum()
        if t_area > 0:
            r *= math.sqrt(area / t_area)
            bx += cx - (t * xs).sum() / t_area
            by += cy - (t * ys).sum() / t_area
        mask = render_mask(shape, bx, by, r, s)
        for blur in TEMPLATE_BLURS:
            # A generator's output is slightly soft; blurring the template too keeps thin arms (cross) and
            # tips (diamond) from losing to a rounder shape on a blurred image.
            t = mask.filter(ImageFilter.GaussianBlur(blur)) if blur else mask
            template = np.asarray(t, dtype=np.float64) / 255.0
            err = np.abs(alpha - template).sum() / max(template.sum(), 1e-6)
            if err < best[0]:
                best = (err, shape, bx, by, r)
    err, shape, bx, by, r = best
    if err > MAX_TEMPLATE_ERROR:
        return dataclasses.replace(nothing, template_error=float(err), fg_rgb=_floats(fg))
    size = min(SIZES, key=lambda k: abs(SIZES[k] - r / s))
    cell = (_cell(by / s), _cell(bx / s))
    position = next(name for name, rc in POSITIONS.items() if rc == cell)
    return ImageReading(True, shape, color, size, position, background, float(err),
                        (float(bx / s), float(by / s)), float(r / s), _floats(fg), _floats(bg))


# ---------------------------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------------------------

def _spec(spec: CaptionSpec | str) -> CaptionSpec:
    if isinstance(spec, CaptionSpec):
        return spec
    parsed = parse_caption(spec)
    if parsed is None:
        raise ValueError(f"caption {spec!r} does not follow the shapes-world grammar; cannot judge an image by it")
    return parsed


def judge_image(image: ImageLike, spec: CaptionSpec | str) -> ImageScore:
    """Score an image against the caption it was meant to show."""
    spec = _spec(spec)
    r = read_image(image)
    checks = (r.detected and r.shape == spec.shape, r.detected and r.color == spec.color,
              r.detected and r.position == spec.position, r.detected and r.size == spec.size,
              r.background == spec.background)
    return ImageScore(*checks, score=sum(checks) / len(checks), reading=r)


def judge_image_brief(image: ImageLike, brief: str) -> BriefImageScore:
    """Score an image against a brief: colour in the mood's family, shape of the kind, position in the hint."""
    c = brief_constraints(brief)
    r = read_image(image)
    checks = (r.color in c.colors, r.shape in c.shapes, r.position in c.positions)
    checks = tuple(r.detected and ok for ok in checks)
    return BriefImageScore(r.detected, *checks, score=sum(checks) / len(checks), reading=r)


def judge_caption(caption: str, brief: str) -> CaptionScore:
    """Score a designer's caption against the brief it answers; ValueError if the brief itself does not parse."""
    c = brief_constraints(brief)
    spec = parse_caption(caption)
    if spec is None:
        return CaptionScore(False, False, False, False, 0.0)
    checks = (spec.color in c.colors, spec.shape in c.shapes, spec.position in c.positions)
    return CaptionScore(True, *checks, score=sum(checks) / len(checks))


def summarize(scores: Sequence[ImageScore | BriefImageScore | CaptionScore]) -> BatchScore:
    """Mean of every boolean check and of `score` over a non-empty batch of one score type."""
    if not scores:
        raise ValueError("cannot summarize an empty batch of scores")
    kinds = {type(x) for x in scores}
    if len(kinds) != 1:
        raise ValueError(f"batch mixes score types {sorted(k.__name__ for k in kinds)}")
    names = [f.name for f in dataclasses.fields(scores[0]) if f.type in ("bool", bool)]
    fields = {n: float(np.mean([getattr(x, n) for x in scores])) for n in names}
    return BatchScore(n=len(scores), fields=fields, score=float(np.mean([x.score for x in scores])))


def judge_batch(images: Sequence[ImageLike], specs: Sequence[CaptionSpec | str]) -> BatchScore:
    """Mean per-field accuracy of images against their captions."""
    if len(images) != len(specs):
        raise ValueError(f"judge_batch got {len(images)} images but {len(specs)} captions")
    return summarize([judge_image(im, sp) for im, sp in zip(images, specs)])


def judge_caption_batch(captions: Sequence[str], briefs: Sequence[str]) -> BatchScore:
    """Mean per-field accuracy of captions against their briefs."""
    if len(captions) != len(briefs):
        raise ValueError(f"judge_caption_batch got {len(captions)} captions but {len(briefs)} briefs")
    return summarize([judge_caption(c, b) for c, b in zip(captions, briefs)])
