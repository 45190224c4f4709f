"""What a resume may change: a run's settings compared, key by key, with those its checkpoint was trained under.

Each trainer's config class declares a `ResumePolicy` (`resume_policy`, per config section; docs/training.md lists
them), which sorts every key into one of three lists:

- refuse: a change makes the checkpoint something else: the model, the trainable parameters' shapes or meaning
  (LoRA rank, targets, alpha), the data stream (files, row length, seed). The resume stops before
  anything is loaded, naming every such key with old -> new and the fix (another output.dir, or the old value).
- warn: hyper-parameters, cadences and logging (lr, schedule, max_steps, eval and checkpoint cadence). The run
  goes on with the new values after a warning naming every changed key with old -> new.
- free: where and how the run is started, never what it computes (train.resume, output.dir, the MFU peak, the
  per-process micro-batch and imagegen's data.streams, whose global value the saved data position checks).

An entry names a key (`train.lr`) or a whole section (`sample`, `train.distributed`); the longest match decides.
A key in no list is refused, so a new key is placed deliberately (tests/pipeline/test_config_diff.py checks
that both trainers place every key).

History. The config a checkpoint was trained under is the run's `config.toml`, unless a later resume changed it:
then `config.step-N.toml` holds the settings that trained steps up to N, where a resume at step N changed some, and
`config.toml` the current ones. A checkpoint of step M is compared with the first `config.step-N.toml` with
N >= M, else with `config.toml`. `record_run_config` writes both after the checkpoint has loaded.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from atelier_studio.pipeline.atomic import atomic_write_text, ensure_dir
from atelier_studio.pipeline.config import ConfigError, config_to_toml, flatten
from atelier_studio.pipeline.progress import log

Rule = Literal["refuse", "warn", "free"]
CONFIG_NAME = "config.toml"
_HISTORY = re.compile(r"^config\.step-(\d+)\.toml$")
_STEP_DIR = re.compile(r"^step-(\d+)$")

# [train] and [output], shared by both trainers: the seed orders the data stream, so its change is refused, and so
# is another optimizer or low-bit block size (the saved optimizer state has another layout, or means another thing);
# train.micro_batch is per process, and a checkpoint resumes on another number of processes with the same global
# micro-batch (2 x 4 as 1 x 8, exactly), so it is free here: the saved data position refuses another global batch
# with its own error. Everything else is a hyper-parameter, a cadence, logging or an execution choice, taken with
# a warning.
TRAIN_REFUSE = ("train.seed", "train.optimizer", "train.lowbit.block_size")
TRAIN_WARN = ("train", "output")
TRAIN_FREE = ("train.resume", "train.peak_tflops", "train.micro_batch", "output.dir")


@dataclass(frozen=True)
class ResumePolicy:
    """What a resume may change (module docstring): keys or sections refused, warned about, or free."""

    refuse: tuple[str, ...]
    warn: tuple[str, ...]
    free: tuple[str, ...] = ()

    def rule(self, key: str) -> Rule | None:
        """The rule of the longest entry that is `key` or a section holding it; None when no entry does."""
        best: tuple[int, Rule] | None = None
        for rule, entries in (("refuse", self.refuse), ("warn", self.warn), ("free", self.free)):
            for entry in entries:
                if (key == entry or key.startswith(entry + ".")) and (best is None or len(entry) > best[0]):
                    best = (len(entry), rule)
        return best[1] if best else None


@dataclass(frozen=True)
class Change:
    key: str
    old: Any  # None: not in that config
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} → {_show(self.new)}"


@dataclass(frozen=True)
class ResumeCheck:
    """A resume's comparison: the checkpoint, the config it was trained under, and the (warned) changes."""

    checkpoint: Path | None  # None: a fresh start
    previous: Path | None  # the config file compared with (None: nothing to compare)
    changes: tuple[Change, ...] = ()


def resumed_checkpoint(out_dir: Path, resume: str) -> Path | None:
    """The checkpoint `train.resume` continues from (the Checkpointer verifies it when it loads it)."""
    from atelier_studio.pipeline.checkpoint_files import list_checkpoints

    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(Path(out_dir) / "checkpoints")
        return found[-1] if found else None
    return Path(resume)


