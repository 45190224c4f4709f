"""bench/joint_attention.py on the CPU: every path that runs here is judged exact, the GPU-only ones skip."""
import json

import pytest

from atelier_studio.bench.joint_attention import attention_flops, main


def test_flops_count_the_full_square():
    assert attention_flops(dict(batch=2, tokens=10, heads=3, head_dim=4)) == 3.5 * 4 * 2 * 100 * 3 * 4


def test_tiny_run_judges_the_cpu_paths(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path), "--repeats", "1"]) == 0
    report = json.loads(next(tmp_path.glob("joint-attention-*.json")).read_text())
    for name, r in report["shapes"].items():
        paths = r["paths"]
        assert paths["sdpa_math"]["exact"] and paths["sdpa_flash"]["exact"], name  # both have CPU kernels
        assert "skipped" in paths["sdpa_cudnn"] and "skipped" in paths["flex"]  # CUDA only (flex: its backward)
        assert "skipped" in paths["fa4"]  # FlashAttention-4: CUDA only, and not installed here
        assert r["fastest_exact"] in paths and paths[r["fastest_exact"]]["exact"]
    assert "fastest exact" in next(tmp_path.glob("joint-attention-*.md")).read_text()


def test_unknown_path_is_named():
    with pytest.raises(SystemExit):
        main(["--tiny", "--paths", "sdpa_tpu"])
