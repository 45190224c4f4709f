"""Run the Triton kernels through Triton's interpreter on machines without CUDA.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, i.e. when a kernels module is first
imported. It is set here only without CUDA (on a GPU host the kernels must compile for real), and
kernel modules another test directory imported earlier in the same session are reloaded so their
kernels are re-decorated for the interpreter. Other directories are unaffected: their public calls
on CPU tensors run the plain-PyTorch references and never launch a kernel.
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in [n for n in sys.modules if n.startswith("kernels.")]:
        importlib.reload(sys.modules[_name])
