"""The checkpoint files: their formats, written atomically, verified and read back (pipeline/checkpointer.py decides
what goes into them and which one a run resumes from).

A checkpoint is a directory `checkpoints/step-N/`:

    model.safetensors      the trainable tensors (all weights for full fine-tuning, the adapter for LoRA)
    optimizer.safetensors  optimizer state tensors, keyed `<param name>.<state key>`
    extra.safetensors      other tensors: RNG states, task state (e.g. EMA weights)
    state.json             step, scheduler, optimizer hyper-parameters, Python/NumPy RNG, task metadata
    manifest.json          size and SHA-256 of every file above; written last

It is written by `pipeline.atomic.atomic_dir`: into `.step-N.tmp-<token>/`, each file fsynced, then
renamed into place, so a killed writer leaves either a complete checkpoint or a temporary directory
that is ignored and deleted by the next save (never a half-written `step-N`). Saving a step that
already exists moves the old `step-N` aside, renames the new one in, and only then deletes the old
one; a kill between the two renames leaves the old one under `.step-N.old-<token>`, which
`list_checkpoints` puts back. A write that fails (a full disk) deletes its temporary directory and is
a `WriteError` naming the checkpoint and the file. Loading checks the manifest first, so a truncated
or altered file is reported by name before anything is read. Only safetensors and JSON are read:
nothing is unpickled.

Under torchrun (pipeline/distributed.py) a checkpoint is sharded instead, written by every rank through
`torch.distributed.checkpoint` (DCP) in its safetensors layout (DCP's `HuggingFaceStorageWriter`, streamed:
pipeline/dcp_safetensors.py), and resumable on any number of processes (DCP re-shards on load; one process
without a process group loads it too):

    shard-<r+1>-model-00001-of-00001.safetensors
                      rank r's tensors: its rows of the trainable weights and optimizer state, task tensors
                      (each replicated tensor in one file only), by parameter name; the header's JSON says
                      where each piece sits in the whole tensor (DCP's `saved_offsets`)
    state.json        step, task metadata, world size, and the state's non-tensor values (the optimizer's
                      param groups) as JSON; written by rank 0
    rank-<r>.json     rank r's RNG states (Python, NumPy, torch CPU/CUDA)
    manifest.json     size and SHA-256 of every file above; written last, by rank 0

Nothing is pickled, so nothing is unpickled on resume: `HuggingFaceStorageReader` builds DCP's metadata from
the safetensors headers (JSON). DCP's default format would pickle its `.metadata` file (and any non-tensor
value), and unpickling a file can run code; a checkpoint in that older format is refused, with the fix.

The same atomicity: every rank writes into `.step-N.tmp-sharded/` (one name all ranks know), rank 0
writes the manifest once all ranks are done and installs it the same way. With `async_save` the files
are written by a background thread while training goes on; the rename happens when the write has
finished (`PendingSave.wait`, called at the next save and at the end of the run), so a crash mid-write
leaves only a temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from atelier_studio.pipeline.atomic import (
    atomic_dir,
    ensure_dir,
    install_dir,
    is_temporary,
    remove_stale,
    restore_aside,
    save_safetensors,
    temp_path,
)
from atelier_studio.pipeline.dcp_safetensors import StreamingSafetensorsWriter
from atelier_studio.pipeline.errors import AtelierError

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(AtelierError, RuntimeError):
    """A checkpoint that cannot be used; the message names the directory and file."""


@dataclass
class Checkpoint:
    """What a checkpoint holds, in memory."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor]
    state: dict[str, Any]


def save_checkpoint(root: Path, ckpt: Checkpoint) -> Path:
    """Write `root/step-N` atomically (see the module docstring) and return its path."""
    root = ensure_dir(root, "checkpoint directory")
    final = root / f"step-{ckpt.step}"
    files = {
        "model.safetensors": ckpt.model,
        "optimizer.safetensors": ckpt.optimizer,
        "extra.safetensors": ckpt.extra,
    }
    # an existing step-N stays loadable until this one is in; what a killed save of step N left is deleted first
    with atomic_dir(final, what="checkpoint") as tmp:
        for name, tensors in files.items():
            save_safetensors({k: _contiguous_cpu(v) for k, v in tensors.items()}, tmp / name)
        _write_json(tmp / "state.json", {"step": ckpt.step, **ckpt.state})
        manifest = {name: _describe(tmp / name) for name in [*files, "state.json"]}
        _write_json(tmp / MANIFEST, manifest)
    return final


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and verify a checkpoint directory; errors name the file that is wrong."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        state = json.loads((path / "state.json").read_text())
        return Checkpoint(
            step=int(state.pop("step")),
            model=load_file(str(path / "model.safetensors")),
            optimizer=load_file(str(path / "optimizer.safetensors")),
            extra=load_file(str(path / "extra.safetensors")),
            state=state,
        )
    except Exception as e:  # verified sizes and hashes make this unlikely; still say where
        raise CheckpointError(f"{path}: cannot read checkpoint: {e}") from e


