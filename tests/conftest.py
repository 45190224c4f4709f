"""Session-wide test setup.

Without CUDA, Triton kernels run through Triton's interpreter. TRITON_INTERPRET is read when `@triton.jit`
decorates a kernel, i.e. when a kernels module is first imported — by whichever test directory is collected
first — so it is set here, before any test module is imported. On a GPU host it stays unset and the kernels
compile for real. CPU tests elsewhere call the public functions on CPU tensors, which run the plain-PyTorch
references and never launch a kernel.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
