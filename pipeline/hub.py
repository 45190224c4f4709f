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
Data arguments (data.train / data.eval, `data shards --from`) go through `resolve_dataset_path` the same way, as
hub datasets (`<cache>/datasets--org--name/...`), always strictly: an id not in the cache is a DataError.
The cache folder is read from the environment here, at each call, as huggingface_hub reads it: HF_HUB_CACHE, else
HF_HOME/hub, else ~/.cache/huggingface/hub.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from atelier_studio.pipeline.errors import DataError, ModelLoadError

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


def _lookup(value: str, repo_type: str) -> str | tuple[str, str | None]:
    """`value` itself (an existing path, or no hub id), the cached snapshot of the id (offline: nothing is
    downloaded), or (repo id, revision) of an id that is not in the cache."""
    parsed = None if not value or Path(value).expanduser().exists() else parse_repo_id(value)
    if parsed is None:
        return value
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(parsed[0], revision=parsed[1], repo_type=repo_type, cache_dir=str(hub_cache_dir()),
                                 local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return parsed


def _not_cached(what: str, value: str, missing: tuple[str, str | None], kind: str) -> str:
    """The message for an id not in the cache: the argument, the id, the cache searched, the command that fills it."""
    repo_id, revision = missing
    at = f" at revision {revision}" if revision else ""
    flags = (" --repo-type dataset" if kind == "dataset" else "") + (f" --revision {revision}" if revision else "")
    local = "file or folder" if kind == "dataset" else "local directory"
    return (f"{what} {value!r}: no such {local}, and the hub {kind} {repo_id}{at} is not in the Hugging Face cache "
            f"{hub_cache_dir()} (searched offline: nothing is downloaded); on a machine with network run "
            f"`huggingface-cli download{flags} {repo_id}` and copy the cache here (or set HF_HUB_CACHE / HF_HOME to "
            f"it), or pass a local {'path' if kind == 'dataset' else 'model directory'}")


def resolve_model_path(value: str, what: str, strict: bool = True) -> str:
    """`value` as a local path: itself when it exists or is no hub id, else the cached snapshot of the hub id
    (module docstring). `what` names the argument in the error (e.g. "model.path", "--model"). strict=False returns
    an id that is not in the cache unchanged: what a config does when it loads (a config may name a local directory
    that is made later, like `models/tiny`, also a valid id); the model's loader then resolves strictly."""
    found = _lookup(value, "model")
    if isinstance(found, str):
        return found
    if not strict:
        return value
    raise ModelLoadError(_not_cached(what, value, found, "model"))


def resolve_dataset_path(value: str, what: str) -> str:
    """A data argument (data.train, data.eval, `data shards --from`) as a local path: itself when it exists or is no
    hub id, else the cached snapshot of the hub dataset `org/name[@revision]` (`datasets--org--name` in the cache;
    offline, never downloaded); a dataset id not in the cache is a DataError naming it, the cache and the fix."""
    found = _lookup(value, "dataset")
    if isinstance(found, str):
        return found
    raise DataError(_not_cached(what, value, found, "dataset"))
