"""FP8 quantisation: v [R, C] (any float dtype, any strides) → E4M3 / E5M2 values with fp32 dequantisation scales.

One rule for every operand of kernels/fp8_linear.py's GEMMs. For a group of values v (the whole tensor, or one
row, or one column),
  amax = max |v|,
  s = max(amax, 1e-12) · fp32(1 / fp8_max)    (one fp32 multiply, correctly rounded: the dequantisation scale),
  q = fp8(clamp(v / s, −fp8_max, fp8_max))     (v / s correctly rounded in fp32, then rounded to the nearest fp8
                                               value, ties to even; the clamp saturates),
  v ≈ q · s.  E4M3 (float8_e4m3fn): fp8_max 448, 3 mantissa bits, smallest normal 2^-6, so |q·s − v| ≤ 2^-4 |v| in
  the normal range; E5M2 (float8_e5m2): 57344, 2 bits, 2^-14, error ≤ 2^-3 |v|.
Why a multiply by the rounded reciprocal and not amax / fp8_max: PyTorch's CUDA division by a Python number computes
a · fp32(1/b) (an optimisation its source states), while its CPU division divides; the two differ in the last bit for
about half of all amaxes, so "amax / 448" has no device-independent meaning. A multiply by an fp32 constant is one
correctly rounded operation on every device, in Triton and under the interpreter alike, so the Triton scales equal
`quantize_ref`'s bit for bit wherever either runs.
The kernels round to the fp8 grid in fp32 arithmetic before the cast (exactly the RNE rule), so the cast itself never
rounds: the same bits on the GPU and under TRITON_INTERPRET=1, whose own fp8 cast mis-rounds values that round up
into the next binade. Values equal torch's own cast of clamp(v / s) exactly.

Layouts (what the GEMMs read): q [R, C] with one scale per row (rowwise) or per tensor; qᵀ [C, R_pad], v's columns
quantised with one scale per column (rowwise) or the tensor's, written transposed and zero-filled in columns
R..R_pad (a GEMM that contracts over R needs R_pad a multiple of 16: kernels/fp8_linear.py's dW).

Kernels, and the passes they make over v:
  rowwise q alone: one kernel whose programs own whole rows: each row's amax, then its cast; the second walk over a
    row hits L2 (the rows a program just read), so v is read from memory once;
  anything needing a column's or the whole tensor's amax: two kernels, tile amaxes by atomic max (max is order-free,
    so the result is deterministic), then one cast pass that writes q and qᵀ from the same read. Tensorwise, q and qᵀ
    hold the same values, quantised once and stored twice.
Launch configurations (tile, warps): one fixed choice under the interpreter; on CUDA a small list, timed on the first
call for each (kernel, dtypes, column count, power-of-two row bucket) of at least 4M elements and the fastest kept
for the process (every configuration computes the same bits; `launch_configs()` lists the choices); smaller
tensors, and an untuned key inside a CUDA-graph capture, take the list's first entry. The kernels are memory-bound:
an H200 moves ~4.3 TB/s (read + write), so 64×128 to 128×128 tiles with 4 to 8 warps keep enough bytes in flight per
multiprocessor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_EPS = 1e-12  # amax floor: an all-zero group gets a finite scale (its values quantise to 0)
# fp8 dtype → (fp8_max, mantissa bits, exponent of the smallest normal)
FORMATS = {E4M3: (448.0, 3, -6), E5M2: (57344.0, 2, -14)}
# fp8 dtype → fp32(1 / fp8_max), as a Python float that is exactly that fp32 value
INV_MAX = {d: torch.tensor(1.0 / f[0], dtype=torch.float32).item() for d, f in FORMATS.items()}


@dataclass(frozen=True)
class LaunchConfig:
    """One quantisation kernel launch's shape: BLOCK_R rows × BLOCK_C columns per program, num_warps warps."""

    block_r: int
    block_c: int
    num_warps: int


