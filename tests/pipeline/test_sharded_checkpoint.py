"""pipeline/checkpoint_files.py's sharded format on one process: safetensors and JSON only, nothing (un)pickled.

The multi-process writes and resumes (FSDP2 shards over 2 gloo ranks, resumed on 1 and 2) are in
tests/designer/test_distributed.py and tests/imagegen/test_distributed.py; here DCP runs without a process group,
which exercises the same writer, reader and JSON values.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from atelier_studio.pipeline.checkpoint_files import (
    PICKLED_DCP_METADATA,
    CheckpointError,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    split_tensors,
)
from atelier_studio.pipeline.distributed import DistContext

# DCP without a process group says it assumes one process: that is what these tests do
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PICKLE_MARK = 0x80  # the first byte of every pickle of protocol 2 or later (torch.save writes protocol 2)


def _app_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A small model and an AdamW that has stepped once, as the Checkpointer's nested state dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1), betas=(0.8, 0.95))
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return model, opt, {"model": msd, "optimizer": osd, "task": {"cursor": torch.tensor([seed, 7])}}


@pytest.fixture
def no_unpickling(monkeypatch):
    """Every way a file is unpickled in this process raises, and is recorded."""
    calls = []

    def refuse(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called while loading a checkpoint")
        return call

    class RefusingUnpickler(pickle.Unpickler):  # a class still, for modules that subclass it on import
        def __init__(self, *args, **kwargs):
            refuse("pickle.Unpickler")()

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, refuse(f"pickle.{name}"))
    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)
    monkeypatch.setattr(torch, "load", refuse("torch.load"))
    return calls


def test_a_sharded_checkpoint_round_trips_without_pickle(tmp_path, no_unpickling):
    _, _, saved = _app_state(0)
    save_sharded_checkpoint(tmp_path, 5, saved, {"task": {"epoch": 1}}, {"python": [1]}, DistContext())
    ckpt = tmp_path / "step-5"
    assert is_sharded_checkpoint(ckpt)
    for f in ckpt.iterdir():
        assert f.read_bytes()[:1] != bytes([PICKLE_MARK]), f"{f.name} starts like a pickle"
    assert not (ckpt / PICKLED_DCP_METADATA).exists()

    _, _, live = _app_state(1)  # other weights, other optimizer state and hyper-parameters
    step, state, rank_state = load_sharded_checkpoint(ckpt, live, rank=0)
    assert (step, state["task"], rank_state) == (5, {"epoch": 1}, {"python": [1]})
    assert no_unpickling == []
    saved_t, saved_o = split_tensors(saved)
    live_t, live_o = split_tensors(live)
    assert sorted(saved_t["model"]) == sorted(live_t["model"])
    for part in ("model", "task"):
        for k, v in saved_t[part].items():
            assert torch.equal(live_t[part][k], v), k
    for name, st in saved_t["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(live_t["optimizer"]["state"][name][k], v), (name, k)
    assert live_o == saved_o and live["optimizer"]["param_groups"][0]["lr"] == 1e-3
    assert live["optimizer"]["param_groups"][0]["betas"] == [0.8, 0.95]  # JSON: a list, as one process resumes


def test_a_missing_tensor_is_named(tmp_path):
    _, _, saved = _app_state(0)
    del saved["model"]["1.bias"]
    save_sharded_checkpoint(tmp_path, 1, saved, {}, {}, DistContext())
    _, _, live = _app_state(0)
    with pytest.raises(CheckpointError, match=r"Missing key in checkpoint state_dict: model\.1\.bias") as e:
        load_sharded_checkpoint(tmp_path / "step-1", live, rank=0)
    assert "\n" not in str(e.value)  # DCP's per-rank tracebacks are left out: the CLI prints one line


def test_a_pickled_dcp_checkpoint_is_refused_unread(tmp_path, monkeypatch):
    """A checkpoint in DCP's default format (what earlier versions wrote) is refused before its pickle is opened."""
    import torch.distributed.checkpoint as dcp

    _, _, saved = _app_state(0)
    old = tmp_path / "step-2"
    dcp.save(split_tensors(saved)[0], checkpoint_id=str(old))  # DCP's FileSystemWriter: a pickled .metadata
    assert (old / PICKLED_DCP_METADATA).read_bytes()[:1] == bytes([PICKLE_MARK])
    assert is_sharded_checkpoint(old)
    opened = []
    monkeypatch.setattr(pickle, "load", lambda *a, **k: opened.append(a))
    _, _, live = _app_state(1)
    with pytest.raises(CheckpointError) as e:
        load_sharded_checkpoint(old, live, rank=0)
    message = str(e.value)
    assert str(old) in message and "pickled .metadata" in message and "no longer reads" in message
    assert "Finish that run with the Atelier version that wrote it" in message
    assert opened == []


def test_values_that_json_cannot_hold_are_refused_at_save():
    with pytest.raises(TypeError, match="set"):
        split_tensors({"optimizer": {"param_groups": [{"lr": {1, 2}}]}})
    with pytest.raises(TypeError, match="inside a list"):
        split_tensors({"task": [torch.zeros(2)]})


def test_the_streamed_file_is_the_file_dcps_own_writer_makes(tmp_path):
    """pipeline/dcp_safetensors.py writes what HuggingFaceStorageWriter writes: the same tensors, the same metadata."""
    import json

    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file

    from atelier_studio.pipeline.dcp_safetensors import StreamingSafetensorsWriter

    torch.manual_seed(0)
    state = {"w": torch.randn(5, 3), "h": torch.randn(4).bfloat16(), "step": torch.tensor(3.0),
             "mask": torch.tensor([True, False]), "empty": torch.zeros(0, 7), "ids": torch.arange(6).view(2, 3)[:, 1:]}
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path / "dcp"), save_distributed=True))
    dcp.save(state, storage_writer=StreamingSafetensorsWriter(str(tmp_path / "ours")))
    [theirs] = (tmp_path / "dcp").glob("*.safetensors")
    [ours] = (tmp_path / "ours").glob("*.safetensors")
    assert ours.name == theirs.name
    a, b = load_file(str(theirs)), load_file(str(ours))
    assert sorted(a) == sorted(b) == sorted(state)
    for k, t in state.items():
        assert a[k].dtype == b[k].dtype == t.dtype and torch.equal(b[k], t.contiguous()), k
    with safe_open(str(theirs), "pt") as f1, safe_open(str(ours), "pt") as f2:
        m1, m2 = f1.metadata(), f2.metadata()
    assert m1.keys() == m2.keys()
    assert json.loads(m1.pop("DCP_SHARDING_INFO")) == json.loads(m2.pop("DCP_SHARDING_INFO")) and m1 == m2
