"""Run by tests/pipeline/test_optimizers.py under `torchrun --nproc-per-node 2` (not collected by pytest).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.pipeline.optim_dist_worker OUT OPT...

For each optimizer named: the toy task's model sharded by FSDP2 over the 2 ranks (gloo, CPU), trained 12 steps
(`full`), and the same run killed after step 9 (newest sharded checkpoint: step 8) and resumed (`cut`), in the
folders OUT/<optimizer>/{full,cut}. Each rank reads its own data (the toy loader seeded by the rank). An optimizer
that refuses sharded parameters writes its error to OUT/<optimizer>/refused.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from atelier_studio.pipeline.config import ConfigError, DistributedConfig, OutputConfig, TrainConfig
from atelier_studio.pipeline.distributed import init_distributed, parallelize
from atelier_studio.pipeline.trainer import Trainer, seed_everything

from tests.pipeline.test_optimizers import SETTINGS
from tests.pipeline.toy_task import ToyTask


class Killed(Exception):
    pass


def trainer(out: Path, optimizer: str, kill_at: int | None = None) -> Trainer:
    cfg = TrainConfig(**{"max_steps": 12, "micro_batch": 1, "lr": 1e-2, "warmup_steps": 2, "save_every": 4,
                         "keep_checkpoints": 0, "weight_decay": 0.01, "eval_every": 3, "device": "cpu",
                         "optimizer": optimizer, **SETTINGS.get(optimizer, {})})
    ctx = init_distributed(cfg)
    seed_everything(0)
    task = ToyTask(seed=ctx.rank, hidden=64)
    task.model[1].p = 0.0  # dropout would draw from each rank's generator: keep the ranks' draws out of it
    parallelize(task.model, [task.model[3]], ctx, DistributedConfig(), torch.float32)
    if kill_at is not None:
        task.after_optimizer_step = lambda step: (_ for _ in ()).throw(Killed()) if step == kill_at else None
    return Trainer(task, cfg, OutputConfig(dir=str(out), tensorboard=False), torch.device("cpu"), ctx)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        for name in sys.argv[2:]:
            try:
                trainer(root / name / "full", name).fit()
            except ConfigError as e:
                if dist.get_rank() == 0:
                    (root / name).mkdir(parents=True, exist_ok=True)
                    (root / name / "refused.txt").write_text(str(e))
                continue
            try:
                trainer(root / name / "cut", name, kill_at=10).fit()
                raise SystemExit("the cut run was not stopped")
            except Killed:
                pass
            trainer(root / name / "cut", name).fit()
        dist.barrier()
    finally:
        dist.destroy_process_group()
