"""Run by tests/pipeline/test_optimizers.py under `torchrun --nproc-per-node 2` (not collected by pytest).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.pipeline.optim_dist_worker OUT OPT...

For each optimizer named: the toy task's model sharded by FSDP2 over the 2 ranks (gloo, CPU), trained 12 steps
(`full`), and the same run killed after step 9 (newest sharded checkpoint: step 8) and resumed (`cut`), in the
folders OUT/<optimizer>/{full,cut}. Each rank reads its own data (the toy loader seeded by the rank).

For the optimizers that step the shards with Atelier's own code (adafactor, prodigy: pipeline/sharded_*.py), also
OUT/<optimizer>/parity.safetensors: parameters of awkward shapes (rows that do not split evenly, a shard with no
rows, 3 dims) stepped 6 times with the same gradients twice, sharded over the ranks and whole on each rank with the
library's own optimizer; every weight and state tensor of both (`sharded/NAME.KEY`, `whole/NAME.KEY`) and the
weights they started from (`init/NAME.weight`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from atelier_studio.pipeline.config import DistributedConfig, OutputConfig, TrainConfig
from atelier_studio.pipeline.distributed import init_distributed, parallelize
from atelier_studio.pipeline.optimizer_config import ProdigyConfig
from atelier_studio.pipeline.optimizers import build_optimizers
from atelier_studio.pipeline.trainer import Trainer, seed_everything

from tests.pipeline.test_optimizers import PARITY, SETTINGS
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


# rows that split unevenly (5 = 3 + 2), a shard with no rows (1 = 1 + 0), 3 dims, vectors, an all-zero matrix
# (Prodigy's p0)
SHAPES = {"matrix": (5, 7), "thin": (1, 6), "cube": (3, 4, 6), "vector": (7,), "one": (1,), "zero": (4, 3)}


def parity(out: Path, optimizer: str) -> None:
    """The sharded optimizer and the library's own on the same weights and gradients (module docstring)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    whole = {n: torch.nn.Parameter(torch.zeros(s) if n == "zero" else torch.randn(s, generator=g))
             for n, s in SHAPES.items()}
    sharded = {n: torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)]))
               for n, p in whole.items()}
    # Prodigy from d0 = 1e-3: steps well above an ulp of the weights within 6 steps
    cfg = TrainConfig(optimizer=optimizer, weight_decay=0.1, **{"lr": 1e-2, **SETTINGS.get(optimizer, {})},
                      **({"prodigy": ProdigyConfig(d0=1e-3)} if optimizer == "prodigy" else {}))
    opts = {"whole": build_optimizers(list(whole.items()), cfg, torch.device("cpu")),
            "sharded": build_optimizers(list(sharded.items()), cfg, torch.device("cpu"), sharded=True)}
    saved = {f"init/{n}.weight": p.detach().clone() for n, p in whole.items()}
    drift = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}  # a steady direction: Prodigy's d grows
    for _ in range(6):
        grads = {n: drift[n] + 0.5 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
        for n in SHAPES:
            whole[n].grad = grads[n].clone()
            sharded[n].grad = distribute_tensor(grads[n].clone(), mesh, [Shard(0)])
        for opt in opts.values():
            opt.step()
    for kind, params in [("sharded", sharded), ("whole", whole)]:
        state = opts[kind].parts[0].state
        for n, p in params.items():
            full = {"weight": p, **{k: v for k, v in state[p].items() if torch.is_tensor(v)}}
            for k, v in full.items():
                saved[f"{kind}/{n}.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().contiguous()
        group = opts[kind].param_groups[0]
        saved |= {f"{kind}/group.{k}": torch.tensor(float(group[k]), dtype=torch.float64)
                  for k in ("d", "d_max") if k in group}  # Prodigy's step size
    for key in [k for k in saved if k.startswith("whole/")]:  # prodigyopt keeps s and p0 flat, p0 = 0 when all-zero
        other = saved[key.replace("whole/", "sharded/")]
        saved[key] = saved[key].reshape(other.shape) if saved[key].ndim else saved[key].expand(other.shape).clone()
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(saved, out / "parity.safetensors")


if __name__ == "__main__":
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        for name in sys.argv[2:]:
            if name in PARITY:
                parity(root / name, name)
            trainer(root / name / "full", name).fit()
            try:
                trainer(root / name / "cut", name, kill_at=10).fit()
                raise SystemExit("the cut run was not stopped")
            except Killed:
                pass
            trainer(root / name / "cut", name).fit()
        dist.barrier()
    finally:
        dist.destroy_process_group()
