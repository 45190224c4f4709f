"""Flow `render-briefs`: briefs (any text) → designer captions → imagegen images, with no scoring.

    atelier render --designer runs/d1 --imagegen runs/sd3/pipeline --briefs briefs.txt --out runs/render
    python -m atelier_studio.flows.render --designer ... --imagegen ... --briefs ... --out ...   (as a Prefect flow)
    prefect deployment run render-briefs/default -p designer=runs/d1 -p imagegen=runs/i1 -p briefs=briefs.txt \
        -p out_dir=runs/render --watch --watch-timeout 1800

What a customer's briefs become: the steps are `brief-to-image-eval`'s first three (flows/evaluate.py: read_briefs,
write_captions, render_images), then `collect` writes <out>/render.jsonl ({brief, caption, image} per brief, image
null where the designer wrote an empty caption) and <out>/grid.png, and under Prefect a markdown artifact with the
grid and a table artifact of the briefs, captions and images. `designer` and `imagegen` are what the evaluation
takes (a model, adapter or run directory; a transformer, LoRA, pipeline or run directory).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from prefect import flow, task

from atelier_studio.flows.evaluate import (
    GRID_MAX_IMAGES,
    captions_task,
    chain_parser,
    images_task,
    read_brief_lines,
    read_captions,
    render_images,
    resolve_designer,
    resolve_imagegen,
    write_captions,
)
from atelier_studio.flows.report import image_markdown, in_prefect_run, make_grid
from atelier_studio.pipeline.atomic import atomic_write_text, new_output_dir


def collect(captions_file: str | Path, images_index: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """<out>/render.jsonl and <out>/grid.png from the captions and the image index; returns the paths and counts."""
    out = Path(out_dir)
    rows = read_captions(captions_file)
    images = json.loads(Path(images_index).read_text())
    records = [{"brief": r["brief"], "caption": r["caption"], "image": img} for r, img in zip(rows, images)]
    index = atomic_write_text(out / "render.jsonl", "".join(json.dumps(r) + "\n" for r in records),
                              what="render index")
    drawn = [Path(r["image"]) for r in records if r["image"] is not None]
    grid = make_grid(drawn[:GRID_MAX_IMAGES], out / "grid.png", cols=4, scale=1) if drawn else None
    return {"briefs": len(records), "images": len(drawn), "index": str(index), "grid": str(grid) if grid else None,
            "captions": str(captions_file)}


def publish_render(result: dict[str, Any]) -> list[str]:
    """The grid (markdown) and the briefs, captions and images (table) as artifacts; [] outside a Prefect run."""
    if not in_prefect_run():
        return []
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    md = [f"# render-briefs: {result['images']} images for {result['briefs']} briefs", "",
          f"Index: `{Path(result['index']).resolve()}`"]
    if result["grid"]:
        md += ["", image_markdown(Path(result["grid"]), "rendered briefs")]
    create_markdown_artifact("\n".join(md), key="render-briefs", description="briefs → captions → images")
    rows = [json.loads(line) for line in Path(result["index"]).read_text().splitlines()]
    create_table_artifact([{k: str(v) for k, v in r.items()} for r in rows], key="render-briefs-captions",
                          description="each brief, the designer's caption and the image")
    return ["render-briefs", "render-briefs-captions"]


def render_briefs_plain(designer: str | Path, imagegen: str | Path, briefs: str | Path, out_dir: str | Path,
                        seed: int = 0, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                        steps: int = 28, guidance: float = 4.0) -> dict[str, Any]:
    """The flow's work without Prefect (`atelier render`)."""
    resolve_designer(designer)  # fail before the designer runs, not after
    resolve_imagegen(imagegen)
    lines = read_brief_lines(briefs)
    with new_output_dir(out_dir, "--out"):  # a failure mid-way leaves no output folder
        captions = write_captions(designer, [b for _, b in lines], out_dir, seed, max_new_tokens, temperature, top_p,
                                  sources=[where for where, _ in lines])
        return collect(captions, render_images(imagegen, captions, out_dir, seed, steps, guidance), out_dir)


@task(name="collect")
def collect_task(captions_file: str, images_index: str, out_dir: str) -> dict[str, Any]:
    result = collect(captions_file, images_index, out_dir)
    publish_render(result)
    return result


@flow(name="render-briefs")
def render_briefs(designer: str, imagegen: str, briefs: str, out_dir: str = "runs/render", seed: int = 0,
                  max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, steps: int = 28,
                  guidance: float = 4.0) -> dict[str, Any]:
    """briefs (any text) → captions → images; every step's output is a path under out_dir."""
    resolve_designer(designer)
    resolve_imagegen(imagegen)
    lines = read_brief_lines(briefs)
    captions = captions_task(str(designer), [b for _, b in lines], str(out_dir), seed, max_new_tokens, temperature,
                             top_p, sources=[where for where, _ in lines])
    images = images_task(str(imagegen), captions, str(out_dir), seed, steps, guidance)
    return collect_task(captions, images, str(out_dir))


def main(argv: Sequence[str] | None = None) -> int:
    p = chain_parser("python -m atelier_studio.flows.render", "run the render-briefs flow")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--guidance", type=float, default=4.0)
    args = p.parse_args(argv)
    from atelier_studio.flows.local_server import require_server

    require_server("python -m atelier_studio.flows.render")
    result = render_briefs(args.designer, args.imagegen, args.briefs, args.out, args.seed, steps=args.steps,
                           guidance=args.guidance)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
