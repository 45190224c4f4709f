"""`make demo`: the whole product on the shapes world, from a fresh clone, on a CPU, through Prefect.

    python -m atelier_studio.flows.demo [--skip-eval] [--imagegen mmdit|flux]

`--imagegen flux` renders with a FLUX.1-shaped model instead of the SD3-shaped MMDiT (models/imagegen-flux-demo,
configs/imagegen/flux-demo.toml, runs/i1-flux, runs/eval-flux); the world, designer and latent cache are shared.

Steps (each skipped when its output exists, so a re-run continues where the last one stopped):
    1. runs/world            the shapes world (`atelier data synth --n 2000 --image-size 32 --n-text 8000`)
    2. runs/tokenizer        a byte-level BPE tokenizer trained on the world's corpus
    3. models/designer-tiny  a random tiny Qwen3 (fp32);  models/imagegen-demo  a random demo-size MMDiT
    4. runs/world-shards(-eval)  image shards; the latents are cached by train-imagegen's cache step
    5. the local Prefect server + the serve process (`make serve`'s code), left running at the end
    6. prefect deployment run train-designer/default, train-imagegen/default, brief-to-image-eval/default,
       each with --watch (no time limit: a busy machine only makes it slower), so every step shows up in the UI
       with its logs and artifacts; a run of the deployment still going from an earlier `make demo` (interrupted
       while the serve process kept it running) is followed to its end instead of starting a second one
    7. prints the judged scores, where the grid is, and the UI URL

The server and serve process stay up afterwards so the runs can be browsed; `make stop` ends them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from atelier_studio.flows.local_server import REPO, child_env
from atelier_studio.flows.serve import start

WORLD = Path("runs/world")
TOKENIZER = Path("runs/tokenizer")
DESIGNER_MODEL = Path("models/designer-tiny")
SHARDS, EVAL_SHARDS = Path("runs/world-shards"), Path("runs/world-shards-eval")
DESIGNER_CONFIG = "configs/designer/demo.toml"


@dataclass(frozen=True)
class DemoImagegen:
    """One renderer the demo can train: its init size, model folder, config and evaluation folder."""

    size: str
    model: Path
    config: str
    eval_out: Path


IMAGEGENS = {
    "mmdit": DemoImagegen("demo", Path("models/imagegen-demo"), "configs/imagegen/demo.toml", Path("runs/eval")),
    "flux": DemoImagegen("flux-demo", Path("models/imagegen-flux-demo"), "configs/imagegen/flux-demo.toml",
                         Path("runs/eval-flux")),
}
LIVE_STATES = ("SCHEDULED", "PENDING", "RUNNING")  # a flow run in one of these still owns its output folder


def step(name: str, done: bool) -> bool:
    print(f"[demo] {name}: {'exists, skipped' if done else 'running'}", flush=True)
    return not done


def atelier(*argv: str) -> None:
    from atelier_studio.flows.cli import main

    code = main(list(argv))
    if code != 0:
        raise SystemExit(f"[demo] `atelier {' '.join(argv)}` failed with exit code {code}")


def prepare(imagegen: DemoImagegen) -> None:
    # designer_train.jsonl: a world written before text-only briefs existed is rewritten (its images stay the same)
    if step("shapes world", (WORLD / "world.json").is_file() and (WORLD / "designer_train.jsonl").is_file()):
        # 2000 images (1800 train, 200 eval); the designer also learns from 8000 text-only briefs (data/synthetic.py)
        atelier("data", "synth", "--out", str(WORLD), "--n", "2000", "--image-size", "32", "--n-text", "8000")
    if step("tokenizer", (TOKENIZER / "tokenizer.json").is_file()):
        atelier("data", "tokenizer", "--corpus", str(WORLD / "corpus.txt"), "--vocab-size", "1024",
                "--out", str(TOKENIZER))
    if step("tiny designer", (DESIGNER_MODEL / "config.json").is_file()):
        atelier("designer", "init", "--size", "tiny", "--tokenizer", str(TOKENIZER), "--out", str(DESIGNER_MODEL),
                "--dtype", "float32")
    if step(f"{imagegen.size} imagegen", (imagegen.model / "config.json").is_file()):
        # the demo sizes have MiniLM's text width (384) and the pixel codec's 12 channels
        atelier("imagegen", "init", "--size", imagegen.size, "--out", str(imagegen.model), "--dtype", "float32")
    for out, captions in ((SHARDS, "captions.jsonl"), (EVAL_SHARDS, "eval.jsonl")):
        if step(f"image shards {out}", any(out.glob("*.tar"))):
            atelier("data", "shards", "--images", str(WORLD), "--captions", str(WORLD / captions), "--out", str(out),
                    "--shard-size", "500")


def finished(run_dir: Path) -> bool:
    f = run_dir / "summary.json"
    return f.is_file() and not json.loads(f.read_text()).get("interrupted", False)


def live_run(name: str, api_url: str) -> tuple[str, str] | None:
    """(id, name) of the newest flow run of deployment `name` ("flow/deployment") on the server at `api_url`
    that has not ended, or None."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    flow, deployment = name.split("/", 1)

    async def newest() -> tuple[str, str] | None:
        async with get_client() as client:
            runs = await client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])),
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType[s] for s in LIVE_STATES]))),
                sort=FlowRunSort.START_TIME_DESC, limit=1)
        return (str(runs[0].id), runs[0].name) if runs else None

    with temporary_settings({PREFECT_API_URL: api_url}):
        return asyncio.run(newest())


