"""pipeline/expert_parallel.py pieces that need no process group (the 2-process runs are in
tests/designer/test_qwen3_moe.py and tests/designer/test_qlora_moe.py)."""
import torch

from atelier_studio.pipeline.expert_parallel import own_rows


def test_a_ranks_experts_do_not_keep_the_whole_stack_alive():
    """The rows a rank keeps are a copy of just those rows (a view would hold every expert's storage once the model
    loaded whole drops its full stacks); the values are the rows'; a meta stack gives a meta shard of their shape."""
    full = torch.randn(8, 6, 4)
    mine = own_rows(full, slice(4, 8))
    assert torch.equal(mine, full[4:8])
    assert mine.untyped_storage().nbytes() == mine.numel() * mine.element_size()
    assert mine.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    codes = torch.randint(0, 255, (8, 96), dtype=torch.uint8)  # an NF4 stack's bytes, rows are experts
    assert own_rows(codes, slice(0, 4)).untyped_storage().nbytes() == 4 * 96
    meta = own_rows(torch.empty(8, 6, 4, device="meta"), slice(0, 2))
    assert meta.is_meta and meta.shape == (2, 6, 4)
