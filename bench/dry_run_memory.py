"""`train --dry-run`'s peak-memory estimate against the peaks the GPU benches measured, on the CPU (docs/training.md).

    python3 -m atelier_studio.bench.dry_run_memory [--results bench/results] [--out bench/results] [--docs]

For each measured row (ROWS): the shipped config with the `--set` overrides that give the bench run's settings
(each stated with its reason), the model's config.json alone in a temporary directory (the registered size the bench
built: no weights), the trainer's dry-run plan computed in-process (designer/dry_run.py, imagegen/dry_run.py), and
its total compared with the report's `peak_gb` (torch.cuda.max_memory_allocated / 1e9: GB, not GiB). A row is
within the target when the estimate is within 15% of the measured peak. Before comparing, the
row's settings as the report records them (adapter dtype, compile, precision, activation checkpointing, batch) are
checked against what the overrides say, so a re-run bench with other settings fails here instead of comparing
unlike things.

What the measured peaks hold that the estimate does not, and the reverse:
- designer rows: `baseline_gb` (the random bf16 weights the bench draws once) IS the model's weights: the run
  builds its model around those tensors (assign=True), so peak_gb is the run's whole footprint;
- imagegen row: `baseline_gb` is the bench's own bf16 source copy of the weights (each run copies it into its fp32
  master weights) and the batches; a trainer run would not hold it, so peak_gb − baseline_gb is given beside it;
- neither counts the allocator's overhead, the CUDA context, or the designer's chunked logits (pipeline/dry_run.py).

Writes dry-run-memory-<date>.json and .md (the date of the reports compared); --docs rewrites the table in
docs/training.md's dry-run section from the same result.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atelier_studio.pipeline.atomic import atomic_write_text
from atelier_studio.pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.15  # the estimate within 15% of the measured peak (docs/training.md)
QWEN_VOCAB = 151_936  # Qwen3's embedding rows, as the bench builds them (bench/designer.py BenchConfig.vocab_size)
DATE = "2026-12-05"
DOCS = ROOT / "docs" / "training.md"
DOCS_MARKERS = ("<!-- dry-run-memory:start -->", "<!-- dry-run-memory:end -->")


@dataclass(frozen=True)
class Override:
    key: str
    value: str  # "{model}" / "{missing}" are filled in with the temporary paths
    why: str


@dataclass(frozen=True)
class Row:
    name: str
    trainer: str  # "designer" or "imagegen"
    config: str  # shipped config, relative to configs/
    size: str  # the registered size of the bench's model
    overrides: tuple[Override, ...]
    report: str  # bench/results/<report>.json
    run: tuple[str, ...]  # the keys from the report's root to the measured run (its dict has peak_gb)
    expect: tuple[tuple[tuple[str, ...], Any], ...]  # (keys from the report's root, value) the overrides assume


MODEL = Override("model.path", "{model}", "a directory holding the bench size's config.json alone: no weights read")
DESIGNER_DATA = Override("data.train", "{missing}", "no data read: the estimate depends on data.seq_len and "
                         "train.micro_batch only, and the bench fills every row (packed rows of 2048 tokens)")
DESIGNER_BF16 = (
    MODEL, DESIGNER_DATA,
    Override("lora.dtype", "bfloat16", "the bench's adapters are bf16 (config.lora_dtype, the run's "
             "variant.lora_dtype); the shipped config keeps fp32 adapters computed in bf16"),
    Override("train.micro_batch", "4", "the measured row's micro-batch (the shipped config's too)"),
    Override("train.distributed.activation_checkpointing", "none", "the bench's config.ac (the default)"),
    Override("train.distributed.compile", "false", "the row ran eager (variant.compile false; the default)"),
)
DESIGNER_RUN = ("4", "False")  # micro-batch 4, compile off
DESIGNER_EXPECT = ((("config", "ac"), "none"), (("config", "seq_len"), 2048), (("config", "lora"), True))
IMAGEGEN_RUN = ("atelier_runs", "8", "True")  # batch 8, compiled

ROWS = (
    Row("Qwen3-8B LoRA r16, bf16, micro-batch 4 × 2048", "designer", "designer/qwen3-8b-lora.toml", "8b",
        DESIGNER_BF16, f"designer-qwen3-8b-lora-{DATE}", ("atelier_runs", *DESIGNER_RUN),
        (*DESIGNER_EXPECT, (("atelier_runs", *DESIGNER_RUN, "variant", "lora_dtype"), "bfloat16"),
         (("atelier_runs", *DESIGNER_RUN, "variant", "precision"), "bf16"))),
    Row("Qwen3-8B LoRA r16, FP8 rowwise, micro-batch 4 × 2048", "designer", "designer/qwen3-8b-lora.toml", "8b",
        (*DESIGNER_BF16,
         Override("train.precision", "fp8", "the FP8 row: the block linears in FP8, the LoRA bases quantised once"),
         Override("train.fp8_recipe", "rowwise", "the row's recipe (fp8_runs.rowwise)")),
        f"designer-qwen3-8b-lora-{DATE}", ("fp8_runs", "rowwise", *DESIGNER_RUN),
        (*DESIGNER_EXPECT, (("fp8_runs", "rowwise", *DESIGNER_RUN, "variant", "lora_dtype"), "bfloat16"),
         (("fp8_runs", "rowwise", *DESIGNER_RUN, "variant", "precision"), "fp8"))),
    Row("SD3-medium full fine-tuning, 1024 px, batch 8, compiled bf16", "imagegen", "imagegen/sd3-medium.toml",
        "sd3-medium",
        (MODEL,
         Override("data.shards", "{missing}", "no latents read: the estimate depends on the resolution and the batch"),
         Override("train.micro_batch", "8", "the measured row's batch (the shipped config trains 4)"),
         Override("ema.decay", "0", "the bench's step updates no EMA (its cost is timed apart: ema_update); the "
                  "shipped config's EMA would add an fp32 copy of the weights"),
         Override("train.distributed.activation_checkpointing", "none", "the bench checkpoints nothing (the default)"),
         Override("train.distributed.compile", "true", "the row is the compiled run (its eager twin ran out of "
                  "memory)")),
        f"imagegen-sd3-medium-1024-{DATE}", IMAGEGEN_RUN,
        ((("config", "resolution"), 1024), (("config", "text_tokens"), 333), ((*IMAGEGEN_RUN, "compile"), True))),
)


def _at(report: dict[str, Any], keys: tuple[str, ...], where: str) -> Any:
    node: Any = report
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            raise KeyError(f"{where}: no {'.'.join(keys)}")
        node = node[k]
    return node


def config_only_model(trainer: str, size: str, out: Path) -> Path:
    """A model directory holding config.json alone, for the registered `size`."""
    out.mkdir(parents=True, exist_ok=True)
    if trainer == "designer":
        from atelier_studio.designer.hf import args_from_size

        config = args_from_size(size, QWEN_VOCAB).to_hf_config(torch.bfloat16)
    else:
        from atelier_studio.imagegen.registry import family_of_size

        config = family_of_size(size).args_of_size(size).to_diffusers_config()
    (out / "config.json").write_text(json.dumps(config))
    return out


def plan_of(row: Row, tmp: Path):  # -> pipeline.dry_run.Plan
    """The trainer's dry-run plan for the row's config and overrides."""
    model = config_only_model(row.trainer, row.size, tmp / f"{row.trainer}-{row.size}")
    sets = [f"{o.key}={o.value.format(model=model, missing=tmp / 'missing')}" for o in row.overrides]
    if row.trainer == "designer":
        from atelier_studio.designer.config import DesignerConfig
        from atelier_studio.designer.dry_run import designer_plan

        return designer_plan(load_config(DesignerConfig, ROOT / "configs" / row.config, sets))
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.imagegen.dry_run import imagegen_plan

    return imagegen_plan(load_config(ImagegenConfig, ROOT / "configs" / row.config, sets))


def compare(row: Row, results: Path, tmp: Path) -> dict[str, Any]:
    path = results / f"{row.report}.json"
    report = json.loads(path.read_text())
    for keys, value in row.expect:
        got = _at(report, keys, str(path))
        if got != value:
            raise ValueError(f"{path}: {'.'.join(keys)} = {got!r}, but the row {row.name!r} assumes {value!r}")
    run = _at(report, row.run, str(path))
    plan = plan_of(row, tmp)
    estimate = sum(plan.memory.values()) / 1e9
    measured, baseline = run["peak_gb"], run.get("baseline_gb")
    ratio = estimate / measured
    out = {"name": row.name, "trainer": row.trainer, "config": f"configs/{row.config}",
           "overrides": [{"key": o.key, "value": o.value, "why": o.why} for o in row.overrides],
           "estimate_gb": round(estimate, 2), "estimate_gib": round(estimate * 1e9 / 2**30, 2),
           "terms_gb": {k: round(v / 1e9, 2) for k, v in plan.memory.items()},
           "measured_peak_gb": measured, "baseline_gb": baseline,
           "ratio": round(ratio, 3), "within_15": abs(ratio - 1) <= TOLERANCE,
           "report": f"bench/results/{row.report}.json", "run": ".".join(row.run),
           "gpu": (report.get("gpu") or {}).get("name")}
    if row.trainer == "imagegen" and baseline:  # the bench's own bf16 source copy (module docstring)
        out["ratio_without_bench_baseline"] = round(estimate / (measured - baseline), 3)
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = ["# `train --dry-run`'s memory estimate against measured GPU peaks", "",
             f"Estimate: the dry run's plan on the CPU (no weights); measured: the bench's `peak_gb` "
             f"(torch.cuda.max_memory_allocated, 1 GB = 1e9 bytes). Target: within {TOLERANCE:.0%} "
             f"(docs/training.md). Generated by `python3 -m atelier_studio.bench.dry_run_memory`. In the overrides, "
             f"`{{model}}` is a temporary directory holding the bench size's config.json alone, `{{missing}}` a path "
             f"that does not exist.", "",
             "| row | config | estimate GB (GiB) | measured peak GB | estimate / measured | within 15% |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | `{r['config']}` | {r['estimate_gb']:.1f} ({r['estimate_gib']:.1f}) | "
                     f"{r['measured_peak_gb']:.1f} | {r['ratio']:.3f} | {'yes' if r['within_15'] else 'NO'} |")
    for r in result["rows"]:
        lines += ["", f"## {r['name']}", "",
                  f"Measured: `{r['report']}`, `{r['run']}` ({r['gpu']}); the bench's baseline (inside the peak): "
                  f"{r['baseline_gb']:.2f} GB.",
                  "Estimate terms (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in r["terms_gb"].items()) + ".", ""]
        if "ratio_without_bench_baseline" in r:
            lines += [f"Without the bench's baseline (its bf16 source copy of the weights, which a trainer run does "
                      f"not hold): estimate / (peak − baseline) = {r['ratio_without_bench_baseline']:.3f}.", ""]
        lines += ["| --set | value | why |", "|---|---|---|"]
        lines += [f"| `{o['key']}` | `{o['value']}` | {o['why']} |" for o in r["overrides"]]
    return "\n".join(lines) + "\n"


def docs_table(result: dict[str, Any]) -> str:
    """The table docs/training.md's dry-run section carries between its DOCS_MARKERS."""
    lines = [f"| run (bench report of {result['date']}) | estimate | measured peak | estimate / measured |",
             "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} (`{Path(r['report']).stem}`, {r['gpu']}) | {r['estimate_gb']:.1f} GB "
                     f"({r['estimate_gib']:.1f} GiB) | {r['measured_peak_gb']:.1f} GB | {r['ratio']:.3f} |")
    return "\n".join(lines)


