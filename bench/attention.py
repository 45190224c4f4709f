"""Packed causal attention paths on one GPU: speed (forward + backward) and exactness.

    python3 -m atelier_studio.bench.attention --out DIR [--shapes packed-8k,one-doc-64k] [--repeats 10] [--tiny]

Shapes: N packed tokens, H query heads, Hkv kv heads, Dh head dim, S documents.
  packed-8k:    Qwen3-8B attention (H 32, Hkv 8, Dh 128), 4 rows × 2048 tokens of lognormal documents
                (median 300 tokens), the designer's training batch;
  one-doc-64k:  the same heads, one 65,536-token document.

Paths (each skipped, with the reason, where this machine lacks it):
  varlen       torch.nn.attention.varlen.varlen_attn over cu_seqlens (kernels.attention "varlen");
  flash        flash_attn.flash_attn_varlen_func (kernels.attention "flash");
  sdpa_causal  SDPA with is_causal over rows of ONE document each (cuDNN on the H200; one-doc shapes only);
  sdpa_mask    SDPA over dense rows with a [B, 1, T, T] block-diagonal causal mask (what transformers does;
               packed shapes only);
  flex         FlexAttention (compiled) with a document-causal BlockMask, GQA native;
  sdpa_per_doc the reference loop (kernels.attention "sdpa"), in bf16 here for its speed.
Exactness: output and dq/dk/dv against packed_causal_attention_ref in fp32 (the ground truth), as the
max abs error; a path is "exact" when its error is at most 2× that of eager attention in the same dtype
(transformers' eager attention per document: matmuls in that dtype, fp32 softmax) + 1e-5 (FlashAttention's rule;
docs/kernels.md). Timing: CUDA events, median of `repeats` after 3 warm-up calls (compile included in warm-up).
FLOPs: causal 2·Σ len²·H·Dh forward (QKᵀ and PV, the causal half), ×3.5 for forward + backward (backward recomputes
P: 2.5× the forward), as FlashAttention counts it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from atelier_studio.bench.env import clocks, environment
from atelier_studio.kernels.attention import packed_causal_attention, packed_causal_attention_ref
from atelier_studio.pipeline.atomic import atomic_write_text

SHAPES = {
    "packed-8k": dict(rows=4, row_len=2048, heads=32, kv_heads=8, head_dim=128, one_doc=False),
    "one-doc-64k": dict(rows=1, row_len=65536, heads=32, kv_heads=8, head_dim=128, one_doc=True),
}
TINY = {"packed-8k": dict(rows=2, row_len=96, heads=4, kv_heads=2, head_dim=16, one_doc=False),
        "one-doc-64k": dict(rows=1, row_len=128, heads=4, kv_heads=2, head_dim=16, one_doc=True)}
PATHS = ("varlen", "flash", "sdpa_causal", "sdpa_mask", "flex", "sdpa_per_doc")
EAGER_MAX_SCORES = 2**31  # the eager baseline materialises H·len² scores per document: skip it above this


def doc_lengths(rows: int, row_len: int, one_doc: bool, seed: int = 0) -> list[list[int]]:
    """Per row, document lengths summing to row_len (lognormal, median min(300, row_len/4))."""
    if one_doc:
        return [[row_len] for _ in range(rows)]
    rng = random.Random(seed)
    median = min(300, row_len // 4)
    out = []
    for _ in range(rows):
        lens, left = [], row_len
        while left > 0:
            n = min(left, max(8, int(rng.lognormvariate(math.log(median), 0.6))))
            lens.append(n)
            left -= n
        out.append(lens)
    return out


def make_inputs(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = doc_lengths(shape["rows"], shape["row_len"], shape["one_doc"], seed)
    n = shape["rows"] * shape["row_len"]
    h, hkv, dh = shape["heads"], shape["kv_heads"], shape["head_dim"]
    q, k, v, do = (torch.randn(n, hh, dh, generator=g).to(device, dtype) for hh in (h, hkv, hkv, h))
    lens = [x for r in rows for x in r]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    return q, k, v, do, cu, rows


# ------------------------------------------------------------------------------------------------ paths

def _dense_doc_ids(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """[B, T] document index of every token of every row."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).to(device)


