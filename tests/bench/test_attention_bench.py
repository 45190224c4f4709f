"""bench/attention.py at tiny size on the CPU: the report's fields, errors against the fp32 reference, the choice."""

from __future__ import annotations

import json

from atelier_studio.bench.attention import doc_lengths, main


def test_doc_lengths_fill_rows_exactly():
    rows = doc_lengths(3, 2048, one_doc=False, seed=1)
    assert [sum(r) for r in rows] == [2048] * 3 and max(len(r) for r in rows) > 2
    assert doc_lengths(2, 64, one_doc=True) == [[64], [64]]


def test_tiny_run_judges_every_cpu_path(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path), "--repeats", "1"]) == 0
    (path,) = tmp_path.glob("attention-*.json")
    r = json.loads(path.read_text())
    packed, one = r["shapes"]["packed-8k"], r["shapes"]["one-doc-64k"]
    for name in ("varlen", "flash", "flex"):  # CUDA-only here: skipped with the reason
        assert "skipped" in packed["paths"][name]
    assert "skipped" in packed["paths"]["sdpa_causal"] and "skipped" in one["paths"]["sdpa_mask"]
    for res in (packed, one):
        ran = {p: x for p, x in res["paths"].items() if "ms" in x}
        assert ran and all(x["exact"] for x in ran.values())
        assert all(e < 1e-5 for x in ran.values() for e in x["max_abs_err"].values())
        assert res["fastest_exact"] in ran
    assert path.with_suffix(".md").read_text().count("fastest exact") == 2
