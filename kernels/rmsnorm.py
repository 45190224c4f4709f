"""RMSNorm: y = x / sqrt(mean(x², -1) + eps) · w.

Shapes: x [..., D], weight [D] → y [..., D] (same dtype as x).

Forward (per row of D):  r = rsqrt(mean(x²) + eps);  y = x · r · w.
Backward:  dx = r · (dy·w − x · r² · mean(dy·w·x));  dw = Σ_rows dy · x · r.
Saved for backward: x, w, r (one fp32 scalar per row). Accumulation dtype: fp32, cast back at the end.

Note on rounding: Hugging Face's Qwen3RMSNorm rounds the normalised x to the input dtype before
multiplying by w; this reference multiplies in fp32 and rounds once (identical in fp32, within one
bf16 ulp otherwise).
"""
from __future__ import annotations

import torch

# --- Triton kernels -------------------------------------------------------------------------------
# (none yet: the Triton forward/backward and its launcher go here; until then every device runs
#  the reference below, which autograd differentiates.)

# --- autograd.Function ----------------------------------------------------------------------------
# (comes with the Triton kernel)


# --- public ---------------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. x [..., D], weight [D] → [..., D] in x.dtype."""
    if x.shape[-1] != weight.shape[0] or weight.dim() != 1:
        raise ValueError(f"rmsnorm: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on the last dim")
    return rmsnorm_ref(x, weight, eps)


# --- reference ------------------------------------------------------------------------------------
def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain PyTorch RMSNorm in fp32, cast back to x.dtype. x [..., D], weight [D]."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * weight.float()).to(x.dtype)