def trained_under(checkpoint: Path) -> Path:
    """The config file a checkpoint (`<run>/checkpoints/step-M`) was trained under (module docstring)."""
    run = Path(checkpoint).parent.parent
    m = _STEP_DIR.match(Path(checkpoint).name)
    if m is not None and run.is_dir():
        step = int(m.group(1))
        later = sorted(int(h.group(1)) for p in run.iterdir() if (h := _HISTORY.match(p.name)))
        later = [n for n in later if n >= step]
        if later:
            return run / f"config.step-{later[0]}.toml"
    return run / CONFIG_NAME




def diff(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every key whose value differs between two flattened configs (a key missing from one side included)."""
    return [Change(k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


def check_resume(cfg: Any, policy: ResumePolicy, out_dir: Path) -> ResumeCheck:
    """Compare `cfg` with the config of the checkpoint `cfg.train.resume` continues from: a `ConfigError` naming
    every refused change, else the changes to warn about (printed here). Reads files only; writes nothing."""
    checkpoint = resumed_checkpoint(out_dir, cfg.train.resume)
    if checkpoint is None or not checkpoint.exists():  # a path that is not there: the Checkpointer names it
        return ResumeCheck(checkpoint, None)
    previous = trained_under(checkpoint)
    if not previous.is_file():
        log(f"resuming {checkpoint}: no {previous.name} beside it, so the settings it was trained under are unknown "
            f"and not compared")
        return ResumeCheck(checkpoint, None)
    try:
        old = flatten(tomllib.loads(previous.read_text(encoding="utf-8")))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{previous}: invalid TOML ({e}), so the settings {checkpoint} was trained under cannot "
                          f"be compared with this run's; restore the file, or resume into another output.dir") from None
    new = flatten(tomllib.loads(config_to_toml(cfg)))
    # written by another version: a key it lacks was added since, and its default is what that run did; a key this
    # version no longer has cannot be set either way
    defaults = flatten(tomllib.loads(config_to_toml(type(cfg)())))
    old = {**defaults, **{k: v for k, v in old.items() if k in defaults or k in new}}
    changes = [c for c in diff(old, new) if policy.rule(c.key) != "free"]
    refused = [c for c in changes if policy.rule(c.key) in ("refuse", None)]
    if refused:
        raise ConfigError(
            f"cannot resume {checkpoint} with these settings changed: {'; '.join(str(c) for c in refused)} (they "
            f"change the model, its trainable parameters or the data stream it was trained on; {previous} has the "
            f"old values). Start a new run in another output.dir, or resume with "
            f"{' '.join(f'--set {c.key}={_show(c.old)}' for c in refused)}")
    if changes:
        log(f"warning: resuming {checkpoint} with {len(changes)} changed setting{'s' if len(changes) > 1 else ''} "
            f"(the run goes on with the new values; the old ones stay in the run's config history): "
            f"{'; '.join(str(c) for c in changes)}")
    return ResumeCheck(checkpoint, previous, tuple(changes))


def record_run_config(cfg: Any, out_dir: Path, check: ResumeCheck, step: int) -> Path:
    """Write the run's `config.toml` (once the checkpoint has loaded); when the resume at `step` changed settings,
    keep the config that trained the steps before it as `config.step-<step>.toml` first."""
    out_dir = ensure_dir(Path(out_dir), "output.dir")
    if check.changes and check.previous is not None:
        atomic_write_text(out_dir / f"config.step-{step}.toml", check.previous.read_text(encoding="utf-8"),
                          what="config history")
    return atomic_write_text(out_dir / CONFIG_NAME, config_to_toml(cfg), what="resolved config")


def _show(value: Any) -> str:
    if value is None:
        return "(not set)"
    if isinstance(value, str):
        return repr(value)
    return str(value)


__all__ = ["ResumePolicy", "Change", "ResumeCheck", "TRAIN_REFUSE", "TRAIN_WARN", "TRAIN_FREE", "resumed_checkpoint",
           "trained_under", "flatten", "diff", "check_resume", "record_run_config"]