def with_docs_table(text: str, table: str) -> str:
    """`text` with the block between DOCS_MARKERS replaced by `table`."""
    start, end = DOCS_MARKERS
    if start not in text or end not in text:
        raise ValueError(f"docs/training.md: no {start} ... {end} block")
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}"


def run(results: Path, out: Path | None) -> dict[str, Any]:
    """Every row compared; the report written under `out` when given."""
    with tempfile.TemporaryDirectory() as tmp:
        result = {"date": DATE, "tolerance": TOLERANCE, "rows": [compare(row, results, Path(tmp)) for row in ROWS]}
    if out is not None:
        stem = out / f"dry-run-memory-{DATE}"
        atomic_write_text(stem.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
        atomic_write_text(stem.with_suffix(".md"), markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="where the bench reports are")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where to write the comparison")
    p.add_argument("--docs", action="store_true", help="also rewrite docs/training.md's table from the result")
    a = p.parse_args(argv)
    result = run(a.results, a.out)
    if a.docs:
        atomic_write_text(DOCS, with_docs_table(DOCS.read_text(encoding="utf-8"), docs_table(result)))
    for r in result["rows"]:
        print(f"{r['name']}: estimate {r['estimate_gb']:.1f} GB, measured {r['measured_peak_gb']:.1f} GB, "
              f"ratio {r['ratio']:.3f} ({'within' if r['within_15'] else 'OUTSIDE'} 15%)")
    return 0 if all(r["within_15"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
