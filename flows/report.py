"""What a finished run leaves in Prefect: metrics table, throughput/MFU summary, image grids, as artifacts.

Everything here reads files a run wrote (metrics.jsonl, summary.json, PNGs) — flows pass paths, never
tensors — and every `publish_*` function is a no-op outside a Prefect run, so the same code serves the CLI.
Artifact keys must be lowercase letters, digits and dashes (Prefect's rule); `artifact_key` makes them so.
"""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

from atelier_studio.pipeline.atomic import atomic_file

MAX_TABLE_ROWS = 60  # the UI table stays readable; the full curve is in metrics.jsonl / TensorBoard
MAX_INLINE_PNG_BYTES = 400_000  # larger grids are linked by path instead of embedded as a data URI
PREVIEW_SIDE = 1024  # an image artifact's longest side in pixels (a 1024-px sample grid is several MB as a PNG)


def artifact_key(*parts: str) -> str:
    key = "-".join(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in parts if p)
    return re.sub(r"-+", "-", key).strip("-")[:100] or "atelier"


def in_prefect_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


# ----------------------------------------------------------------------------- reading a run


def read_metrics(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """metrics.jsonl records (optionally of one kind); a torn last line from a killed run is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def thin(rows: Sequence[dict[str, Any]], n: int = MAX_TABLE_ROWS) -> list[dict[str, Any]]:
    """At most n rows, evenly spaced, always keeping the first and the last."""
    if len(rows) <= n:
        return list(rows)
    idx = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in idx]


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


def metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    """Train and eval records merged by step, formatted for a table."""
    cols = ("step", "kind", "loss", "lr", "grad_norm", "tokens_per_s", "images_per_s", "mfu", "skipped")
    rows = []
    for rec in thin([r for r in read_metrics(run_dir) if r.get("kind") in ("train", "eval")]):
        rows.append({c: _fmt(rec.get(c)) for c in cols if c in rec or c in ("step", "kind", "loss")})
    return rows


def summary_markdown(run_dir: Path, title: str) -> str:
    """A markdown summary of a finished run from its summary.json and metrics.jsonl."""
    s = read_summary(run_dir)
    evals = read_metrics(run_dir, "eval")
    lines = [f"# {title}", "", f"Run directory: `{Path(run_dir).resolve()}`", ""]
    if not s:
        lines.append("No summary.json: the run did not finish (see the logs).")
        skips = read_metrics(run_dir, "skipped")  # the last counts it logged
        return "\n".join(lines + skipped_markdown(skips[-1] if skips else None))
    rate = s.get("units_per_s")
    unit = "images/s" if any("images_per_s" in r for r in read_metrics(run_dir, "train")) else "tokens/s"
    mfu = s.get("mfu")
    rows = [("steps", s.get("step")), ("interrupted", s.get("interrupted")), ("final train loss", s.get("final_loss")),
            ("final eval loss", evals[-1].get("loss") if evals else None),
            (f"throughput ({unit}, median)", rate),
            ("TFLOP/s (median)", s["flops_per_s"] / 1e12 if s.get("flops_per_s") else None),
            ("MFU", f"{100 * mfu:.2f}%" if mfu is not None else "n/a (no peak for this device)"),
            ("step time (s, median)", s.get("step_time")), ("peak memory (GiB)", s.get("peak_gb"))]
    lines += ["| metric | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows if v is not None]
    lines += skipped_markdown(s.get("skipped"))
    if s.get("exports"):
        lines += ["", "Exports:", ""] + [f"- {k}: `{v}`" for k, v in s["exports"].items()]
    if s.get("fallbacks"):  # an emulated precision, reference kernels: never only in the log
        lines += ["", "Fallbacks:", ""] + [f"- {v}" for v in s["fallbacks"].values()]
    return "\n".join(lines)


def skipped_markdown(skipped: dict[str, Any] | None) -> list[str]:
    """The summary's skipped training samples (pipeline.task.Skipped.as_dict) as a table by source and reason."""
    if not skipped:
        return []
    if not skipped.get("total"):
        return ["", "Skipped training samples: none."]
    lines = ["", f"## Skipped training samples: {skipped['total']}", "",
             "Unreadable samples, and the samples a tar cut short lacks (its index lists them), counted on every pass "
             "that skipped them.", "", "| source | reason | samples |", "|---|---|---|"]
    for source, reasons in skipped.get("by_source", {}).items():
        lines += [f"| `{source}` | {reason} | {n} |" for reason, n in sorted(reasons.items())]
    return lines


# ----------------------------------------------------------------------------- images


def make_grid(images: Sequence[Path], out_file: Path, cols: int = 8, scale: int = 2,
              labels: Sequence[str] | None = None) -> Path:
    """Tile PNGs into one grid PNG (nearest-neighbour upscaled by `scale` so 32 px shapes stay visible)."""
    from PIL import Image, ImageDraw

    if not images:
        raise ValueError(f"make_grid: no images to put in {out_file}")
    tiles = []
    for p in images:
        with Image.open(p) as im:
            tiles.append(im.convert("RGB"))
    w = max(t.width for t in tiles) * scale
    h = max(t.height for t in tiles) * scale
    label_h = 12 if labels else 0
    cols = max(1, min(cols, len(tiles)))
    n_rows = math.ceil(len(tiles) / cols)
    grid = Image.new("RGB", (cols * w, n_rows * (h + label_h)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, t in enumerate(tiles):
        x, y = (i % cols) * w, (i // cols) * (h + label_h)
        grid.paste(t.resize((t.width * scale, t.height * scale), Image.NEAREST), (x, y))
        if labels:
            draw.text((x + 2, y + h), str(labels[i])[: w // 6], fill=(0, 0, 0))
    out_file = Path(out_file)
    with atomic_file(out_file, "wb", what="image grid") as f:
        grid.save(f, format="PNG")
    return out_file


def image_markdown(png: Path, alt: str) -> str:
    """The grid inline as a data URI when small enough (the UI shows it with no file server), else its path."""
    png = Path(png)
    data = png.read_bytes()
    if len(data) <= MAX_INLINE_PNG_BYTES:
        return f"![{alt}](data:image/png;base64,{base64.b64encode(data).decode()})\n\n`{png.resolve()}`"
    return f"{alt}: `{png.resolve()}` ({len(data) // 1024} KiB, too large to embed)"


def preview_data_uri(image: Path, max_side: int = PREVIEW_SIDE) -> str:
    """An image file as a data URI the Prefect UI shows with no file server: a JPEG (quality 90) at most `max_side`
    pixels on its longest side."""
    import io

    from PIL import Image

    with Image.open(image) as im:
        im = im.convert("RGB")
        im.thumbnail((max_side, max_side))
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


# ----------------------------------------------------------------------------- publishing


def publish_samples(image: Path, key: str, description: str) -> str | None:
    """Validation images rendered during training as a Prefect image artifact (a new version of `key` each time);
    returns the key, None outside a Prefect run."""
    if not in_prefect_run():
        return None
    from prefect.artifacts import create_image_artifact

    key = artifact_key(key)
    create_image_artifact(preview_data_uri(Path(image)), key=key,
                          description=f"{description} ({Path(image).resolve()})")
    return key


def publish_table(rows_file: Path, key: str, description: str) -> str | None:
    """A sample table written during training (JSONL rows: the designer's brief, caption, step) as a Prefect table
    artifact (a new version of `key` each time); returns the key, None outside a Prefect run."""
    if not in_prefect_run():
        return None
    import json

    from prefect.artifacts import create_table_artifact

    key = artifact_key(key)
    rows = [json.loads(line) for line in Path(rows_file).read_text().splitlines() if line.strip()]
    create_table_artifact(rows, key=key, description=f"{description} ({Path(rows_file).resolve()})")
    return key


def publish_training(run_dir: Path, name: str) -> list[str]:
    """Metrics table, summary markdown and (imagegen) the sample grid of output.dir/samples/ as artifacts.

    Returns the artifact keys created; [] outside a Prefect run.
    """
    if not in_prefect_run():
        return []
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    run_dir = Path(run_dir)
    keys = []
    md = summary_markdown(run_dir, f"{name}: {run_dir.name}")
    grid = training_grid(run_dir)
    if grid is not None:
        md += "\n\n## Samples\n\n" + image_markdown(grid, "samples")
    key = artifact_key(name, "summary")
    create_markdown_artifact(md, key=key, description=f"{name} summary: throughput, MFU, losses")
    keys.append(key)
    rows = metrics_rows(run_dir)
    if rows:
        key = artifact_key(name, "metrics")
        create_table_artifact(rows, key=key, description=f"{name} metrics from {run_dir / 'metrics.jsonl'}")
        keys.append(key)
    return keys


def training_grid(run_dir: Path) -> Path | None:
    """The newest samples of an imagegen run (output.dir/samples/, PNGs, possibly in per-step folders) as a grid."""
    samples = Path(run_dir) / "samples"
    if not samples.is_dir():
        return None
    pngs = sorted(p for p in samples.rglob("*.png") if p.name != "grid.png")
    if not pngs:
        return None
    newest_dir = max({p.parent for p in pngs}, key=lambda d: (d.stat().st_mtime, str(d)))
    existing = newest_dir / "grid.png"
    if existing.is_file():
        return existing
    return make_grid([p for p in pngs if p.parent == newest_dir][:64], samples / "grid.png")
