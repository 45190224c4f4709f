"""SwiGLU gate: y = silu(g) · u, with silu(g) = g · σ(g).

Shapes: gate [..., F], up [..., F] → [..., F].

Backward:  du = dy · silu(g);  dg = dy · u · σ(g) · (1 + g · (1 − σ(g))).
Saved for backward: g, u (silu is recomputed). Accumulation dtype: fp32, cast back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# --- Triton kernels -------------------------------------------------------------------------------
# (none yet: every device runs the reference below.)

# --- autograd.Function ----------------------------------------------------------------------------
# (comes with the Triton kernel)


# --- public ---------------------------------------------------------------------------------------
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up. gate, up [..., F] (same shape) → [..., F]."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    return swiglu_ref(gate, up)


# --- reference ------------------------------------------------------------------------------------
def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch silu(gate) · up in fp32, cast back to gate.dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
