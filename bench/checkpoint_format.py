"""Sharded checkpoint save and load time: DCP's safetensors storage (what Atelier writes) vs its default pickled format.

    python bench/checkpoint_format.py --params-m 50 --nproc 2 --repeats 3 --out /tmp/ckpt-bench

launches, for each format, `torchrun --nproc-per-node N` over this file on the CPU (gloo): an FSDP2-sharded stack of
linear layers holding `--params-m` million fp32 parameters, one AdamW step (so the state is weights + two moments,
12 bytes a parameter), then `--repeats` saves and loads of the trainer's state dict (pipeline/checkpointer.py's
`_app_state` layout). "safetensors" times pipeline/checkpoint_files.py's own save and load (manifest hashing and fsync
included); "pickle" times `dcp.save` / `dcp.load` with DCP's default FileSystemWriter/Reader, the format earlier
versions wrote, plus the same manifest, written at save and checked at load (so the two differ by the storage layer
only). Prints one markdown row per format: the medians, the state's size and rank 0's peak resident memory after
the first save and at the end; docs/checkpoints.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _worker(fmt: str, params_m: float, repeats: int, out: Path) -> None:
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from atelier_studio.pipeline.checkpoint_files import (
        MANIFEST,
        _describe,
        _write_json,
        load_sharded_checkpoint,
        save_sharded_checkpoint,
        split_tensors,
        verify_checkpoint,
    )
    from atelier_studio.pipeline.distributed import DistContext, barrier

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = DistContext(rank=rank, world_size=world, is_main=rank == 0, enabled=True)
    dim = 2048
    layers = max(1, round(params_m * 1e6 / (dim * dim)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, dim)).sum().backward()
    opt.step()

    def app_state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optimizer": osd, "task": {}}

    saves, loads = [], []
    root = out / fmt
    for i in range(repeats):
        barrier(ctx)
        t0 = time.perf_counter()
        if fmt == "safetensors":
            save_sharded_checkpoint(root, i, app_state(), {}, {}, ctx)
        else:  # what earlier versions wrote: DCP's default storage, a pickled .metadata, then the same manifest
            path = root / f"step-{i}"
            dcp.save(app_state(), checkpoint_id=str(path))
            barrier(ctx)
            if ctx.is_main:
                _write_json(path / MANIFEST, {p.name: _describe(p) for p in sorted(path.iterdir()) if p.is_file()})
        barrier(ctx)
        saves.append(time.perf_counter() - t0)
        if i == 0:  # before any load: the save's own peak
            save_peak = _peak_rss()
        path = root / f"step-{i}"
        live = app_state()
        barrier(ctx)
        t0 = time.perf_counter()
        if fmt == "safetensors":
            load_sharded_checkpoint(path, live, rank)
        else:  # as earlier versions loaded it: the manifest checked first
            verify_checkpoint(path)
            dcp.load(split_tensors(live)[0], checkpoint_id=str(path))
        barrier(ctx)
        loads.append(time.perf_counter() - t0)
        if ctx.is_main:
            size = sum(p.stat().st_size for p in path.iterdir())
            shutil.rmtree(path)
    if ctx.is_main:
        n = sum(p.numel() for p in model.parameters())
        print(json.dumps({"format": fmt, "params": n, "ranks": world, "bytes": size, "save_s": saves,
                          "load_s": loads, "rank0_peak_rss_save": save_peak, "rank0_peak_rss": _peak_rss()}),
              flush=True)
    dist.destroy_process_group()


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB); mapped file pages a reader touched count."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params-m", type=float, default=50.0, help="millions of fp32 parameters (12 bytes each saved)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="/tmp/atelier-ckpt-bench", help="a scratch folder (emptied as it goes)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.out)
    if args.worker:
        _worker(args.worker, args.params_m, args.repeats, out)
        return
    rows = []
    for fmt in ("pickle", "safetensors"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               __file__, "--worker", fmt, "--params-m", str(args.params_m), "--repeats", str(args.repeats),
               "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"torch {torch.__version__}, {args.nproc} gloo processes, CPU, median of {args.repeats}")
    print("| format | state (params, bytes) | save | load | rank 0 peak RSS: saving, then loading |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['params'] / 1e6:.0f} M fp32, {r['bytes'] / 1e6:.0f} MB | "
              f"{statistics.median(r['save_s']):.2f} s | {statistics.median(r['load_s']):.2f} s | "
              f"{r['rank0_peak_rss_save'] / 1e9:.2f} GB, {r['rank0_peak_rss'] / 1e9:.2f} GB |")


if __name__ == "__main__":
    main()