def verify_checkpoint(path: Path) -> None:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing — the checkpoint was not completely written")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except ValueError as e:  # bad JSON, or bytes that are not UTF-8
        raise CheckpointError(f"{manifest_path}: not valid JSON ({e})") from None
    for name, expected in manifest.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from the checkpoint")
        size = f.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{f}: truncated or altered — {size} bytes, manifest says {expected['bytes']}")
        if _sha256(f) != expected["sha256"]:
            raise CheckpointError(f"{f}: contents do not match the manifest's SHA-256 (corrupt file)")


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-looking `step-N` directories under root, oldest first (temporary dirs ignored).

    A `step-N` that a killed re-save had moved aside (`.step-N.old-<token>`, with no `step-N` beside it) is
    renamed back first, so it is listed.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    for p in list(root.iterdir()):
        m = re.match(r"^\.(step-\d+)\.old-", p.name)
        if m and p.is_dir():
            restore_aside(root / m.group(1))
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and not is_temporary(p.name):
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (keep = 0 keeps everything)."""
    if keep <= 0:
        return
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- sharded (DCP) checkpoints

SHARDED_FORMAT = "dcp-safetensors"  # state.json's "format" of a sharded checkpoint
PICKLED_DCP_METADATA = ".metadata"  # DCP's default format (a pickle): written by earlier versions, never read
_SHARD_FILE = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")  # HuggingFaceStorageWriter's names


def is_sharded_checkpoint(path: Path) -> bool:
    """A checkpoint written by several ranks: this format, or the pickled one that `load_sharded_checkpoint` refuses."""
    path = Path(path)
    if (path / PICKLED_DCP_METADATA).is_file():
        return True
    return path.is_dir() and any(_SHARD_FILE.match(p.name) for p in path.iterdir())


def split_tensors(tree: Any) -> tuple[Any, Any]:
    """A nested state dict as (its tensors, its other values): two trees of the same dict keys.

    A subtree without tensors goes whole into the second tree (JSON: tuples become lists); a dict holding tensors
    is split key by key. Tensors inside a list or tuple have no place in either tree and are refused.
    """
    if torch.is_tensor(tree):
        return tree, None
    if isinstance(tree, dict):
        tensors, others = {}, {}
        for key, value in tree.items():
            if not isinstance(key, str):
                raise TypeError(f"state dict key {key!r} is not a string")
            t, o = split_tensors(value)
            if t is not None:
                tensors[key] = t
            if o is not None:
                others[key] = o
        return (tensors or None), (others or None)
    if isinstance(tree, (list, tuple)) and any(split_tensors(v)[0] is not None for v in tree):
        raise TypeError("tensors inside a list have no key of their own in a sharded checkpoint")
    return None, _to_json(tree)


def _to_json(value: Any) -> Any:
    """A plain value as JSON would give it back (tuples as lists); anything else is refused, never pickled."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _to_json(v) for k, v in value.items()}
    raise TypeError(f"{type(value).__name__} value {value!r} cannot go into a checkpoint's JSON")


class PendingSave:
    """A sharded save in flight: `wait()` finishes the write (async) and, on rank 0, finalises the directory."""

    def __init__(self, tmp: Path, final: Path, state: dict[str, Any], ctx: Any, future: Any = None):
        self.tmp, self.final, self.state, self.ctx, self.future = tmp, final, state, ctx, future

    def wait(self) -> Path:
        from atelier_studio.pipeline.distributed import barrier

        try:
            if self.future is not None:
                future, self.future = self.future, None
                future.result()  # every rank's shard written
            barrier(self.ctx)  # rank 0 renames only once every rank's files are complete
            if self.ctx.is_main:
                _write_json(self.tmp / "state.json", self.state)
                names = sorted(p.name for p in self.tmp.iterdir() if p.is_file() and p.name != MANIFEST)
                _write_json(self.tmp / MANIFEST, {name: _describe(self.tmp / name) for name in names})
                install_dir(self.tmp, self.final, what="checkpoint")  # an existing step-N is replaced last
        except BaseException:
            if self.ctx.is_main:  # a failed write leaves no temporary directory behind
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        barrier(self.ctx)
        return self.final


