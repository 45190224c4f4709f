"""The measured result of `improve-designer` on the shapes world: the judged score before and after 1 and 3 rounds, on
a held-out split where the SFT designer is weak, and on the normal eval set (which must not lose).

    python -m atelier_studio.bench.improve_shapes --designer runs/d1 --imagegen runs/i1 \
        --world runs/world --out runs/improve-bench [--per-axis 80 --k 8 --rounds 3]

Needs the demo's trained designer and imagegen (`make demo`, docs/demo.md) and a running Prefect server
(`atelier serve`). Steps:
    1. the weak split (data/weak_briefs.py): `--per-axis` briefs per axis (new templates, layout first, an
       occasion before the request) with seed 1 to sample on, and as many with seed 2 held out
    2. `improve-designer` for `--rounds` rounds on the first set, judged before and after on the held-out set
    3. the normal eval set (<world>/briefs_eval.txt) judged with the SFT designer, round 1's and round 3's (greedy)
    4. OUT/improve-shapes.json and OUT/improve-shapes.md: per axis and overall, before / round 1 / round 3, the
       change on the weakest axis (the target: >= 10 points) and on the normal set (the target: no loss), every
       round's costs, the grids, and this command line
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from atelier_studio.pipeline.atomic import atomic_write_text


def write_split(out: Path, per_axis: int, normal: Sequence[str] = ()) -> tuple[Path, Path, dict[str, str]]:
    """briefs.txt (seed 1, then the `normal` briefs) and heldout.txt (seed 2); returns their paths and each held-out
    brief's axis."""
    from atelier_studio.data.weak_briefs import weak_briefs

    out.mkdir(parents=True, exist_ok=True)
    train, held = weak_briefs(per_axis, seed=1), weak_briefs(per_axis, seed=2)
    lines = [r["brief"] for r in train] + list(normal)
    briefs = atomic_write_text(out / "briefs.txt", "".join(b + "\n" for b in lines), what="briefs")
    heldout = atomic_write_text(out / "heldout.txt", "".join(r["brief"] + "\n" for r in held), what="briefs")
    atomic_write_text(out / "heldout_axes.json", json.dumps(held, indent=0), what="axes")
    return briefs, heldout, {r["brief"]: r["axis"] for r in held}


def world_train_briefs(world: Path, n: int) -> list[str]:
    """The first n briefs of the world's image training split (<world>/train.jsonl): briefs in the SFT designer's own
    frames, never the normal eval set's."""
    rows = [json.loads(line) for line in (world / "train.jsonl").read_text().splitlines() if line.strip()]
    return [r["brief"] for r in rows[:n]]


def per_axis(scores_json: Path, axes: dict[str, str]) -> dict[str, float]:
    """Mean judged score per axis and overall ("all"), in points; "captions": the captions judged against the briefs
    as text (caption_score), when the scores have it: a drop in "all" that "captions" does not share is the
    renderer's, not the designer's."""
    rows = json.loads(scores_json.read_text())["per_brief"]
    groups: dict[str, list[float]] = {}
    for r in rows:
        score = float(r["score"] or 0.0)
        groups.setdefault(axes.get(r["brief"], "normal"), []).append(score)
        groups.setdefault("all", []).append(score)
        if r.get("caption_score") is not None:
            groups.setdefault("captions", []).append(float(r["caption_score"]))
    return {k: round(100 * statistics.fmean(v), 1) for k, v in groups.items()}


def normal_eval(designer: str, imagegen: str, briefs: Path, out: Path, steps: int) -> dict[str, float]:
    from atelier_studio.flows.evaluate import evaluate_brief_to_image

    if not (out / "scores.json").is_file():
        evaluate_brief_to_image(designer, imagegen, briefs, out, steps=steps)
    return per_axis(out / "scores.json", {})


def dpo_settings(run_dir: Path) -> str:
    """The DPO run's settings that decide the result, from its resolved config.toml."""
    from atelier_studio.designer.config import DesignerConfig
    from atelier_studio.pipeline.config import load_config

    cfg = load_config(DesignerConfig, run_dir / "config.toml")
    t = cfg.train
    return (f"LoRA rank {cfg.lora.rank}, lr {t.lr:g} ({t.schedule}), {t.max_steps} steps of {t.micro_batch} rows, "
            f"{t.dpo.loss_type} β {t.dpo.beta:g}, sft_weight {t.dpo.sft_weight:g}")


