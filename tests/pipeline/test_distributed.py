"""pipeline/distributed.py on one process: torchrun's environment, AC/compile wrapping, meta materialisation,
and the `--nproc` re-launch. The multi-process behaviour (FSDP2, sharded checkpoints, parity with one
process) is tested through torchrun in tests/designer/test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from atelier_studio.designer.lora import LoraArgs, apply_lora
from atelier_studio.designer.qwen3 import Qwen3, Qwen3Args
from atelier_studio.pipeline.config import DistributedConfig, TrainConfig
from atelier_studio.pipeline.distributed import (
    DistContext,
    DistributedError,
    all_reduce_sum,
    full_state_dict,
    init_distributed,
    local_rows,
    materialize_,
    parallelize,
    torchrun_env,
)
from atelier_studio.pipeline.policies import checkpoint_blocks

ARGS = Qwen3Args(vocab_size=97, dim=48, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=12, ffn_dim=80,
                 attention_impl="sdpa")


def batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARGS.vocab_size, (2, 13), generator=g)  # [B,T]
    pos = torch.cat([torch.arange(5), torch.arange(8)]).repeat(2, 1)  # two documents per row
    cu = torch.tensor([0, 5, 13, 18, 26], dtype=torch.int32)
    return ids, pos, cu


def loss_of(model: Qwen3, seed: int) -> torch.Tensor:
    ids, pos, cu = batch(seed)
    h = model(ids, pos, cu, 8)  # [B,T,D]
    return torch.nn.functional.cross_entropy(model.logits(h).flatten(0, 1), ids.roll(-1, 1).flatten())


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_torchrun_means_one_process_without_a_group(clean_env):
    assert torchrun_env() is None
    ctx = init_distributed(TrainConfig(device="cpu"))
    assert ctx == DistContext(device=torch.device("cpu"))
    assert not torch.distributed.is_initialized()
    assert all_reduce_sum(ctx, [3, 0.5]) == [3.0, 0.5]


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "LOCAL_RANK is not"),
    ({"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, "RANK=2 WORLD_SIZE=2"),
])
def test_bad_torchrun_environment_is_named(clean_env, env, message):
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(DistributedError, match=message):
        torchrun_env()


def test_activation_checkpointing_keeps_loss_gradients_and_names():
    torch.manual_seed(0)
    ref = Qwen3(ARGS).init_weights(1)
    apply_lora(ref, LoraArgs(rank=4, alpha=8.0, targets=("q", "v", "down")))
    with torch.no_grad():  # B != 0 so the adapters get a gradient through A too
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ac = Qwen3(ARGS)
    apply_lora(ac, LoraArgs(rank=4, alpha=8.0, targets=("q", "v", "down")))
    ac.load_state_dict(ref.state_dict())
    names = [n for n, _ in ac.named_parameters()]
    parallelize(ac, list(ac.model.layers), DistContext(), DistributedConfig(activation_checkpointing="full"), None)
    assert [n for n, _ in ac.named_parameters()] == names  # checkpoints and exports keep the stock names
    loss_ref, loss_ac = loss_of(ref, 2), loss_of(ac, 2)
    loss_ref.backward()
    loss_ac.backward()
    # exact: checkpointing changes when the forward runs, not what it computes (the same kernels on the same inputs)
    torch.testing.assert_close(loss_ac, loss_ref, rtol=0, atol=0)
    # and the gradients too: only the adapters train, each used once in its layer, so each gradient is the output
    # of the same backward kernels on the same (recomputed) inputs
    for (n, p), (_, q) in zip(ref.named_parameters(), ac.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpoint_blocks_recomputes_in_backward(mode):
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    calls = []
    plain = block.forward
    block.forward = lambda x: calls.append(1) or plain(x)  # counts runs of the block's own forward
    checkpoint_blocks([block], mode)
    block(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # forward, then the recomputation in backward


def test_materialize_fills_a_meta_model_from_the_reader():
    ref = Qwen3(ARGS).init_weights(3)
    full = ref.state_dict()
    with torch.device("meta"):
        model = Qwen3(ARGS)
    asked = []

    def read(name: str, rows: slice) -> torch.Tensor:
        asked.append((name, rows))
        return full[name][rows]

    materialize_(model, torch.device("cpu"), read)
    assert {n for n, _ in asked} == set(full)
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k]), k  # exact: copied, not computed
    torch.testing.assert_close(loss_of(model, 4), loss_of(ref, 4), rtol=0, atol=0)  # the same weights, same kernels


def test_materialize_names_a_tensor_of_the_wrong_shape():
    with torch.device("meta"):
        model = Qwen3(ARGS)
    with pytest.raises(DistributedError, match=r"model.embed_tokens.weight rows 0:97 have shape \(97, 47\)"):
        materialize_(model, torch.device("cpu"), lambda name, rows: torch.randn(97, 47))


def test_a_trainable_only_state_dict_holds_the_adapters_and_nothing_frozen(clean_env):
    """What an adapter export gathers (trainable_only): exactly the LoRA weights, by their parameter names, none of
    the frozen base; without it, everything. (Under FSDP2 the same choice is torch's ignore_frozen_params; the
    2-process LoRA runs in tests/designer/test_distributed.py export through it and equal one process.)"""
    model = apply_lora(Qwen3(ARGS), LoraArgs(rank=2))
    ctx = init_distributed(TrainConfig(device="cpu"))
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert set(full_state_dict(model, ctx, trainable_only=True)) == adapters
    assert set(full_state_dict(model, ctx)) == set(model.state_dict())


def test_local_rows_of_a_plain_tensor_is_all_of_it():
    assert local_rows(torch.randn(7, 3)) == slice(0, 7)


def test_nproc_relaunches_through_torchrun(clean_env, monkeypatch):
    from atelier_studio.flows import cli

    seen = []
    monkeypatch.setattr(cli, "_run_torchrun", lambda launch: seen.append(launch) or 0)
    assert cli.main(["designer", "train", "--config", "c.toml", "--set", "train.lr=1e-3", "--nproc", "4"]) == 0
    assert seen[-1] == ["--nproc-per-node", "4", "--nnodes", "1", "--standalone",
                        "-m", "atelier_studio.flows.cli", "designer", "train", "--config", "c.toml", "--set",
                        "train.lr=1e-3"]
    assert cli.main(["imagegen", "train", "--config", "c.toml", "--nproc", "8", "--nnodes", "2", "--node-rank", "1",
                     "--master-addr", "10.0.0.1", "--master-port", "29511"]) == 0
    assert seen[-1][:10] == ["--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1",
                             "--master-addr", "10.0.0.1", "--master-port", "29511"]


def test_the_launcher_reports_the_workers_outcome(monkeypatch, capsys):
    """A user error on the ranks is exit 2 with nothing after their lines, also when the launcher stopped the others
    (SIGTERM: 143); a signal-stopped run keeps 128 + signal; a mixed failure says which codes."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from atelier_studio.flows import cli

    def failing(*codes):
        def run(_args):
            raise ChildFailedError("atelier_studio.flows.cli", {
                rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent")
                for rank, code in enumerate(codes)})
        return run

    launch = ["--nproc-per-node", "2", "--standalone", "-m", "atelier_studio.flows.cli"]
    for codes, want, says in [((2, 2), 2, False), ((2, 143), 2, False), ((143, 143), 143, False), ((1, 1), 1, False),
                              ((2, -9), 137, True), ((0, -11), 139, True)]:
        monkeypatch.setattr(torchrun, "run", failing(*codes))
        assert cli._run_torchrun(launch) == want, codes
        err = capsys.readouterr().err
        assert ("atelier: error: the workers exited with codes" in err) == says, (codes, err)
    monkeypatch.setattr(torchrun, "run", lambda _args: None)
    assert cli._run_torchrun(launch) == 0


def test_nproc_bad_values_are_named(clean_env, capsys):
    from atelier_studio.flows import cli

    assert cli.main(["designer", "train", "--config", "c.toml", "--nproc", "2", "--nnodes", "2",
                     "--node-rank", "2"]) == 2
    assert "--node-rank 2" in capsys.readouterr().err
