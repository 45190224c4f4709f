"""Run by tests/designer/test_distributed.py under `torchrun --nproc-per-node 2` (not collected by pytest).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.designer.dist_worker OUT ARGS_JSON

Several training runs in one launch, so the processes start once: ARGS_JSON maps a run name to its
`atelier` argument list; runs go in file order. The worker owns the process group (gloo) for all of them:
`main()` finds it initialised and leaves it alone.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from atelier_studio.flows.cli import main

if __name__ == "__main__":
    runs = json.loads(open(sys.argv[1]).read())
    dist.init_process_group("gloo")
    try:
        for name, argv in runs.items():
            code = main(argv)
            if code != 0:
                raise SystemExit(f"run {name} exited with {code}")
        # every rank finished before any tears the group down: a rank leaving while its peer was still
        # exporting aborted at exit now and then ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
