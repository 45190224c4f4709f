"""Run by tests/designer/test_distributed.py under `torchrun --nproc-per-node 2` (not collected by pytest).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.designer.dist_worker OUT ARGS_JSON

Several training runs in one launch (each `main()` makes and destroys its own process group), so the
processes start once: ARGS_JSON maps a run name to its `atelier` argument list; runs go in file order.
"""

from __future__ import annotations

import json
import sys

from pipeline.cli import main

if __name__ == "__main__":
    runs = json.loads(open(sys.argv[1]).read())
    for name, argv in runs.items():
        code = main(argv)
        if code != 0:
            raise SystemExit(f"run {name} exited with {code}")
