"""Flow `brief-to-image`: train the designer, train the imagegen, evaluate the chain — three subflows.

    python -m atelier_studio.flows.chain                  # the demo configs
    prefect deployment run brief-to-image/default --watch --watch-timeout 3600

Each subflow is the same flow that is deployed on its own (`train-designer`, `train-imagegen`,
`brief-to-image-eval`), called in-process so they show up nested under this run in the UI; they hand each
other output directories, never tensors. The evaluation reads the designer run's export (model/ or
adapter/) and the imagegen run's ema/ (else transformer/) directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from prefect import flow

from atelier_studio.flows.evaluate import brief_to_image_eval
from atelier_studio.flows.launch import kill_trainers_hook
from atelier_studio.flows.train_designer import train_designer
from atelier_studio.flows.train_imagegen import train_imagegen


@flow(name="brief-to-image", on_cancellation=[kill_trainers_hook], on_crashed=[kill_trainers_hook])
def brief_to_image(designer_config: str = "designer/demo",
                   imagegen_config: str = "imagegen/demo",
                   briefs: str = "runs/world/briefs_eval.txt", out_dir: str = "runs/eval",
                   designer_overrides: list[str] | None = None, imagegen_overrides: list[str] | None = None,
                   nproc: int = 1, seed: int = 0, steps: int = 20, guidance: float = 4.0) -> dict[str, Any]:
    """Train both models, then judge brief → caption → image; returns the evaluation's aggregate and files."""
    designer_dir = train_designer(designer_config, overrides=designer_overrides, nproc=nproc)
    imagegen_dir = train_imagegen(imagegen_config, overrides=imagegen_overrides, nproc=nproc)
    return brief_to_image_eval(designer_dir, imagegen_dir, briefs, out_dir, seed=seed, steps=steps, guidance=guidance)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atelier_studio.flows.chain", description="run the brief-to-image flow")
    p.add_argument("--designer-config", default="designer/demo")
    p.add_argument("--imagegen-config", default="imagegen/demo")
    p.add_argument("--briefs", default="runs/world/briefs_eval.txt")
    p.add_argument("--out", default="runs/eval")
    p.add_argument("--nproc", type=int, default=1)
    args = p.parse_args(argv)
    from atelier_studio.flows.local_server import require_server

    require_server("python -m atelier_studio.flows.chain")
    result = brief_to_image(args.designer_config, args.imagegen_config, args.briefs, args.out, nproc=args.nproc)
    print(json.dumps(result["aggregate"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