def path_fn(name: str, rows: list[list[int]], shape: dict, cu: torch.Tensor) -> Callable:
    """fn(q, k, v) → o [N, H, Dh] for one path; raises RuntimeError/ImportError where unavailable."""
    b, t = shape["rows"], shape["row_len"]
    h, hkv, dh = shape["heads"], shape["kv_heads"], shape["head_dim"]
    max_len = max(max(r) for r in rows)
    if name in ("varlen", "flash"):
        return lambda q, k, v: packed_causal_attention(q, k, v, cu, max_len, name)
    if name == "sdpa_per_doc":
        return lambda q, k, v: packed_causal_attention(q, k, v, cu, max_len, "sdpa")
    if name == "sdpa_causal":
        if not shape["one_doc"]:
            raise RuntimeError("sdpa_causal is exact only for rows of one document")

        def sdpa_causal(q, k, v):
            qd, kd, vd = (x.view(b, t, -1, dh).transpose(1, 2) for x in (q, k, v))  # [B, H, T, Dh]
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=h != hkv)
            return o.transpose(1, 2).reshape(b * t, h, dh)

        return sdpa_causal
    docs = _dense_doc_ids(rows, cu.device)  # [B, T]
    if name == "sdpa_mask":
        if shape["one_doc"]:
            raise RuntimeError("sdpa_mask: a dense T×T mask for one-document rows is sdpa_causal's job")
        pos = torch.arange(t, device=cu.device)
        mask = (docs[:, :, None] == docs[:, None, :]) & (pos[:, None] >= pos[None, :])  # [B, T, T]
        mask = mask[:, None]

        def sdpa_mask(q, k, v):
            qd, kd, vd = (x.view(b, t, -1, dh).transpose(1, 2) for x in (q, k, v))  # [B, H, T, Dh]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=h != hkv)
            return o.transpose(1, 2).reshape(b * t, h, dh)

        return sdpa_mask
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flat = docs.reshape(-1)  # packed rows are one long sequence of documents: [1, N]

        def doc_causal(b_, h_, qi, ki):
            return (flat[qi] == flat[ki]) & (qi >= ki)

        n = b * t
        block_mask = create_block_mask(doc_causal, None, None, n, n, device=cu.device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def flex(q, k, v):
            qd, kd, vd = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))  # [1, H, N, Dh]
            o = compiled(qd, kd, vd, block_mask=block_mask, enable_gqa=h != hkv)
            return o[0].transpose(0, 1).contiguous()

        return flex
    raise ValueError(f"unknown path {name!r}; known: {PATHS}")


# ------------------------------------------------------------------------------------------------ measure

def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The exactness baseline: transformers' eager attention per document in q's dtype (QKᵀ and PV matmuls in
    that dtype, softmax in fp32 rounded back), the "eager PyTorch in the same dtype" of FlashAttention's rule."""
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lens:
        qd, kd, vd = (x[start:start + n].transpose(0, 1) for x in (q, k, v))  # [H, n, Dh]
        kd, vd = kd.repeat_interleave(rep, 0), vd.repeat_interleave(rep, 0)
        s = (qd @ kd.transpose(1, 2)) * q.shape[-1] ** -0.5  # [H, n, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax(s.float().masked_fill(~causal, float("-inf")), dim=-1).to(q.dtype)
        outs.append((p @ vd).transpose(0, 1))
        start += n
    return torch.cat(outs)


def grads(fn: Callable, q, k, v, do) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves)
    o.backward(do)
    return [o.detach()] + [x.grad for x in leaves]


def timed(fn: Callable, q, k, v, do, repeats: int) -> list[float]:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    cuda = q.is_cuda
    out = []
    for i in range(3 + repeats):
        for x in leaves:
            x.grad = None
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        fn(*leaves).backward(do)
        if cuda:
            e.record()
            torch.cuda.synchronize()
            dt = s.elapsed_time(e) / 1e3
        else:
            dt = time.perf_counter() - t0
        if i >= 3:
            out.append(dt)
    return out


def attention_flops(rows: list[list[int]], heads: int, head_dim: int) -> float:
    return 3.5 * 2 * sum(n * n for r in rows for n in r) * heads * head_dim


def bench_shape(name: str, shape: dict, device: torch.device, dtype: torch.dtype, paths: list[str],
                repeats: int) -> dict[str, Any]:
    q, k, v, do, cu, rows = make_inputs(shape, dtype, device)
    max_len = max(max(r) for r in rows)
    truth = grads(lambda a, b_, c: packed_causal_attention_ref(a.float(), b_.float(), c.float(), cu, max_len),
                  q, k, v, do.float())
    lens = [x for r in rows for x in r]
    base = None
    if shape["heads"] * max(lens) ** 2 <= EAGER_MAX_SCORES:
        eager = grads(lambda a, b_, c: eager_attention(a, b_, c, lens), q, k, v, do)
        base = {w: (g.float() - t).abs().max().item() for w, g, t in zip(("o", "dq", "dk", "dv"), eager, truth)}
        del eager
    flops = attention_flops(rows, shape["heads"], shape["head_dim"])
    result: dict[str, Any] = {"shape": shape, "documents": sum(len(r) for r in rows), "flops": flops,
                              "eager_max_abs_err": base}
    result.update(judge_paths(name, paths, lambda p: path_fn(p, rows, shape, cu), (q, k, v, do), (q, k, v, do),
                              truth, base, flops, repeats))
    return result