def deployment_run(name: str, params: dict, env: dict) -> None:
    """Start a run of deployment `name` and follow it to its end, or follow the one an earlier demo left going."""
    live = live_run(name, env["PREFECT_API_URL"])
    if live:
        run_id, run_name = live
        print(f"[demo] {name}: flow run '{run_name}' from an earlier `make demo` is still going; following it "
              f"(Ctrl-C stops following, not the run)", flush=True)
        cmd = [sys.executable, "-c", "import sys; from uuid import UUID; from prefect.flow_runs import "
               "wait_for_flow_run; r = wait_for_flow_run(UUID(sys.argv[1]), timeout=None, log_states=True); "
               "sys.exit(0 if r.state and r.state.is_completed() else 1)", run_id]
    else:
        cmd = [sys.executable, "-m", "prefect", "deployment", "run", name, "--params", json.dumps(params), "--watch"]
        print(f"[demo] $ prefect deployment run {name} --params '{json.dumps(params)}' --watch", flush=True)
    code = subprocess.call(cmd, cwd=REPO, env=env)
    if code != 0:
        raise SystemExit(f"[demo] {name} did not complete (exit {code}); see the run in the Prefect UI and "
                         f"{env['PREFECT_HOME']}/logs/serve.log. Re-run `make demo` to resume: finished steps "
                         f"are skipped, a run still going is followed, and training resumes from its last "
                         f"checkpoint.")


def main(argv: Sequence[str] | None = None) -> int:
    from atelier_studio.flows.cli_args import OneLineParser

    p = OneLineParser(prog="python -m atelier_studio.flows.demo", description="the brief-to-image demo on a CPU")
    p.add_argument("--skip-eval", action="store_true")
    p.add_argument("--imagegen", choices=sorted(IMAGEGENS), default="mmdit",
                   help="the renderer: the SD3-shaped MMDiT (default) or a FLUX.1-shaped model")
    args = p.parse_args(argv)
    import os

    imagegen = IMAGEGENS[args.imagegen]
    os.chdir(REPO)  # the configs' relative paths (runs/, models/) are relative to the repo root
    prepare(imagegen)
    ep = start()
    env = child_env(ep)
    from atelier_studio.designer.config import DesignerConfig
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.pipeline.config import load_config

    d_dir = Path(load_config(DesignerConfig, DESIGNER_CONFIG, []).output.dir)
    i_cfg = load_config(ImagegenConfig, imagegen.config, [])
    i_dir = Path(i_cfg.output.dir)
    if step(f"train-designer -> {d_dir}", finished(d_dir)):
        deployment_run("train-designer/default", {"config": DESIGNER_CONFIG}, env)
    if step(f"train-imagegen -> {i_dir}", finished(i_dir)):
        deployment_run("train-imagegen/default", {"config": imagegen.config}, env)
    if not args.skip_eval:
        eval_out = imagegen.eval_out
        if step(f"brief-to-image-eval -> {eval_out}", (eval_out / "scores.json").is_file()):
            # the images are sampled as the imagegen config's [sample] says (its grids use the same settings)
            deployment_run("brief-to-image-eval/default",
                           {"designer": str(d_dir), "imagegen": str(i_dir), "briefs": str(WORLD / "briefs_eval.txt"),
                            "out_dir": str(eval_out), "steps": i_cfg.sample.steps,
                            "guidance": i_cfg.sample.guidance}, env)
        scores = json.loads((eval_out / "scores.json").read_text())
        agg = scores["aggregate"]
        print("\n[demo] judged scores (image against brief):")
        for k in ("score", "color_ok", "shape_ok", "position_ok", "caption_score", "image_caption_score"):
            v = agg.get(k)
            print(f"    {k:20s} {'–' if v is None else f'{100 * v:.1f}%'}")
        print(f"[demo] grid: {scores['files']['grid']}   scores: {scores['files']['scores_csv']}")
    print(f"[demo] Prefect UI: {ep.ui_url}  (server and serve process left running; `make stop` ends them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