# "tiles": the two-pass kernels (amax, cast); "rows": the one-pass rowwise kernel (BLOCK_R whole rows per program,
# walked BLOCK_C columns at a time).
INTERPRETER_CONFIGS = {"tiles": LaunchConfig(64, 64, 4), "rows": LaunchConfig(8, 512, 4)}
CUDA_CONFIGS = {"tiles": (LaunchConfig(64, 128, 4), LaunchConfig(128, 128, 8), LaunchConfig(128, 64, 4)),
                "rows": (LaunchConfig(8, 512, 4), LaunchConfig(4, 1024, 4), LaunchConfig(16, 512, 8))}
TUNE_REPS = 5  # timed launches per candidate configuration, after one warm-up (compile) launch
TUNE_MIN_ELEMENTS = 1 << 22  # smaller tensors take the list's first entry untimed: their launch, not the kernel, costs
_TUNED: dict[tuple, LaunchConfig] = {}


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _round_to_fp8_grid(v, MANT: tl.constexpr, EMIN: tl.constexpr):
    # v fp32 within ±fp8_max → the nearest fp8 value (ties to even), still fp32. The fp8 spacing at |v| is
    # ulp = 2^(max(e, EMIN) − MANT), e = v's binary exponent (subnormals share the smallest normal's spacing).
    # a + 2^23·ulp lies in a binade of fp32 whose spacing is exactly ulp, so the fp32 add rounds a to a multiple of
    # ulp, ties to even (2^23·ulp is an even multiple), and the subtraction is exact.
    a = tl.abs(v)
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent
    e = tl.maximum(e, EMIN + 127)
    big = ((e - MANT + 23) << 23).to(tl.float32, bitcast=True)  # 2^23 · ulp
    r = (a + big) - big
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_values(x, s, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    v = tl.math.div_rn(x, s)
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    return _round_to_fp8_grid(v, MANT, EMIN)


@triton.jit
def _scale_of(amax, EPS: tl.constexpr, INV_MAX: tl.constexpr):
    return tl.maximum(amax, EPS) * INV_MAX  # one correctly rounded fp32 multiply (the module docstring)


@triton.jit(do_not_specialize=["R"])
def _amax_kernel(x_ptr, amax_q_ptr, amax_qt_ptr, R, C, stride_r, stride_c, TENSORWISE: tl.constexpr,
                 WANT_Q: tl.constexpr, WANT_QT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Pass 1 over x [R, C]: one tile per program; its amax goes by atomic max into the tensor's amax (tensorwise),
    # or into each row's (for q) and each column's (for qᵀ). R is not specialised on: its masks never gate a
    # vectorised access, and every token count would otherwise compile its own kernel.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask, cmask = rows < R, cols < C
    offs = rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
    a = tl.abs(tl.load(x_ptr + offs, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32))
    if TENSORWISE:
        tl.atomic_max(amax_q_ptr, tl.max(tl.max(a, axis=1), axis=0))
    else:
        if WANT_Q:
            tl.atomic_max(amax_q_ptr + rows, tl.max(a, axis=1), mask=rmask)
        if WANT_QT:
            tl.atomic_max(amax_qt_ptr + cols, tl.max(a, axis=0), mask=cmask)


@triton.jit(do_not_specialize=["R"])
def _cast_kernel(x_ptr, amax_q_ptr, amax_qt_ptr, q_ptr, s_q_ptr, qt_ptr, s_qt_ptr, R, C, R_PAD, stride_r, stride_c,
                 FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EPS: tl.constexpr,
                 INV_MAX: tl.constexpr, TENSORWISE: tl.constexpr, WANT_Q: tl.constexpr, WANT_QT: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Pass 2: scales from the amaxes, then q [R, C] (row scales, or the tensor's) and/or qᵀ [C, R_PAD] (column
    # scales, or the tensor's), from one read of the tile; the transposed copy zero-filled in rows R..R_PAD (the
    # grid covers them, their loads are masked to 0, and 0 quantises to 0).
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask, cmask = rows < R, cols < C
    offs = rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
    x = tl.load(x_ptr + offs, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    q_offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    qt_offs = cols[None, :].to(tl.int64) * R_PAD + rows[:, None]
    if TENSORWISE:
        s = _scale_of(tl.load(amax_q_ptr), EPS, INV_MAX)
        if (pid_r == 0) & (pid_c == 0):
            tl.store(s_q_ptr, s)
        v = _quantize_values(x, tl.zeros((BLOCK_R, BLOCK_C), tl.float32) + s, FP8_MAX, MANT, EMIN)  # once for both
        if WANT_Q:
            tl.store(q_ptr + q_offs, v.to(q_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
        if WANT_QT:
            tl.store(qt_ptr + qt_offs, v.to(qt_ptr.dtype.element_ty), mask=(rows[:, None] < R_PAD) & cmask[None, :])
    else:
        if WANT_Q:
            s_rows = _scale_of(tl.load(amax_q_ptr + rows, mask=rmask, other=0.0), EPS, INV_MAX)
            tl.store(s_q_ptr + rows, s_rows, mask=rmask & (pid_c == 0))
            q = _quantize_values(x, tl.broadcast_to(s_rows[:, None], (BLOCK_R, BLOCK_C)), FP8_MAX, MANT, EMIN)
            tl.store(q_ptr + q_offs, q.to(q_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
        if WANT_QT:
            s_cols = _scale_of(tl.load(amax_qt_ptr + cols, mask=cmask, other=0.0), EPS, INV_MAX)
            tl.store(s_qt_ptr + cols, s_cols, mask=cmask & (pid_r == 0))
            qt = _quantize_values(x, tl.broadcast_to(s_cols[None, :], (BLOCK_R, BLOCK_C)), FP8_MAX, MANT, EMIN)
            tl.store(qt_ptr + qt_offs, qt.to(qt_ptr.dtype.element_ty), mask=(rows[:, None] < R_PAD) & cmask[None, :])


@triton.jit(do_not_specialize=["R"])
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, R, C, stride_r, stride_c, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                       EMIN: tl.constexpr, EPS: tl.constexpr, INV_MAX: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    # Rowwise q only (no transposed copy): a program owns BLOCK_R whole rows, so one kernel finds their amaxes and
    # casts them; the second walk over the rows mostly hits L2 (the rows just read).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    row_off = rows[:, None].to(tl.int64) * stride_r
    amax = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + row_off + cols[None, :].to(tl.int64) * stride_c, mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    s = _scale_of(amax, EPS, INV_MAX)
    tl.store(s_ptr + rows, s, mask=rmask)
    s_tile = tl.broadcast_to(s[:, None], (BLOCK_R, BLOCK_C))
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + row_off + cols[None, :].to(tl.int64) * stride_c, mask=m, other=0.0).to(tl.float32)
        q = _quantize_values(x, s_tile, FP8_MAX, MANT, EMIN)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)


# --- launchers ------------------------------------------------------------------------------------
class Fp8Quantized(NamedTuple):
    """What `quantize` made; None where not asked for. Tensorwise: scale is scale_t, one fp32 value [1]."""

    q: torch.Tensor | None  # [R, C] fp8: rows scaled by scale
    scale: torch.Tensor | None  # [R] fp32 (rowwise) or [1]
    qt: torch.Tensor | None  # [C, R_pad] fp8: the transposed copy, columns of v scaled by scale_t, zero rows ≥ R
    scale_t: torch.Tensor | None  # [C] fp32 (rowwise) or [1]


def _config(kind: str, key: tuple, device: torch.device, run: Callable[[LaunchConfig], None],
            given: LaunchConfig | None, numel: int) -> LaunchConfig:
    """The launch configuration for one kernel call: `given`, the interpreter's, or on CUDA the tuned one (timed
    here on first use of `key`, each candidate once to compile and TUNE_REPS times under CUDA events; tensors under
    TUNE_MIN_ELEMENTS take the first candidate, which compiles nothing more)."""
    if given is not None:
        return given
    if device.type != "cuda":
        return INTERPRETER_CONFIGS[kind]
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    candidates = CUDA_CONFIGS[kind]
    if numel < TUNE_MIN_ELEMENTS or torch.cuda.is_current_stream_capturing():
        return candidates[0]  # small, or inside a graph capture (no timing or synchronising there)
    best, best_ms, failure = None, float("inf"), None
    for c in candidates:
        try:
            run(c)  # compiles; every configuration writes the same values, so running it is harmless
        except (OutOfResources, triton.CompilationError) as e:  # this build cannot run it: try the others
            failure = e
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TUNE_REPS):
            run(c)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        if ms < best_ms:
            best, best_ms = c, ms
    if best is None:
        raise RuntimeError(f"fp8 quantize: no launch configuration of {candidates} runs here") from failure
    _TUNED[key] = best
    return best


_KEY_FIELDS = {"rows": ("kernel", "in", "out", "R_bucket", "C"),
               "tiles": ("kernel", "rowwise", "q", "qt", "C_contiguous", "in", "out", "R_bucket", "C")}


def launch_configs() -> dict[str, LaunchConfig]:
    """The configurations tuned so far in this process: 'kernel=… rowwise=… … C=…' → LaunchConfig."""
    out = {}
    for key, cfg in _TUNED.items():
        fields = _KEY_FIELDS["rows" if key[0] == "rows" else "tiles"]
        out[" ".join(f"{f}={str(v).removeprefix('torch.')}" for f, v in zip(fields, key))] = cfg
    return out


def _row_bucket(r: int) -> int:
    return 1 << max(4, (r - 1).bit_length())  # the next power of two (at least 16)


def quantize(v: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, rows: bool = True, cols: bool = False,
             pad_to: int = 1, config: LaunchConfig | None = None) -> Fp8Quantized:
    """Quantise v [R, C] (any float dtype, any strides) to fp8 (the module docstring's rule and layouts).

    rows: q [R, C] with one scale per row (rowwise) or per tensor. cols: qᵀ [C, R_pad] (R_pad = R rounded up to
    `pad_to`, zero-filled) with one scale per column of v (rowwise) or the tensor's. Both from the same passes.
    config: the launch configuration of every kernel this call runs (benchmarks); None chooses it.
    """
    if v.dim() != 2 or not v.is_floating_point():
        raise ValueError(f"fp8 quantize: expected a 2-D float tensor, got {v.dtype} {tuple(v.shape)}")
    if fp8_dtype not in FORMATS:
        raise ValueError(f"fp8 quantize: fp8_dtype must be one of {list(FORMATS)}, got {fp8_dtype}")
    if not (rows or cols):
        raise ValueError("fp8 quantize: ask for rows, cols or both")
    r, c = v.shape
    r_pad = -(-r // pad_to) * pad_to
    fmax, mant, emin = FORMATS[fp8_dtype]
    inv = INV_MAX[fp8_dtype]
    dev = v.device
    q = torch.empty(r, c, dtype=fp8_dtype, device=dev) if rows else None
    qt = torch.empty(c, r_pad, dtype=fp8_dtype, device=dev) if cols else None
    if rowwise:
        s_q = torch.empty(r, dtype=torch.float32, device=dev) if rows else None
        s_qt = torch.empty(c, dtype=torch.float32, device=dev) if cols else None
    else:
        s_q = s_qt = torch.empty(1, dtype=torch.float32, device=dev)
    if r == 0 or c == 0:
        eps_scale = scale_ref(torch.zeros(1), fp8_dtype).item()  # an empty group's scale, as an all-zero one's
        for s in (s_q, s_qt):
            if s is not None:
                s.fill_(eps_scale)
        if qt is not None:
            qt.zero_()
        return Fp8Quantized(q, s_q if rows else None, qt, s_qt if cols else None)
    sr, sc = v.stride()
    if rowwise and rows and not cols and sc == 1:  # row-major rows only: the one-pass kernel, no amax buffer
        def run_rows(cfg: LaunchConfig) -> None:
            _quant_rows_kernel[(-(-r // cfg.block_r),)](
                v, q, s_q, r, c, sr, sc, FP8_MAX=fmax, MANT=mant, EMIN=emin, EPS=AMAX_EPS, INV_MAX=inv,
                BLOCK_R=cfg.block_r, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps)

        run_rows(_config("rows", ("rows", v.dtype, fp8_dtype, _row_bucket(r), c), dev, run_rows, config, r * c))
        return Fp8Quantized(q, s_q, None, None)
    # one zero-filled buffer holds every amax this call needs (one memset)
    n_q = 1 if not rowwise else (r if rows else 0)
    n_qt = 0 if not rowwise else (c if cols else 0)
    amax = torch.zeros(n_q + n_qt, dtype=torch.float32, device=dev)
    amax_q = amax[:n_q] if n_q and n_qt else amax  # (views only where both share the buffer)
    amax_qt = amax[n_q:] if n_q and n_qt else amax
    tw, grid_rows = not rowwise, (r_pad if cols else r)

    def run_amax(cfg: LaunchConfig) -> None:
        _amax_kernel[(-(-r // cfg.block_r), -(-c // cfg.block_c))](
            v, amax_q, amax_qt, r, c, sr, sc, TENSORWISE=tw, WANT_Q=rows, WANT_QT=cols, BLOCK_R=cfg.block_r,
            BLOCK_C=cfg.block_c, num_warps=cfg.num_warps)

    def run_cast(cfg: LaunchConfig) -> None:
        dummy = amax  # an unused pointer argument
        _cast_kernel[(-(-grid_rows // cfg.block_r), -(-c // cfg.block_c))](
            v, amax_q, amax_qt, q if q is not None else dummy, s_q if s_q is not None else dummy,
            qt if qt is not None else dummy, s_qt if s_qt is not None else dummy, r, c, r_pad, sr, sc,
            FP8_MAX=fmax, MANT=mant, EMIN=emin, EPS=AMAX_EPS, INV_MAX=inv, TENSORWISE=tw, WANT_Q=rows, WANT_QT=cols,
            BLOCK_R=cfg.block_r, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps)

    key = (rowwise, rows, cols, sc == 1, v.dtype, fp8_dtype, _row_bucket(r), c)  # cheap to build and hash
    run_amax(_config("tiles", ("amax", *key), dev, run_amax, config, r * c))
    run_cast(_config("tiles", ("cast", *key), dev, run_cast, config, r * c))
    return Fp8Quantized(q, s_q if rows else None, qt, s_qt if cols else None)


# --- reference ------------------------------------------------------------------------------------
def scale_ref(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The dequantisation scale of fp32 amaxes: max(amax, 1e-12) · fp32(1 / fp8_max), one fp32 multiply by a
    tensor (never a division by a Python number, which CUDA and CPU PyTorch round differently)."""
    inv = torch.tensor(INV_MAX[fp8_dtype], dtype=torch.float32, device=amax.device)
    return amax.float().clamp(min=AMAX_EPS) * inv


def quantize_ref(v: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: v [R, C] → (q [R, C] fp8, scale [R] (rowwise, one per row) or [1] fp32), torch's own cast."""
    fmax = FORMATS[fp8_dtype][0]
    vf = v.detach().float()
    amax = vf.abs().amax(dim=1) if rowwise else vf.abs().amax().reshape(1)
    s = scale_ref(amax, fp8_dtype)
    q = (vf / (s[:, None] if rowwise else s)).clamp(-fmax, fmax).to(fp8_dtype)  # tensor / tensor: a true division
    return q, s


def fake_quantize(v: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, dim: int = 1) -> torch.Tensor:
    """q · s in fp32: v [R, C] quantised and dequantised with one scale per row (dim=1: the groups run along
    the rows), per column (dim=0), or per tensor (rowwise False)."""
    if dim == 0:
        return fake_quantize(v.t(), fp8_dtype, rowwise, 1).t()
    q, s = quantize_ref(v, fp8_dtype, rowwise)
    return q.float() * (s[:, None] if rowwise else s)
