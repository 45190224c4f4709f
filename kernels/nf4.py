"""NF4 weights: 4-bit NormalFloat with double-quantised block scales (QLoRA, Dettmers et al. 2023, arXiv:2305.14314).

Shapes: O out-features (rows), I in-features (I a multiple of 64), n_b = O·I / 64 blocks, G = ⌈n_b / 256⌉ scale
groups; any leading dims E (a stack of expert matrices) come first and each matrix is quantised on its own.

The format is torchao's NF4Tensor (`torchao.quantization...nf4_tensor.to_nf4(w, block_size=64,
scaler_block_size=256)`, what torchtune's QLoRA uses), stored as plain tensors with the rows kept apart so that
FSDP2 can shard them by rows. With w the row-major flattening of W [O, I], and d the weight's dtype:
  blocks     b = 0 … n_b−1 of 64 consecutive elements (I % 64 == 0: a block never crosses a row);
  absmax_b   = max |w_i| over block b                                     (d)
  mean       = mean over b of absmax_b                                     (d, scalar)
  c_b        = absmax_b − mean                                              (d)
  factor_g   = 256 / (2 · max |c_b| over the 256 blocks b of group g)      (d; a group of equal maxima: 1)
  scalers_b  = int8(clamp(round(c_b · factor_{b/256}), −128, 127))         (the double quantisation)
  idx_i      = the code level nearest to w_i / absmax_b (the first on a tie), 4 bits
  data       = idx_{2j} << 4 | idx_{2j+1}, one byte per pair of neighbours (the even element in the high nibble)
  code       = the 16 NF4 levels (Appendix E of the paper) to 4 decimals, rounded to d, as torchao stores them.
Dequantisation, every operation rounded to d as torchao's `get_original_weight` computes it:
  s_b = d(d(scalers_b / factor_{b/256}) + mean),   w_i = d(code[idx_i] · s_b).
Stored per weight: a 4-bit code plus an 8-bit scaler per 64 weights, 0.516 bytes; factor, mean and code add
1/16384 of that and stay whole on every rank.

Layout of NF4Weight (the torchao tensors, viewed): data uint8 [E…, O, I/2] (torchao's quantized_data),
scalers int8 [E…, O, I/64] (quantized_scalers), factor d [E…, G] (quantization_factor), mean d [E…] (scaler_mean),
code d [16] (nf4). For numel a multiple of 64·256 every tensor equals torchao's bit for bit (tested); torchao
refuses other sizes, for which the last group here holds fewer than 256 blocks and takes its factor from them.

A block whose values are all zero quantises to zeros, and a group whose block maxima all equal the mean takes the
factor 1 (torchao divides 0 by 0 in both); nothing else differs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 64  # elements per absmax block
GROUP = 256  # blocks per double-quantisation group
# The NF4 levels as torchao stores them (to 4 decimals): quantiles of N(0, 1) normalised to [−1, 1], with an exact 0
NF4_LEVELS = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
              0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
# The widest gap between neighbouring levels (0.7230 → 1.0): a value inside a block is at most half of it times
# the block's absmax from its level
MAX_LEVEL_GAP = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:]))
_CHUNK = 1 << 22  # elements per nearest-level search (a [chunk, 16] difference tensor)


@dataclass(frozen=True)
class NF4Weight:
    """A frozen weight [E…, O, I] in NF4 (the module docstring's format); `dtype` is the original weight's."""

    data: torch.Tensor  # uint8 [E…, O, I/2]
    scalers: torch.Tensor  # int8 [E…, O, I/64]
    factor: torch.Tensor  # dtype [E…, G]
    mean: torch.Tensor  # dtype [E…]
    code: torch.Tensor  # dtype [16]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-1], 2 * self.data.shape[-1])

    @property
    def dtype(self) -> torch.dtype:
        return self.code.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __getitem__(self, e: int) -> NF4Weight:
        """Expert `e` of a stack [E, O, I] (views, no copy)."""
        if self.data.dim() < 3:
            raise IndexError(f"NF4Weight of shape {self.shape} has no leading expert dimension")
        return NF4Weight(self.data[e], self.scalers[e], self.factor[e], self.mean[e], self.code)


def nf4_supported(in_features: int) -> bool:
    """Whether a weight with this many input features fits the format (its blocks of 64 must not cross rows)."""
    return in_features % BLOCK == 0


def nf4_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The shapes of NF4Weight's tensors for a weight of `shape` [E…, O, I] (for meta-device construction)."""
    *lead, o, i = shape
    if not nf4_supported(i):
        raise ValueError(f"nf4: in_features {i} of weight {tuple(shape)} is not a multiple of {BLOCK}")
    groups = math.ceil(o * i // BLOCK / GROUP)
    return {"data": (*lead, o, i // 2), "scalers": (*lead, o, i // BLOCK), "factor": (*lead, groups),
            "mean": tuple(lead), "code": (len(NF4_LEVELS),)}


def nf4_code(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=dtype, device=device)


@torch.no_grad()
def quantize_nf4(weight: torch.Tensor) -> NF4Weight:
    """W [E…, O, I] (a float dtype, I % 64 == 0) → its NF4Weight, computed on W's device in W's dtype."""
    if weight.dim() < 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_nf4: expected a float weight [..., O, I], got {weight.dtype} {tuple(weight.shape)}")
    shapes = nf4_shapes(tuple(weight.shape))
    *lead, o, i = weight.shape
    mats = weight.detach().reshape(-1, o * i // BLOCK, BLOCK)  # [E, n_b, 64]
    code = nf4_code(weight.dtype, weight.device)
    data, scalers, factors, means = [], [], [], []
    for blocks in mats:  # one matrix at a time: its own mean and groups, and bounded temporaries
        absmax = blocks.abs().amax(dim=1)  # [n_b]
        mean = absmax.mean()
        q, factor = _double_quantize(absmax - mean)
        data.append(_nearest_levels(blocks, absmax, code))
        scalers.append(q)
        factors.append(factor)
        means.append(mean)
    return NF4Weight(torch.stack(data).view(shapes["data"]), torch.stack(scalers).view(shapes["scalers"]),
                     torch.stack(factors).view(shapes["factor"]), torch.stack(means).view(shapes["mean"]), code)


def _double_quantize(centred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c [n_b] → (int8 scalers [n_b], factor [G]) per group of 256 blocks (the last may be shorter)."""
    n = centred.numel()
    groups = math.ceil(n / GROUP)
    padded = torch.zeros(groups * GROUP, dtype=centred.dtype, device=centred.device)
    padded[:n] = centred  # zeros never raise a group's max |c|
    padded = padded.view(groups, GROUP)
    gmax = padded.abs().amax(dim=1)  # [G]
    factor = 256 / (2 * gmax)
    factor = torch.where(gmax == 0, torch.ones_like(factor), factor)  # every c of the group is 0: any factor works
    q = (padded * factor[:, None]).round().clamp(-128, 127).to(torch.int8)
    return q.view(-1)[:n], factor


def _nearest_levels(blocks: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """blocks [n_b, 64] → packed code indices uint8 [n_b·32], nearest level of v / absmax in the weight's dtype."""
    safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax)  # an all-zero block: 0 / 1 = 0, level 7
    scaled = (blocks / safe[:, None]).view(-1)
    idx = torch.empty(scaled.numel(), dtype=torch.uint8, device=scaled.device)
    for start in range(0, scaled.numel(), _CHUNK):
        part = scaled[start:start + _CHUNK]
        idx[start:start + _CHUNK] = (part[:, None] - code).abs().min(dim=1).indices.to(torch.uint8)
    return (idx[0::2] << 4) | idx[1::2]


def dequantize_nf4(w: NF4Weight) -> torch.Tensor:
    """The weight [E…, O, I] in w.dtype, every operation rounded to it as torchao's NF4Tensor dequantises."""
    *lead, o, half = w.data.shape
    i = 2 * half
    idx = torch.stack([w.data >> 4, w.data & 15], dim=-1).view(*lead, o, i).long()  # [E…, O, I]
    n_b = o * i // BLOCK
    group_of = torch.arange(n_b, device=w.device) // GROUP  # [n_b]
    scalers = w.scalers.reshape(*lead, n_b)
    s = (scalers / w.factor[..., group_of]).to(w.dtype) + w.mean[..., None]  # [E…, n_b], d
    values = w.code[idx].view(*lead, n_b, BLOCK)
    return (values * s[..., None]).view(*lead, o, i)


def nf4_error_bound(w: NF4Weight, original: torch.Tensor) -> torch.Tensor:
    """The largest |W − dequantize_nf4(w)| the format allows, for each element of `original` [E…, O, I].

    With a = absmax_b of the element's block, f = factor_g of its group and eps the dtype's machine epsilon:
    w = a·ℓ* with ℓ* = w / a in [−1, 1], and ŵ = ℓ·ŝ with ℓ the chosen level and ŝ the stored scale, so
      w − ŵ = a·(ℓ* − ℓ) + ℓ·(a − ŝ),   |ℓ| ≤ 1.
    |ℓ* − ℓ| ≤ MAX_LEVEL_GAP / 2, plus eps for the search running on w / a rounded to the dtype. ŝ misses a by
    the int8 rounding of c·f (half a step 1/f, a whole step where c·f = 128 is clamped to 127) and the roundings of
    c, c·f, q / f, + mean and the final product to the dtype, each ≤ eps / 2 of a value ≤ a + |mean| + 1/f. So
      |w − ŵ| ≤ (MAX_LEVEL_GAP / 2 + eps) · a + 1/f + 3 · eps · (a + |mean| + 1/f)."""
    *lead, o, i = original.shape
    blocks = original.detach().reshape(*lead, o * i // BLOCK, BLOCK)
    a = blocks.abs().amax(dim=-1).to(torch.float64)  # [E…, n_b]
    group_of = torch.arange(a.shape[-1], device=a.device) // GROUP
    step = 1.0 / w.factor.to(torch.float64)[..., group_of]
    eps = torch.finfo(w.dtype).eps
    mean = w.mean.to(torch.float64).abs()[..., None]
    bound = (MAX_LEVEL_GAP / 2 + eps) * a + step + 3 * eps * (a + mean + step)
    return bound[..., None].expand(*blocks.shape).reshape(original.shape)


def nf4_from_torchao(t) -> NF4Weight:
    """The NF4Weight over a torchao NF4Tensor [O, I] (its own tensors, viewed: no copy)."""
    o, i = t.shape
    if t.block_size != BLOCK or t.scaler_block_size != GROUP or not nf4_supported(i):
        raise ValueError(f"nf4_from_torchao: needs block_size {BLOCK}, scaler_block_size {GROUP} and in_features a "
                         f"multiple of {BLOCK}; got {t.block_size}, {t.scaler_block_size}, shape {tuple(t.shape)}")
    return NF4Weight(t.quantized_data.view(o, i // 2), t.quantized_scalers.view(o, i // BLOCK), t.quantization_factor,
                     t.scaler_mean, t.nf4)
