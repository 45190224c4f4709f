"""Flow `improve-designer`: preference-tune the designer on judged renders of its own captions, for N rounds.

    python -m atelier_studio.flows.improve --designer runs/d1 --imagegen runs/i1 --briefs briefs.txt \
        --eval-briefs heldout.txt --out runs/improve [--rounds 3 --k 4 --temperature 1.0 --margin 0]
    prefect deployment run improve-designer/default -p designer=runs/d1 -p imagegen=runs/i1 \
        -p briefs=briefs.txt -p eval_briefs=heldout.txt -p out_dir=runs/improve --watch --watch-timeout 7200

One round, in <out>/round-<r>/ (flows pass paths, never tensors):
    1. samples/   the designer samples k captions per brief at `temperature`, seed `seed + r`, and each is
                  rendered and judged (flows/judged_pairs.py: brief-to-image-eval's own steps), `renders` times
                  from other noise when `renders` > 1 (a caption's score: the mean over its renders)
    2. pairs/     best vs worst of each brief beyond `margin` (ties dropped): pairs.jsonl in the `brief_pair`
                  format, scores.jsonl, the images; written whole or not at all
    3. dpo/       `train-designer` as a subflow with train.objective = "dpo" on pairs.jsonl, from `dpo_config`
                  (default designer/demo-dpo: LoRA rank 16, lr 3e-4, 200 steps, the NLL anchor sft_weight 1;
                  `dpo_steps` / `lora_rank` override it when not 0, `dpo_params` / `dpo_overrides` set the rest):
                  LoRA on the round's designer (a model directory: fresh adapters; an adapter: lora.init_adapter,
                  so the reference is that adapter's model)
    4. eval-after/ `brief-to-image-eval` of the new designer on the held-out `eval_briefs` (greedy); the designer
                  it starts from was evaluated the same way before (round 1: <out>/eval-before/, then the previous
                  round's eval-after/)
    5. round.json written last: the round's costs (samples, renders, seconds sampling / rendering / judging /
                  training, pairs kept and dropped), the before/after scores and the new designer. A re-run reads a
                  round that has it instead of redoing it; an unfinished round keeps its pairs when they were
                  written (else samples again, from the same seed) and its DPO run resumes from its newest checkpoint.

Artifacts (Prefect): per round a markdown summary with the before/after score table and a grid of the same held-out
briefs before (top row) and after (bottom row), a per-brief before/after table, and one summary of every round's
costs. The DPO run logs to the trackers of its config (`[output] trackers`), and the round adds its before/after
scores, per-brief table and grid to those same tracker runs, one step after the run's last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from prefect import flow, task

from atelier_studio.flows.evaluate import (
    brief_to_image_eval,
    read_brief_lines,
    resolve_designer,
    resolve_imagegen,
)
from atelier_studio.flows.judged_pairs import sample_and_judge, select_pairs, write_pairs
from atelier_studio.flows.launch import kill_trainers_hook
from atelier_studio.flows.params import to_overrides
from atelier_studio.flows.report import image_markdown, in_prefect_run, make_grid
from atelier_studio.flows.train_designer import DesignerParams, train_designer
from atelier_studio.flows.training import FlowInputError
from atelier_studio.pipeline.atomic import atomic_write_text

ROUND_FILE = "round.json"
SCORE_KEYS = ("score", "color_ok", "shape_ok", "position_ok", "detected", "caption_score")


def check_params(designer: str, imagegen: str, briefs: str, eval_briefs: str, k: int, margin: float, rounds: int,
                 temperature: float, renders: int = 1) -> None:
    """One line naming the first parameter that cannot work, before anything runs."""
    if k < 2:
        raise FlowInputError(f"k: a pair needs at least 2 sampled captions per brief, got k = {k}")
    if margin < 0:
        raise FlowInputError(f"margin: must be >= 0 (the score gap a pair's best must exceed), got {margin}")
    if rounds < 1:
        raise FlowInputError(f"rounds: must be >= 1, got {rounds}")
    if renders < 1:
        raise FlowInputError(f"renders: each caption needs at least one render, got renders = {renders}")
    if temperature <= 0:
        raise FlowInputError(f"temperature: k samples at temperature {temperature} are all the greedy caption; "
                             f"use > 0 (e.g. 1.0)")
    for name, path in (("briefs", briefs), ("eval_briefs", eval_briefs)):
        if not Path(path).is_file():
            raise FlowInputError(f"{name}: briefs file {path} does not exist (.txt one brief per line, or .jsonl)")
    resolve_designer(designer)
    resolve_imagegen(imagegen)


def dpo_run_sets(designer: str | Path, pairs: Path, out: Path, steps: int, lora_rank: int,
                  user: Sequence[str]) -> list[str]:
    """The DPO run's --set items: the flow's `dpo_steps` / `lora_rank` when not 0 (0: the config's), then the user's,
    then what this round fixes (model, data, output)."""
    model_dir, adapter_dir = resolve_designer(designer)
    items = ["train.eval_every=0"]
    if lora_rank:
        items += [f"lora.rank={lora_rank}", f"lora.alpha={2.0 * lora_rank}"]
    if steps:
        items += [f"train.max_steps={steps}", f"train.warmup_steps={min(10, steps // 10)}",
                  f"train.save_every={steps}"]
    items += list(user)
    items += [f"model.path={model_dir}", f"data.train={pairs}", "data.format=brief_pair", "data.eval=",
              "train.objective=dpo", f"output.dir={out}", "train.resume=auto"]
    if adapter_dir is not None:
        items.append(f"lora.init_adapter={adapter_dir}")
    return items


def before_after(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, str]]:
    """The aggregate table: one row per check, before, after and the change in points."""
    rows = []
    for key in SCORE_KEYS:
        b, a = before["aggregate"].get(key), after["aggregate"].get(key)
        if b is None or a is None:
            continue
        rows.append({"check": key, "before": f"{100 * b:.1f}", "after": f"{100 * a:.1f}",
                     "change": f"{100 * (a - b):+.1f}"})
    return rows


def per_brief_rows(before_dir: Path, after_dir: Path) -> list[dict[str, str]]:
    before = json.loads((before_dir / "scores.json").read_text())["per_brief"]
    after = json.loads((after_dir / "scores.json").read_text())["per_brief"]
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    return [{"brief": b["brief"], "caption_before": b["caption"], "score_before": fmt(b["score"]),
             "caption_after": a["caption"], "score_after": fmt(a["score"])} for b, a in zip(before, after)]


def before_after_grid(before_dir: Path, after_dir: Path, out_file: Path, max_briefs: int = 16) -> Path | None:
    """The same held-out briefs before (top row) and after (bottom row); a brief without an image on either side
    is left out."""
    before = json.loads((before_dir / "scores.json").read_text())["per_brief"]
    after = json.loads((after_dir / "scores.json").read_text())["per_brief"]
    both = [(b["image"], a["image"]) for b, a in zip(before, after) if b["image"] and a["image"]][:max_briefs]
    if not both:
        return None
    return make_grid([Path(b) for b, _ in both] + [Path(a) for _, a in both], out_file, cols=len(both), scale=2)


def round_markdown(r: dict[str, Any]) -> str:
    c = r["costs"]
    lines = [f"# improve-designer round {r['round']}", "",
             f"{c['samples']} samples ({c['briefs']} briefs × k {c['k']}, temperature {c['temperature']}, seed "
             f"{c['seed']}), {c['renders']} renders, judge {c['judge_s']:.1f} s; pairs kept {c['pairs']} "
             f"(dropped: {c['ties']} ties, {c['within_margin']} within the margin, {c['too_few']} with < 2 usable)",
             "", f"Designer: `{r['designer_before']}` → `{r['designer_after']}`", "",
             "| check | before | after | change (points) |", "|---|---|---|---|"]
    lines += [f"| {row['check']} | {row['before']} | {row['after']} | {row['change']} |" for row in r["table"]]
    if r.get("grid"):
        lines += ["", image_markdown(Path(r["grid"]), "held-out briefs: before (top), after (bottom)")]
    return "\n".join(lines)


def costs_markdown(rounds: list[dict[str, Any]]) -> str:
    lines = ["# improve-designer", "", "| round | samples | renders | sample s | render s | judge s | DPO s | pairs "
             "kept | ties | within margin | score before | score after |", "|" + "---|" * 12]
    for r in rounds:
        c, agg = r["costs"], {row["check"]: row for row in r["table"]}
        s = agg.get("score", {})
        lines.append(f"| {r['round']} | {c['samples']} | {c['renders']} | {c['sample_s']:.1f} | {c['render_s']:.1f} "
                     f"| {c['judge_s']:.1f} | {c['dpo_s']:.1f} | {c['pairs']} | {c['ties']} | {c['within_margin']} "
                     f"| {s.get('before', '–')} | {s.get('after', '–')} |")
    lines += ["", f"Final designer: `{rounds[-1]['designer_after']}`"]
    return "\n".join(lines)


def publish_round(r: dict[str, Any]) -> None:
    if not in_prefect_run():
        return
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_markdown_artifact(round_markdown(r), key=f"improve-designer-round-{r['round']}",
                             description=f"round {r['round']}: before/after scores and grid")
    create_table_artifact(r["per_brief"], key=f"improve-designer-round-{r['round']}-briefs",
                          description=f"round {r['round']}: each held-out brief's caption and score, before and after")


def report_to_trackers(run_dir: str | Path, r: dict[str, Any]) -> list[str]:
    """The round's before/after scores (scalars `improve/<check>_before`, `_after`), the per-brief table and the grid
    into the DPO run's own trackers (its `[output] trackers`), continuing the runs its last checkpoint names, one step
    after its last; returns the trackers written to ([] when the run has none)."""
    from atelier_studio.data.textfile import read_json
    from atelier_studio.designer.config import DesignerConfig
    from atelier_studio.pipeline.checkpoint_files import list_checkpoints
    from atelier_studio.pipeline.config import load_config
    from atelier_studio.pipeline.trackers import RunInfo, git_commit, open_trackers, system_info

    run_dir = Path(run_dir)
    out = load_config(DesignerConfig, run_dir / "config.toml").output
    names = out.active_trackers()
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    if not names or not checkpoints:
        return []
    state = read_json(checkpoints[-1] / "state.json", FlowInputError)
    step = int(state["step"])
    # params={}: the run logged its config when it started; a resumed tracker run only adds keys it lacks
    info = RunInfo(out_dir=run_dir, name=out.run_name or run_dir.resolve().name, group=out.group, project=out.project,
                   params={}, git_commit=git_commit(), system=system_info(), resume_step=step)
    trackers = open_trackers(names, info, state.get("trackers", {}))
    values = {}
    for row in r["table"]:
        values[f"improve/{row['check']}_before"] = float(row["before"])
        values[f"improve/{row['check']}_after"] = float(row["after"])
    values["improve/pairs"] = float(r["costs"]["pairs"])
    trackers.scalars(step + 1, values)
    columns = list(r["per_brief"][0]) if r["per_brief"] else []
    if columns:
        trackers.table("improve/held_out", columns, [[row[c] for c in columns] for row in r["per_brief"]], step + 1)
    if r.get("grid"):
        trackers.image("improve/before_after", Path(r["grid"]), step + 1)
    trackers.finish({}, interrupted=False)
    return list(names)


@task(name="sample-and-judge")
def sample_task(designer: str, imagegen: str, briefs: list[str], k: int, out_dir: str, temperature: float, seed: int,
                max_new_tokens: int, steps: int, guidance: float, clip: str, renders: int = 1
                ) -> tuple[list, dict[str, Any]]:
    groups, costs = sample_and_judge(designer, imagegen, briefs, k, out_dir, temperature, seed, max_new_tokens,
                                     steps, guidance, clip or None, renders)
    return groups, costs


@task(name="write-pairs")
def pairs_task(groups: list, margin: float, out_dir: str, costs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The pairs dataset, with the costs of sampling (`costs`) and the selection's counts in its costs.json."""
    selection = select_pairs(groups, margin)
    if not selection.pairs:
        raise FlowInputError(f"{out_dir}: no pairs ({selection.ties} ties, {selection.within_margin} within margin "
                             f"{margin}, {selection.too_few} briefs with fewer than 2 usable samples): raise k or the "
                             f"temperature, lower the margin, or give more briefs")
    costs = {**costs, "pairs": len(selection.pairs), "ties": selection.ties,
             "within_margin": selection.within_margin, "too_few": selection.too_few}
    return str(write_pairs(selection, out_dir, costs)), costs


def run_round(r: int, designer: str, imagegen: str, briefs: list[str], eval_briefs: str, out: Path,
              before_dir: Path, before: dict[str, Any], k: int, temperature: float, seed: int, margin: float,
              dpo_config: str, dpo_steps: int, lora_rank: int, user_sets: list[str], max_new_tokens: int, steps: int,
              guidance: float, clip: str, renders: int = 1) -> dict[str, Any]:
    import time

    rdir = out / f"round-{r}"
    if (rdir / "pairs" / "costs.json").is_file():  # an unfinished round whose pairs are written: train on those
        pairs, costs = str(rdir / "pairs" / "pairs.jsonl"), json.loads((rdir / "pairs" / "costs.json").read_text())
    else:
        groups, costs = sample_task(designer, imagegen, briefs, k, str(rdir / "samples"), temperature, seed + r,
                                    max_new_tokens, steps, guidance, clip, renders)
        pairs, costs = pairs_task(groups, margin, str(rdir / "pairs"), costs)
    t0 = time.perf_counter()
    dpo_dir = train_designer(dpo_config, overrides=dpo_run_sets(designer, Path(pairs), rdir / "dpo", dpo_steps,
                                                                 lora_rank, user_sets))
    dpo_s = time.perf_counter() - t0
    after_dir = rdir / "eval-after"
    after = brief_to_image_eval(dpo_dir, imagegen, eval_briefs, str(after_dir), seed=seed,
                                max_new_tokens=max_new_tokens, steps=steps, guidance=guidance, clip=clip)
    grid = before_after_grid(before_dir, after_dir, rdir / "before_after.png")
    result = {"round": r, "designer_before": str(designer), "designer_after": str(dpo_dir),
              "eval_before": str(before_dir), "eval_after": str(after_dir), "pairs": pairs,
              "costs": {**costs, "briefs": len(briefs), "k": k, "temperature": temperature, "seed": seed + r,
                        "dpo_s": round(dpo_s, 3)},
              "before": before["aggregate"], "after": after["aggregate"], "table": before_after(before, after),
              "per_brief": per_brief_rows(before_dir, after_dir), "grid": str(grid) if grid else None}
    # the DPO run's folder keeps the before/after evaluation beside its metrics
    atomic_write_text(Path(dpo_dir) / "improve_eval.json", json.dumps(
        {k_: result[k_] for k_ in ("round", "before", "after", "table")}, indent=1), what="before/after scores")
    result["trackers"] = report_to_trackers(dpo_dir, result)
    atomic_write_text(rdir / ROUND_FILE, json.dumps(result, indent=1), what="round summary")
    return result


@flow(name="improve-designer", on_cancellation=[kill_trainers_hook], on_crashed=[kill_trainers_hook])
def improve_designer(designer: str, imagegen: str, briefs: str, eval_briefs: str, out_dir: str = "runs/improve",
                     rounds: int = 1, k: int = 4, temperature: float = 1.0, seed: int = 0, margin: float = 0.0,
                     dpo_config: str = "designer/demo-dpo", dpo_steps: int = 0, lora_rank: int = 0,
                     dpo_params: DesignerParams | None = None, dpo_overrides: list[str] | None = None,
                     max_new_tokens: int = 64, steps: int = 20, guidance: float = 4.0,
                     clip: str = "", renders: int = 1) -> dict[str, Any]:
    """`rounds` rounds of sample k captions per brief → render → judge → pairs → DPO → held-out evaluation (module
    docstring); returns every round's summary and the final designer."""
    check_params(designer, imagegen, briefs, eval_briefs, k, margin, rounds, temperature, renders)
    brief_list = [b for _, b in read_brief_lines(briefs)]
    user_sets = to_overrides(dpo_params) + list(dpo_overrides or [])
    out = Path(out_dir)
    before_dir = out / "eval-before"
    if (before_dir / "scores.json").is_file():  # a re-run: the first designer's evaluation is done
        before = json.loads((before_dir / "scores.json").read_text())
    else:
        before = brief_to_image_eval(designer, imagegen, eval_briefs, str(before_dir), seed=seed,
                                     max_new_tokens=max_new_tokens, steps=steps, guidance=guidance, clip=clip)
    results, current = [], str(designer)
    for r in range(1, rounds + 1):
        done = out / f"round-{r}" / ROUND_FILE
        if done.is_file():  # a finished round of an earlier run: read, not redone
            result = json.loads(done.read_text())
        else:
            result = run_round(r, current, imagegen, brief_list, eval_briefs, out, before_dir, before, k, temperature,
                               seed, margin, dpo_config, dpo_steps, lora_rank, user_sets, max_new_tokens, steps,
                               guidance, clip, renders)
        publish_round(result)
        results.append(result)
        current, before_dir = result["designer_after"], Path(result["eval_after"])
        before = json.loads((before_dir / "scores.json").read_text())
    summary = costs_markdown(results)
    atomic_write_text(out / "summary.md", summary, what="improve-designer summary")
    if in_prefect_run():
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(summary, key="improve-designer-summary",
                                 description="every round's costs, pairs and held-out score")
    return {"rounds": [{k_: v for k_, v in r.items() if k_ != "per_brief"} for r in results], "designer": current,
            "summary": str(out / "summary.md")}


def main(argv: Sequence[str] | None = None) -> int:
    from atelier_studio.flows.cli_args import SEED, Bounds, OneLineParser, check_numbers, number
    from atelier_studio.pipeline.errors import AtelierError, one_line

    p = OneLineParser(prog="python -m atelier_studio.flows.improve", description="run improve-designer")
    p.add_argument("--designer", required=True, help="the SFT designer: a model, adapter or run directory")
    p.add_argument("--imagegen", required=True, help="what `atelier imagegen sample --model` takes, or a run directory")
    p.add_argument("--briefs", required=True, help="the briefs to sample on (.txt or .jsonl)")
    p.add_argument("--eval-briefs", required=True, help="held-out briefs for the before/after evaluation")
    p.add_argument("--out", default="runs/improve")
    number(p, "--rounds", type=int, bounds=Bounds(1, 1000, meaning="improvement rounds"), default=1)
    number(p, "--k", type=int, bounds=Bounds(2, 1024, meaning="captions sampled per brief"), default=4)
    number(p, "--temperature", type=float, bounds=Bounds(0, 100, low_open=True, meaning="sampling temperature"),
           default=1.0)
    number(p, "--seed", type=int, bounds=SEED, default=0)
    number(p, "--margin", type=float, bounds=Bounds(0, 1e6, meaning="the score gap a pair's best must exceed"),
           default=0.0)
    number(p, "--renders", type=int, bounds=Bounds(1, 64, meaning="renders judged per caption (its score: their "
                                                                     "mean)"), default=1)
    p.add_argument("--dpo-config", default="designer/demo-dpo",
                   help="the DPO run's config (a name from `atelier config list`, or a file)")
    number(p, "--dpo-steps", type=int, bounds=Bounds(0, 10**9, meaning="DPO steps per round (0: the config's)"),
           default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a DPO run config override")
    args = p.parse_args(argv)
    from atelier_studio.flows.local_server import ServerNotRunning, require_server

    try:  # bad values, missing files and no server are one line each, before anything runs
        check_numbers(p, args)
        check_params(args.designer, args.imagegen, args.briefs, args.eval_briefs, args.k, args.margin, args.rounds,
                     args.temperature, args.renders)
        require_server("python -m atelier_studio.flows.improve")
    except (AtelierError, ServerNotRunning) as e:
        sys.stderr.write(f"atelier: error: {one_line(str(e))}\n")
        return 2
    result = improve_designer(args.designer, args.imagegen, args.briefs, args.eval_briefs, args.out, args.rounds,
                              args.k, args.temperature, args.seed, args.margin, args.dpo_config, args.dpo_steps,
                              dpo_overrides=args.set, renders=args.renders)
    print(Path(result["summary"]).read_text())
    return 0

if __name__ == "__main__":
    sys.exit(main())
