"""Model arguments that name a Hugging Face hub id (`Qwen/Qwen3-8B`, `org/name@revision`), found in the local cache.

Every model argument goes through `resolve_model_path`: the CLI's --model / --adapter / --designer / --imagegen /
--clip and an adapter's base_model_name_or_path strictly; a config's model fields (pipeline/config.py's MODEL_PATH:
model.path, lora.init_adapter, text.encoder, autoencoder.spec) when it loads, leniently (an id not in the cache stays
as it is: `models/tiny` may be a folder made later), then strictly where the trainer opens the model (designer/task.py,
imagegen/hf.py resolve_dir):
  - a path that exists is used as it is, always (a local folder named like an id wins);
  - `org/name` or `org/name@revision` that is not a path is looked up in the hub cache, never downloaded
    (`snapshot_download(..., local_files_only=True)`): the snapshot folder
    `<cache>/models--org--name/snapshots/<commit>` (refs/<revision> names the commit) is the model's directory;
    a model not in the cache is a ModelLoadError naming the id, the cache folder searched and the fix;
  - anything else is returned unchanged, for the caller's own "not a directory" error.
The cache folder is read from the environment here, at each call, as huggingface_hub reads it: HF_HUB_CACHE, else
HF_HOME/hub, else ~/.cache/huggingface/hub.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from atelier_studio.pipeline.errors import ModelLoadError

# huggingface_hub's repo-id rule: one "/" between an optional namespace and a name of [A-Za-z0-9._-], no "--" or "..",
# not starting or ending with "-" or "."; an optional @revision (a branch, tag or commit)
_REPO_ID = re.compile(r"^(?P<id>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})(@(?P<rev>[^\s@]+))?$")


def hub_cache_dir() -> Path:
    """The hub cache folder huggingface_hub would use, from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def parse_repo_id(value: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of `org/name[@revision]`; None for a string that is no hub id."""
    m = _REPO_ID.match(value)
    if m is None or "--" in m["id"] or ".." in m["id"] or m["id"].split("/")[1].endswith((".", "-")):
        return None
    return m["id"], m["rev"]


def resolve_model_path(value: str, what: str, strict: bool = True) -> str:
    """`value` as a local path: itself when it exists or is no hub id, else the cached snapshot of the hub id
    (module docstring). `what` names the argument in the error (e.g. "model.path", "--model"). strict=False returns
    an id that is not in the cache unchanged: what a config does when it loads (a config may name a local directory
    that is made later, like `models/tiny`, also a valid id); the model's loader then resolves strictly."""
    if not value or Path(value).expanduser().exists():
        return value
    parsed = parse_repo_id(value)
    if parsed is None:
        return value
    repo_id, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        if not strict:
            return value
        at = f" at revision {revision}" if revision else ""
        raise ModelLoadError(
            f"{what} {value!r}: no such local directory, and the hub model {repo_id}{at} is not in the Hugging Face "
            f"cache {cache} (searched offline: nothing is downloaded); on a machine with network run "
            f"`huggingface-cli download {repo_id}{' --revision ' + revision if revision else ''}` and copy the cache "
            f"here (or set HF_HUB_CACHE / HF_HOME to it), or pass a local model directory") from None