def save_sharded_checkpoint(root: Path, step: int, app_state: dict[str, Any], state: dict[str, Any],
                            rank_state: dict[str, Any], ctx: Any, async_save: bool = False) -> PendingSave:
    """Every rank writes its shards of `app_state` (nested dicts of tensors / DTensors) into root/.step-N.tmp-sharded.

    A collective: all ranks call it with the same step. The tensors go into safetensors shards; the non-tensor
    values of `app_state` (the same on every rank: the optimizer's param groups) go into `state.json` with
    `state` (JSON, rank 0's copy is kept); `rank_state` (JSON, one file per rank) goes next to them. Returns the
    pending save; its `wait()` renames the directory into place (called right away unless `async_save`).
    """
    import torch.distributed.checkpoint as dcp

    from atelier_studio.pipeline.distributed import barrier

    root = Path(root)
    final = root / f"step-{step}"
    tmp = temp_path(final, token="sharded")  # every rank writes into the same directory: a name all ranks know
    tensors, objects = split_tensors(app_state)
    if ctx.is_main:
        ensure_dir(root, "checkpoint directory")
        remove_stale(final)  # a write killed earlier: never mix its files with this one
        tmp.mkdir()
    barrier(ctx)
    try:
        _write_json(tmp / f"rank-{ctx.rank}.json", rank_state)
        state = {"step": step, "format": SHARDED_FORMAT, "world_size": ctx.world_size, **state,
                 "objects": objects or {}}
        # each rank writes its own safetensors file, streamed (pipeline/dcp_safetensors.py)
        writer = StreamingSafetensorsWriter(str(tmp))
        if async_save:
            future = dcp.async_save(tensors or {}, storage_writer=writer, process_group=_async_group())
            return PendingSave(tmp, final, state, ctx, future)
        dcp.save(tensors or {}, storage_writer=writer)
    except BaseException:
        if ctx.is_main:  # every rank's write failed with it (DCP gathers the results): nothing is left behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    pending = PendingSave(tmp, final, state, ctx)
    pending.wait()
    return pending


_ASYNC_GROUP: tuple[Any, Any] | None = None  # (the default group it was made for, the checkpoint group)


def _async_group() -> Any:
    """A gloo group of all ranks for background checkpoint writes (a collective on first use).

    The writer thread's collectives must not share a group with the training step's (FSDP's all-gathers
    and reduce-scatters run at the same time on the main thread): interleaved on one group they deadlock.
    """
    global _ASYNC_GROUP
    import torch.distributed as dist

    if _ASYNC_GROUP is None or _ASYNC_GROUP[0] is not dist.group.WORLD:
        _ASYNC_GROUP = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[1]


def load_sharded_checkpoint(path: Path, app_state: dict[str, Any], rank: int) -> tuple[int, dict[str, Any],
                                                                                           dict[str, Any] | None]:
    """Load a sharded checkpoint into `app_state` (any number of processes, or one without a group).

    `app_state` is updated in place: its tensors are filled from the shards, its non-tensor values set from
    state.json. Returns (step, state.json without the step and those values, this rank's rank-<r>.json or None
    when the checkpoint was written by fewer ranks). Tensors of `app_state` missing from the checkpoint raise
    CheckpointError; a checkpoint in DCP's pickled format is refused before any of it is read.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if (path / PICKLED_DCP_METADATA).is_file():
        raise CheckpointError(
            f"{path}: a sharded checkpoint in the old format (torch.distributed.checkpoint's pickled "
            f"{PICKLED_DCP_METADATA}), which Atelier no longer reads because unpickling a file can run code. Finish "
            f"that run with the Atelier version that wrote it, or start a new run (another output.dir) from the "
            f"weights it exported; checkpoints are now safetensors and JSON only")
    verify_checkpoint(path)
    try:
        state = json.loads((path / "state.json").read_text())
        if state.get("format") != SHARDED_FORMAT:
            raise CheckpointError(f"{path}/state.json: format {state.get('format')!r}, expected {SHARDED_FORMAT!r}")
        tensors, _ = split_tensors(app_state)
        import warnings

        import torch.distributed as dist

        # one process without a group (resuming a multi-process run on one) reads every shard itself; DCP
        # warns that it assumes exactly that
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors or {}, storage_reader=dcp.HuggingFaceStorageReader(str(path)),
                     no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # DCP's own exception is a BaseException
        raise CheckpointError(f"{path}: cannot load the sharded checkpoint: {_dcp_reason(e)}") from e
    _update_tree(app_state, state.pop("objects", {}))
    rank_file = path / f"rank-{rank}.json"
    rank_state = json.loads(rank_file.read_text()) if rank_file.is_file() else None
    return int(state.pop("step")), state, rank_state


def _dcp_reason(e: BaseException) -> str:
    """What went wrong, without DCP's per-rank tracebacks: each distinct underlying error once."""
    failures = getattr(e, "failures", None)
    if not failures:
        return str(e)
    reasons = dict.fromkeys(f"{type(exc).__name__}: {exc}" for exc, _ in failures.values())
    return "; ".join(reasons)


def _update_tree(tree: dict[str, Any], values: dict[str, Any]) -> None:
    """Put the saved non-tensor `values` into the nested dict `tree` (in place; their dicts merge key by key)."""
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _update_tree(tree[key], value)
        else:
            tree[key] = value


# ----------------------------------------------------------------------------- helpers


def _contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _describe(f: Path) -> dict[str, Any]:
    return {"bytes": f.stat().st_size, "sha256": _sha256(f)}


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    """Into a checkpoint's temporary directory (installed whole, and fsynced, by pipeline/atomic.py)."""
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))