def judge_paths(name: str, paths: list[str], make: Callable[[str], Callable], judged: tuple, timed_on: tuple,
                truth: list[torch.Tensor], base: dict[str, float] | None, flops: float,
                repeats: int) -> dict[str, Any]:
    """Every path: its errors on `judged` (q, k, v, do) against `truth`, its time on `timed_on`; "exact" when each
    error is at most 2× eager's (`base`) + 1e-5, None without a baseline. A path that cannot run here (missing
    kernel, out of memory, any other failure) is recorded as skipped with the reason. → {"paths", "fastest_exact"}."""
    out: dict[str, Any] = {}
    cuda = truth[0].is_cuda
    for p in paths:
        try:
            fn = make(p)
            got = grads(fn, *judged)
            errs = {w: (x.float() - t).abs().max().item() for w, x, t in zip(("o", "dq", "dk", "dv"), got, truth)}
            ts = timed(fn, *timed_on, repeats)
        except Exception as e:  # a path that cannot run here (missing package, kernel, memory) is a result
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            known = isinstance(e, (RuntimeError, ImportError, torch.OutOfMemoryError)) and first
            out[p] = {"skipped": first if known else f"{type(e).__name__}: {first}"}
            if cuda:
                torch.cuda.empty_cache()
            continue
        med = statistics.median(ts)
        exact = None if base is None else all(errs[w] <= 2 * base[w] + 1e-5 for w in base)
        out[p] = {"ms": med * 1e3, "ms_min": min(ts) * 1e3, "tflops": flops / med / 1e12, "max_abs_err": errs,
                  "exact": exact}
        print(f"{name} {p}: {med * 1e3:.2f} ms, {flops / med / 1e12:.0f} TFLOP/s, err {errs}", flush=True)
        del fn, got
        if cuda:
            torch.cuda.empty_cache()
    ok = {p: r for p, r in out.items() if r.get("exact")}
    return {"paths": out, "fastest_exact": min(ok, key=lambda p: ok[p]["ms"]) if ok else None}


def markdown(report: dict[str, Any], title: str = "packed causal attention") -> str:
    lines = [f"## {title}, forward + backward — {report['gpu'].get('name') or 'cpu'}, {report['dtype']}",
             "", "| shape | path | ms | TFLOP/s | max abs err (o, dq, dk, dv) | exact |", "|---|---|---|---|---|---|"]
    for name, r in report["shapes"].items():
        for p, x in r["paths"].items():
            if "skipped" in x:
                lines.append(f"| {name} | {p} | skipped: {x['skipped'][:80]} | | | |")
                continue
            e = x["max_abs_err"]
            lines.append(f"| {name} | {p} | {x['ms']:.2f} | {x['tflops']:.0f} | "
                         f"{e['o']:.1e}, {e['dq']:.1e}, {e['dk']:.1e}, {e['dv']:.1e} | {x.get('exact')} |")
        lines.append(f"| {name} | **fastest exact** | {r['fastest_exact']} | | | |")
    return "\n".join(lines) + "\n"


def cli(argv: list[str] | None, prog: str, doc: str, shapes: dict, tiny_shapes: dict, paths: tuple[str, ...],
        stem: str, title: str, bench_one: Callable[..., dict[str, Any]]) -> int:
    """The attention benches' command line: pick shapes and paths, run `bench_one(name, shape, device, dtype,
    paths, repeats, tiny)` for each shape, write DIR/<stem>-<date>.{json,md}."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--shapes", default=",".join(shapes))
    p.add_argument("--paths", default=",".join(paths))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU in fp32 (tests)")
    a = p.parse_args(argv)
    chosen = [x for x in a.shapes.split(",") if x]
    chosen_paths = [x for x in a.paths.split(",") if x]
    bad = [x for x in chosen if x not in shapes] + [x for x in chosen_paths if x not in paths]
    if bad:
        p.error(f"unknown shapes/paths {bad}; shapes {list(shapes)}, paths {list(paths)}")
    device = torch.device("cpu") if a.tiny or not torch.cuda.is_available() else torch.device("cuda")
    if device.type != "cuda" and not a.tiny:
        p.error("real shapes need a CUDA GPU; use --tiny on a CPU")
    dtype = torch.float32 if a.tiny else torch.bfloat16
    table = tiny_shapes if a.tiny else shapes
    report: dict[str, Any] = {**environment(), "dtype": str(dtype).removeprefix("torch."),
                              "clocks": {"before": clocks()}, "shapes": {}}
    for name in chosen:
        report["shapes"][name] = bench_one(name, table[name], device, dtype, chosen_paths, a.repeats, a.tiny)
    report["clocks"]["after"] = clocks()
    out = Path(a.out)
    stem = f"{stem}-{time.strftime('%Y-%m-%d')}"
    atomic_write_text(out / f"{stem}.json", json.dumps(report, indent=1), what="benchmark report")
    atomic_write_text(out / f"{stem}.md", markdown(report, title), what="benchmark report")
    print(markdown(report, title))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(argv, "python3 -m atelier_studio.bench.attention", __doc__, SHAPES, TINY, PATHS, "attention",
               "packed causal attention",
               lambda name, shape, device, dtype, paths, repeats, tiny: bench_shape(name, shape, device, dtype,
                                                                                    paths, repeats))


if __name__ == "__main__":
    sys.exit(main())