def report_markdown(report: dict[str, Any]) -> str:
    cols = ["before", *[f"round {r}" for r in report["rounds_reported"]]]
    lines = ["# improve-designer on the shapes world", "", f"Command: `{report['command']}`", "",
             "Judged brief-to-image score (points, image against brief: colour, shape, position), greedy captions.",
             "", "| split | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, row in report["table"].items():
        lines.append(f"| {name} | " + " | ".join(str(row.get(c, "–")) for c in cols) + " |")
    lines += ["", f"Weakest held-out axis before: **{report['weakest_axis']}**; change after the last round: "
              f"{report['weakest_change']:+.1f} points (target ≥ +10). Normal eval set: {report['normal_change']:+.1f} "
              f"points (target ≥ 0).", "", "| round | samples | renders | sample s | render s | judge s | DPO s | "
              "pairs | ties |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["costs"]:
        lines.append(f"| {r['round']} | {r['samples']} | {r['renders']} | {r['sample_s']:.0f} | {r['render_s']:.0f} | "
                     f"{r['judge_s']:.0f} | {r['dpo_s']:.0f} | {r['pairs']} | {r['ties']} |")
    if report.get("dpo"):
        lines += ["", f"DPO each round: {report['dpo']}."]
    lines += ["", "Grids (held-out briefs, before on top): " + ", ".join(f"`{g}`" for g in report["grids"] if g)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from atelier_studio.flows.cli_args import STEPS, Bounds, OneLineParser, check_numbers, number
    from atelier_studio.pipeline.errors import AtelierError, UsageError, one_line

    p = OneLineParser(prog="python -m atelier_studio.bench.improve_shapes", description=__doc__.split("\n")[0])
    p.add_argument("--designer", required=True)
    p.add_argument("--imagegen", required=True)
    p.add_argument("--world", required=True, help="the shapes world the demo trained on (its briefs_eval.txt)")
    p.add_argument("--out", required=True)
    number(p, "--per-axis", type=int, bounds=Bounds(1, 10**6, meaning="weak briefs per axis"), default=80)
    number(p, "--k", type=int, bounds=Bounds(2, 1024, meaning="captions sampled per brief"), default=8)
    number(p, "--normal-briefs", type=int, bounds=Bounds(0, 10**6, meaning="the world's training briefs added"),
           default=0, help="also sample on this many of the world's training briefs (the frames the SFT designer "
                           "knows); measured on 2026-12-05 to hurt: most of their pairs are render noise "
                           "(docs/improve.md)")
    number(p, "--rounds", type=int, bounds=Bounds(1, 1000, meaning="improvement rounds"), default=3)
    number(p, "--renders", type=int, bounds=Bounds(1, 64, meaning="renders judged per caption (its score: their "
                                                                     "mean)"), default=1)
    p.add_argument("--dpo-config", default="designer/demo-dpo")
    number(p, "--dpo-steps", type=int, bounds=Bounds(0, 10**9, meaning="DPO steps per round (0: the config's)"),
           default=0)
    number(p, "--steps", type=int, bounds=STEPS, default=20, help="sampler steps per image")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a DPO run config override")
    args = p.parse_args(argv)
    from atelier_studio.flows.improve import improve_designer
    from atelier_studio.flows.local_server import ServerNotRunning, require_server

    try:  # bad numbers, a world without its files and no server are one line each, before anything is written
        check_numbers(p, args)
        for name in ("train.jsonl", "briefs_eval.txt"):
            if not (Path(args.world) / name).is_file():
                raise UsageError(f"--world {args.world}: no {name} (the shapes world `make demo` writes, runs/world)")
        require_server("python -m atelier_studio.bench.improve_shapes")
    except (AtelierError, ServerNotRunning) as e:
        sys.stderr.write(f"atelier: error: {one_line(str(e))}\n")
        return 2
    out = Path(args.out)
    normal = world_train_briefs(Path(args.world), args.normal_briefs) if args.normal_briefs else []
    briefs, heldout, axes = write_split(out / "split", args.per_axis, normal)
    t0 = time.perf_counter()
    result = improve_designer(args.designer, args.imagegen, str(briefs), str(heldout), str(out / "improve"),
                              rounds=args.rounds, k=args.k, dpo_config=args.dpo_config, dpo_steps=args.dpo_steps,
                              steps=args.steps, dpo_overrides=args.set, renders=args.renders)
    flow_s = time.perf_counter() - t0
    rounds = result["rounds"]
    reported = sorted({1, args.rounds})
    table: dict[str, dict[str, float]] = {}

    def put(column: str, scores: dict[str, float]) -> None:
        for name, value in scores.items():
            table.setdefault(name if name != "captions" else "held-out: caption vs brief", {})[column] = value

    put("before", per_axis(out / "improve" / "eval-before" / "scores.json", axes))
    for r in reported:
        put(f"round {r}", per_axis(Path(rounds[r - 1]["eval_after"]) / "scores.json", axes))
    world_briefs = Path(args.world) / "briefs_eval.txt"
    normal = {"before": normal_eval(args.designer, args.imagegen, world_briefs, out / "normal-before", args.steps)}
    for r in reported:
        normal[f"round {r}"] = normal_eval(rounds[r - 1]["designer_after"], args.imagegen, world_briefs,
                                           out / f"normal-round-{r}", args.steps)
    for column, scores in normal.items():
        table.setdefault("normal eval set", {})[column] = scores["all"]
        if "captions" in scores:
            table.setdefault("normal eval set: caption vs brief", {})[column] = scores["captions"]
    last = f"round {reported[-1]}"
    weakest = min(set(axes.values()), key=lambda a: table[a]["before"])
    report = {"command": "python -m atelier_studio.bench.improve_shapes " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv),
              "rounds_reported": reported, "table": table, "weakest_axis": weakest,
              "weakest_change": table[weakest][last] - table[weakest]["before"],
              "normal_change": table["normal eval set"][last] - table["normal eval set"]["before"],
              "costs": [{"round": r["round"], **r["costs"]} for r in rounds], "grids": [r["grid"] for r in rounds],
              "flow_seconds": round(flow_s, 1), "dpo": dpo_settings(Path(rounds[0]["designer_after"]))}
    atomic_write_text(out / "improve-shapes.json", json.dumps(report, indent=1), what="report")
    atomic_write_text(out / "improve-shapes.md", report_markdown(report), what="report")
    print(report_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
