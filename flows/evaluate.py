"""Flow `brief-to-image-eval`: briefs → designer captions → imagegen images → scores.

    atelier eval --designer runs/d1/model --imagegen runs/i1/ema --briefs runs/world/briefs_eval.txt --out runs/eval
        [--clip models/clip-vit-large-patch14]
    python -m atelier_studio.flows.evaluate --designer ... --imagegen ... --briefs ... --out ... [--clip DIR]
        (as a Prefect flow)

Steps, each a plain function taking and returning paths (the flow wraps each in a task):
    1. `read_briefs`      briefs file → list of briefs, any text (.txt: one per line; .jsonl: {"brief": ...} per
                          line); a bad line is an error naming file:line
    2. `write_captions`   designer.generate.generate_captions → <out>/captions.jsonl ({brief, caption})
    3. `render_images`    imagegen.sample.sample_to_dir → <out>/images/*.png, one per non-empty caption, and
                          <out>/images.json (caption row → image path, null for an empty caption: scores 0)
    4. `judge`            → <out>/scores.json (per brief + aggregate + caption statistics + which scores ran),
                          <out>/scores.csv, <out>/grid.png, <out>/summary.md

`evaluate_captions` judges given captions without the designer (`atelier eval --captions FILE`): a JSONL of
{"brief", "caption"} rows, such as the shapes world's eval.jsonl. With an imagegen it measures the imagegen alone
on those captions; without one it judges the images the rows name (the world's own renders), which measures the
judge itself.

What scores a brief gets: a shapes-world brief (data/synthetic.py's grammar) is judged by data/judge.py (colour,
shape and position of the image against the brief, the caption against the brief); with `clip` (a local
transformers CLIP directory, data/clip_score.py) every image also gets CLIP scores against its brief and its
caption, which is the only score a brief outside the shapes world can get. A brief no scorer applies to is
listed as not scored. scores.json's "scores_run" and the summary say which scores ran on how many briefs.

`designer` is a model directory (config.json + safetensors), a PEFT adapter directory
(adapter_config.json; its base model is read from it) or a run directory (its summary.json exports);
`imagegen` is a run's ema/, transformer/, lora_ema/ or lora/ directory, an SD3 pipeline directory, or a run
directory (ema/ preferred, then lora_ema/, transformer/, lora/).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from prefect import flow, task

from atelier_studio.data.textfile import iter_json_lines, iter_lines, read_json
from atelier_studio.flows.report import image_markdown, in_prefect_run, make_grid
from atelier_studio.flows.training import FlowInputError
from atelier_studio.pipeline.atomic import atomic_file, atomic_write_text, new_output_dir

GRID_MAX_IMAGES = 64


# ----------------------------------------------------------------------------- inputs


def read_briefs(path: str | Path) -> list[str]:
    """Briefs (any text) from a .txt (one per line) or .jsonl ({"brief": ...}) file; blank lines skipped; errors name
    file:line."""
    return [brief for _, brief in read_brief_lines(path)]


def read_brief_lines(path: str | Path) -> list[tuple[str, str]]:
    """("file:line", brief) for each brief of read_briefs: where a brief found too long later is named."""
    path = Path(path)
    if not path.is_file():
        raise FlowInputError(f"briefs file {path} does not exist")
    briefs = []
    jsonl = path.suffix == ".jsonl"
    for lineno, line in iter_lines(path):  # a non-UTF-8 line is a DataError naming path:line
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        brief = line.strip()
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise FlowInputError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("brief"), str) or not obj["brief"].strip():
                raise FlowInputError(f"{where}: expected an object with a non-empty string field 'brief'")
            brief = obj["brief"].strip()
        briefs.append((where, " ".join(brief.split())))  # one line: the designer's briefs file has one per line
    if not briefs:
        raise FlowInputError(f"briefs file {path} has no briefs")
    return briefs


def read_caption_rows(path: str | Path) -> list[dict[str, str]]:
    """{"brief", "caption"} rows (plus "image" where the line has one) from a JSONL file; errors name file:line."""
    from atelier_studio.data.synthetic import brief_constraints

    path = Path(path)
    if not path.is_file():
        raise FlowInputError(f"captions file {path} does not exist")
    rows = []
    for where, obj in iter_json_lines(path, FlowInputError):
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in ("brief", "caption")):
            raise FlowInputError(f"{where}: expected an object with string fields 'brief' and 'caption'")
        try:
            brief_constraints(obj["brief"])
        except ValueError as e:
            raise FlowInputError(f"{where}: brief {obj['brief']!r} cannot be judged in the shapes world ({e})"
                                 ) from None
        row = {"brief": obj["brief"], "caption": obj["caption"]}
        if isinstance(obj.get("image"), str):
            row["image"] = obj["image"]
        rows.append(row)
    if not rows:
        raise FlowInputError(f"captions file {path} has no rows")
    return rows


def resolve_designer(path: str | Path) -> tuple[Path, Path | None]:
    """(model_dir, adapter_dir or None) for a model, adapter or run directory."""
    p = Path(path)
    if not p.exists():
        raise FlowInputError(f"designer {p} does not exist (a model, adapter or run directory)")
    if (p / "adapter_config.json").is_file():
        cfg = read_json(p / "adapter_config.json", FlowInputError)
        base = (cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None) or ""
        if not base or not (Path(base) / "config.json").is_file():
            raise FlowInputError(f"{p / 'adapter_config.json'}: base_model_name_or_path {base!r} is not a local "
                                 f"model directory with config.json")
        return Path(base), p
    if (p / "config.json").is_file():
        return p, None
    for sub in ("adapter", "model"):  # a run directory: its export
        if (p / sub).is_dir():
            return resolve_designer(p / sub)
    raise FlowInputError(f"designer {p}: no config.json (model), adapter_config.json (adapter) or model/ or adapter/ "
                         f"(run directory) in it")


IMAGEGEN_EXPORTS = ("ema", "lora_ema", "transformer", "lora")  # a run directory's, in order of preference


def resolve_imagegen(path: str | Path) -> Path:
    """What `atelier imagegen sample` takes (a transformer or LoRA directory, an SD3 pipeline directory) for itself
    or a run directory (its exports, IMAGEGEN_EXPORTS)."""
    from atelier_studio.imagegen.lora import LORA_FILE

    def samplable(d: Path) -> bool:
        return any((d / name).is_file() for name in ("config.json", LORA_FILE, "model_index.json"))

    p = Path(path)
    if not p.exists():
        raise FlowInputError(f"imagegen {p} does not exist (a run's ema/, transformer/, lora_ema/ or lora/ directory)")
    if samplable(p):
        return p
    for sub in IMAGEGEN_EXPORTS:
        if samplable(p / sub):
            return p / sub
    raise FlowInputError(f"imagegen {p}: no config.json, {LORA_FILE} or model_index.json, and none of "
                         f"{', '.join(d + '/' for d in IMAGEGEN_EXPORTS)} in it (not a trained MMDiT)")


# ----------------------------------------------------------------------------- steps


def write_captions(designer: str | Path, briefs: Sequence[str], out_dir: str | Path, seed: int = 0,
                   max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                   batch_size: int = 16, sources: Sequence[str] | None = None) -> Path:
    """Designer captions for the briefs → <out>/captions.jsonl with {brief, caption} per line, in brief order.
    `sources` ("file:line" of each brief in the user's file) names a brief the designer cannot take."""
    from atelier_studio.designer.captions import generate_captions

    model_dir, adapter_dir = resolve_designer(designer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    briefs_file = out / "briefs.txt"
    atomic_write_text(briefs_file, "".join(b + "\n" for b in briefs), what="briefs")
    captions_file = out / "captions.jsonl"
    generate_captions(model_dir=model_dir, adapter_dir=adapter_dir, briefs_file=briefs_file, out_file=captions_file,
                      max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                      batch_size=batch_size, sources=list(sources) if sources is not None else None)
    return captions_file


def read_captions(captions_file: str | Path) -> list[dict[str, str]]:
    rows = []
    for lineno, line in iter_lines(captions_file):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise FlowInputError(f"{captions_file}:{lineno}: malformed JSON ({e.msg})") from None
    return rows


def render_images(imagegen: str | Path, captions_file: str | Path, out_dir: str | Path, seed: int = 0,
                  steps: int = 20, guidance: float = 4.0) -> Path:
    """One image per non-empty caption → <out>/images/; <out>/images.json maps each caption row to its image.

    An empty caption (an untrained designer emits one) gets no image and scores 0: the chain failed there.
    Returns the images.json path.
    """
    from atelier_studio.imagegen.sample import sample_to_dir

    model_dir = resolve_imagegen(imagegen)
    out = Path(out_dir)
    # the sampler reads one caption per line and skips blank ones: flatten newlines, keep the non-empty
    captions = [" ".join(r["caption"].split()) for r in read_captions(captions_file)]
    rows = [i for i, c in enumerate(captions) if c]
    images_dir = out / "images"
    mapping: list[str | None] = [None] * len(captions)
    if rows:
        lines_file = out / "captions.txt"
        atomic_write_text(lines_file, "".join(captions[i] + "\n" for i in rows), what="captions")
        paths = sample_to_dir(model_dir=model_dir, captions_file=lines_file, out_dir=images_dir, steps=steps,
                              guidance=guidance, seed=seed, config_path=None)
        if len(paths) != len(rows):
            raise RuntimeError(f"{images_dir}: the sampler wrote {len(paths)} images for {len(rows)} captions")
        for i, p in zip(rows, paths):
            mapping[i] = str(p)
    index = out / "images.json"
    atomic_write_text(index, json.dumps(mapping, indent=0), what="image index")
    return index


def caption_stats(captions: Sequence[str]) -> dict[str, float]:
    from atelier_studio.data.synthetic import parse_caption

    words = [len(c.split()) for c in captions]
    return {"n": len(captions), "mean_words": statistics.fmean(words), "min_words": min(words),
            "max_words": max(words),
            "parsed_fraction": statistics.fmean(parse_caption(c) is not None for c in captions),
            "distinct_fraction": len(set(captions)) / len(captions)}


SHAPES_JUDGE, CLIP = "shapes-world judge", "CLIP score"


def _shapes_brief(brief: str) -> bool:
    from atelier_studio.data.synthetic import brief_constraints

    try:
        brief_constraints(brief)
    except ValueError:
        return False
    return True


def judge(captions_file: str | Path, images_index: str | Path, out_dir: str | Path,
          clip: str | Path | None = None) -> dict[str, Any]:
    """Score every (brief, caption, image) with the scorers that apply (module docstring); write scores.json,
    scores.csv, grid.png, summary.md; return the summary."""
    from atelier_studio.data.judge import judge_caption, judge_image, judge_image_brief
    from atelier_studio.data.synthetic import parse_caption

    out = Path(out_dir)
    rows = read_captions(captions_file)
    images = json.loads(Path(images_index).read_text())
    if len(images) != len(rows):
        raise FlowInputError(f"{images_index} lists {len(images)} images for {len(rows)} captions in {captions_file}")
    per_brief = []
    for i, (row, img) in enumerate(zip(rows, images)):
        brief, caption = row["brief"], row["caption"]
        entry = {"index": i, "brief": brief, "caption": caption, "image": img, "scorer": None, "score": None,
                 "color_ok": None, "shape_ok": None, "position_ok": None, "detected": None, "caption_score": None,
                 "caption_parsed": None, "image_caption_score": None, "clip_brief": None, "clip_caption": None}
        if _shapes_brief(brief):
            c = judge_caption(caption, brief)
            entry.update(scorer=SHAPES_JUDGE, score=0.0, color_ok=False, shape_ok=False, position_ok=False,
                         detected=False, caption_score=c.score, caption_parsed=c.parsed)
            if img is not None:
                b = judge_image_brief(img, brief)
                entry.update(score=b.score, color_ok=b.color_ok, shape_ok=b.shape_ok, position_ok=b.position_ok,
                             detected=b.detected)
                if parse_caption(caption) is not None:
                    entry["image_caption_score"] = judge_image(img, caption).score
        per_brief.append(entry)
    if clip:
        _clip_scores(per_brief, clip)
    judged = [r for r in per_brief if r["scorer"] == SHAPES_JUDGE]

    def mean(key: str, among: list[dict]) -> float | None:
        values = [float(r[key]) for r in among if r[key] is not None]
        return statistics.fmean(values) if values else None

    aggregate = {"n": len(per_brief), "judged": len(judged), "score": mean("score", judged),
                 "color_ok": mean("color_ok", judged), "shape_ok": mean("shape_ok", judged),
                 "position_ok": mean("position_ok", judged), "detected": mean("detected", judged),
                 "caption_score": mean("caption_score", judged),
                 "image_caption_score": mean("image_caption_score", judged)}
    if clip:
        aggregate.update(clip_brief=mean("clip_brief", per_brief), clip_caption=mean("clip_caption", per_brief))
    scores_run = {SHAPES_JUDGE: len(judged)}
    if clip:
        scores_run[CLIP] = len(per_brief)
    not_scored = [r["index"] for r in per_brief if r["scorer"] is None]
    stats = caption_stats([r["caption"] for r in per_brief])
    drawn = [Path(p) for p in images if p is not None][:GRID_MAX_IMAGES]
    grid = make_grid(drawn, out / "grid.png", cols=8, scale=2) if drawn else None
    result = {"aggregate": aggregate, "scores_run": scores_run, "not_scored": not_scored,
              "clip": str(Path(clip).resolve()) if clip else None, "captions": stats, "per_brief": per_brief,
              "files": {"scores_json": str(out / "scores.json"), "scores_csv": str(out / "scores.csv"),
                        "grid": str(grid) if grid else None, "captions": str(captions_file),
                        "images": str(images_index),
                        "summary": str(out / "summary.md")}}
    atomic_write_text(out / "scores.json", json.dumps(result, indent=1), what="scores")
    with atomic_file(out / "scores.csv", "w", newline="", what="scores") as f:
        w = csv.DictWriter(f, fieldnames=list(per_brief[0]))
        w.writeheader()
        w.writerows(per_brief)
    atomic_write_text(out / "summary.md", summary_markdown(result, with_grid=False), what="summary")
    return {k: v for k, v in result.items() if k != "per_brief"}


def _clip_scores(per_brief: list[dict[str, Any]], clip: str | Path) -> None:
    """CLIP scores of every drawn image against its brief and its caption (0 where no image was drawn: the chain
    failed there); a brief no other scorer took is scored by CLIP."""
    import torch

    from atelier_studio.data.clip_score import ClipScorer

    scorer = ClipScorer(clip, "cuda" if torch.cuda.is_available() else "cpu")
    drawn = [r for r in per_brief if r["image"] is not None]
    if drawn:
        images = [r["image"] for r in drawn]
        for key, texts in (("clip_brief", [r["brief"] for r in drawn]),
                           ("clip_caption", [r["caption"] for r in drawn])):
            for r, value in zip(drawn, scorer.scores(images, texts)):
                r[key] = value
    for r in per_brief:
        if r["image"] is None:
            r["clip_brief"] = r["clip_caption"] = 0.0
        if r["scorer"] is None:
            r["scorer"] = CLIP


def describe_scores(result: dict[str, Any]) -> str:
    """Which scores ran on how many briefs, in one line (the summary, the flow's log)."""
    a, run = result["aggregate"], result["scores_run"]
    parts = [f"{SHAPES_JUDGE} on {run[SHAPES_JUDGE]} of {a['n']} briefs (the shapes-world ones)"]
    if CLIP in run:
        parts.append(f"{CLIP} ({result['clip']}) on every drawn image, against its brief and its caption")
    if result["not_scored"]:
        parts.append(f"{len(result['not_scored'])} briefs outside the shapes world not scored (pass a local CLIP "
                     f"directory as `clip` to score them)")
    return "; ".join(parts)


def summary_markdown(result: dict[str, Any], with_grid: bool = True) -> str:
    a, c = result["aggregate"], result["captions"]
    pct = lambda v: "–" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = ["# brief → image evaluation", "", f"Scores run: {describe_scores(result)}.", ""]
    if a["judged"]:
        lines += [f"**Judged score: {pct(a['score'])}** over {a['judged']} shapes-world briefs (image against brief: "
                  "colour, shape, position).", "", "| check | accuracy |", "|---|---|"]
        lines += [f"| {k} | {pct(a[k])} |" for k in ("score", "color_ok", "shape_ok", "position_ok", "detected",
                                                     "caption_score", "image_caption_score")]
        lines.append("")
    if "clip_brief" in a:
        num = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
        lines += [f"**CLIP score** (100 · cosine, over all {a['n']} briefs): image vs brief {num(a['clip_brief'])}, "
                  f"image vs caption {num(a['clip_caption'])}.", ""]
    lines += ["Captions: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in c.items()), "",
              f"Files: `{result['files']['scores_json']}`, `{result['files']['scores_csv']}`, "
              f"`{result['files']['grid']}`"]
    if with_grid and result["files"]["grid"]:
        lines += ["", image_markdown(Path(result["files"]["grid"]), "generated images")]
    return "\n".join(lines)


def publish_eval(result: dict[str, Any]) -> list[str]:
    """Markdown summary (scores + the grid) and a per-brief table as artifacts; [] outside a Prefect run."""
    if not in_prefect_run():
        return []
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_markdown_artifact(summary_markdown(result), key="brief-to-image-eval-summary",
                             description=f"scores of the brief → caption → image chain: {describe_scores(result)}")
    per_brief = json.loads(Path(result["files"]["scores_json"]).read_text())["per_brief"]
    table = [{k: (f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in r.items() if k != "image"}
             for r in per_brief]
    create_table_artifact(table, key="brief-to-image-eval-scores", description="per-brief scores")
    return ["brief-to-image-eval-summary", "brief-to-image-eval-scores"]


# ----------------------------------------------------------------------------- plain entry point and flow


def evaluate_brief_to_image(designer: str | Path, imagegen: str | Path, briefs: str | Path, out_dir: str | Path,
                            seed: int = 0, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                            steps: int = 20, guidance: float = 4.0, clip: str | Path | None = None) -> dict[str, Any]:
    """The whole evaluation without Prefect (`atelier eval`): returns aggregate scores, which scores ran, caption
    stats, file paths."""
    _check_inputs(designer, imagegen, clip, steps)
    lines = read_brief_lines(briefs)
    with new_output_dir(out_dir, "--out"):  # a failure mid-way leaves no output folder
        captions = write_captions(designer, [b for _, b in lines], out_dir, seed, max_new_tokens, temperature, top_p,
                                  sources=[where for where, _ in lines])
        images = render_images(imagegen, captions, out_dir, seed, steps, guidance)
        return judge(captions, images, out_dir, clip)


def evaluate_captions(captions: str | Path, out_dir: str | Path, imagegen: str | Path | None = None, seed: int = 0,
                      steps: int = 20, guidance: float = 4.0) -> dict[str, Any]:
    """Given captions judged without the designer (`atelier eval --captions`): returns what `judge` returns.

    With `imagegen`, one image is sampled per caption. Without it, every row must name its image, a path
    relative to the captions file's folder (the shapes world's eval.jsonl does), and those images are judged.
    """
    captions = Path(captions)
    if imagegen is not None:
        resolve_imagegen(imagegen)
        _check_steps(steps)
    rows = read_caption_rows(captions)
    out = Path(out_dir)
    if imagegen is None:
        missing = [i + 1 for i, r in enumerate(rows) if "image" not in r]
        if missing:
            raise FlowInputError(f"{captions}: row {missing[0]} names no 'image'; without --imagegen every row must "
                                 f"name the image to judge")
        images = [captions.parent / r["image"] for r in rows]
        absent = next((p for p in images if not p.is_file()), None)
        if absent is not None:
            raise FlowInputError(f"{captions}: image {absent} does not exist")
    with new_output_dir(out, "--out"):  # a failure mid-way leaves no output folder
        captions_file = atomic_write_text(out / "captions.jsonl", "".join(
            json.dumps({"brief": r["brief"], "caption": r["caption"]}) + "\n" for r in rows), what="captions")
        if imagegen is None:
            index = atomic_write_text(out / "images.json", json.dumps([str(p) for p in images], indent=0),
                                      what="image index")
        else:
            index = render_images(imagegen, captions_file, out, seed, steps, guidance)
        return judge(captions_file, index, out)


def _check_steps(steps: int) -> None:
    if steps < 1:
        raise FlowInputError(f"steps: the sampler needs at least 1 Euler step per image, got {steps}")


def _check_inputs(designer: str | Path, imagegen: str | Path, clip: str | Path | None = None,
                  steps: int = 1) -> None:
    """Fail before the designer runs, not after: the designer, the imagegen model and the CLIP directory exist and
    the sampler has at least one step."""
    resolve_designer(designer)
    resolve_imagegen(imagegen)
    _check_steps(steps)
    if clip and not (Path(clip) / "config.json").is_file():
        raise FlowInputError(f"clip {clip}: not a local transformers CLIP directory (no config.json)")


@task(name="generate-captions")
def captions_task(designer: str, briefs: list[str], out_dir: str, seed: int, max_new_tokens: int, temperature: float,
                  top_p: float, sources: list[str] | None = None) -> str:
    return str(write_captions(designer, briefs, out_dir, seed, max_new_tokens, temperature, top_p, sources=sources))


@task(name="sample-images")
def images_task(imagegen: str, captions_file: str, out_dir: str, seed: int, steps: int, guidance: float) -> str:
    return str(render_images(imagegen, captions_file, out_dir, seed, steps, guidance))


@task(name="score")
def judge_task(captions_file: str, images_index: str, out_dir: str, clip: str = "") -> dict[str, Any]:
    result = judge(captions_file, images_index, out_dir, clip or None)
    from prefect.logging import get_run_logger

    get_run_logger().info(f"scores run: {describe_scores(result)}")
    publish_eval(result)
    return result


@flow(name="brief-to-image-eval")
def brief_to_image_eval(designer: str, imagegen: str, briefs: str, out_dir: str = "runs/eval", seed: int = 0,
                        max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, steps: int = 20,
                        guidance: float = 4.0, clip: str = "") -> dict[str, Any]:
    """briefs (any text) → captions → images → scores; every step's output is a path under out_dir. `clip`: a local
    transformers CLIP directory, for CLIP scores (the only ones a brief outside the shapes world gets)."""
    _check_inputs(designer, imagegen, clip, steps)
    lines = read_brief_lines(briefs)
    captions = captions_task(str(designer), [b for _, b in lines], str(out_dir), seed, max_new_tokens, temperature,
                             top_p, sources=[where for where, _ in lines])
    images = images_task(str(imagegen), captions, str(out_dir), seed, steps, guidance)
    return judge_task(captions, images, str(out_dir), str(clip or ""))


def chain_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line of a flow over briefs: --designer, --imagegen, --briefs, --out, --seed (evaluate, render)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--designer", required=True, help="a designer model, adapter or run directory")
    p.add_argument("--imagegen", required=True, help="what `atelier imagegen sample --model` takes, or a run directory")
    p.add_argument("--briefs", required=True, help=".txt (one brief per line) or .jsonl ({\"brief\": ...} per line)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = chain_parser("python -m atelier_studio.flows.evaluate", "run the brief-to-image-eval flow")
    p.add_argument("--clip", default="", help="a local transformers CLIP directory: CLIP scores for every image")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=4.0)
    args = p.parse_args(argv)
    from atelier_studio.flows.local_server import require_server

    require_server("python -m atelier_studio.flows.evaluate")
    result = brief_to_image_eval(args.designer, args.imagegen, args.briefs, args.out, args.seed, steps=args.steps,
                                 guidance=args.guidance, clip=args.clip)
    print(describe_scores(result))
    print(json.dumps(result["aggregate"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
