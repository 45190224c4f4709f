"""The configs and the prefect.yaml that ship inside the package (`atelier_studio.configs`, the checkout's configs/).

A config argument (`--config`, a deployment's `config` parameter) is a file path or a shipped config's name:

    designer/demo      the shipped configs/designer/demo.toml (`atelier config list` names them all)
    my.toml            a file; an existing file always wins over a name

so a deployment's default works from an installed wheel in any working directory. The paths inside a config
(model.path, data.train, output.dir, ...) stay relative to the working directory of the process that reads it
(the flow run's; the flows state it in their `output` artifact), exactly as for a config file of the user's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from atelier_studio.pipeline.config import ConfigError

PACKAGE = "atelier_studio.configs"
PREFECT_YAML = "prefect.yaml"


def configs_dir() -> Path:
    """The folder of the shipped configs: site-packages/atelier_studio/configs, or the checkout's configs/."""
    spec = importlib.util.find_spec(PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location, "designer").is_dir():
            return Path(location)
    raise ConfigError(f"the shipped configs ({PACKAGE}) are not installed; reinstall atelier-studio")


def list_configs() -> list[str]:
    """Every shipped config's name, `<trainer>/<name>`, sorted."""
    root = configs_dir()
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.glob("*/*.toml"))


def shipped_config(name: str) -> Path:
    """The file of a shipped config named `<trainer>/<name>` (a `.toml` suffix is allowed)."""
    key = name.removesuffix(".toml")
    path = configs_dir() / f"{key}.toml"
    if key not in list_configs():
        raise ConfigError(f"no shipped config {name!r}; shipped: {', '.join(list_configs())} "
                          f"(or pass a path to a TOML file)")
    return path


def resolve_config(value: str | Path, kind: str | None = None) -> Path:
    """A config argument as a file: an existing path as it is, else a shipped name (`designer/demo`, or `demo`
    for the trainer `kind`); anything else is a ConfigError naming the value, the cwd and the shipped names."""
    path = Path(value)
    if path.is_file():
        return path
    names = list_configs()
    key = str(value).removesuffix(".toml")
    for candidate in (key, f"{kind}/{key}" if kind else None):
        if candidate in names:
            return configs_dir() / f"{candidate}.toml"
    # a `configs/...` path from a checkout (older docs, scripts) names the shipped config of the same name
    if key.startswith("configs/") and key.removeprefix("configs/") in names:
        return configs_dir() / f"{key.removeprefix('configs/')}.toml"
    raise ConfigError(f"config {value}: no such file (cwd {Path.cwd()}) and no shipped config of that name; "
                      f"shipped: {', '.join(n for n in names if kind is None or n.startswith(kind + '/'))}")


def prefect_yaml() -> Path:
    """The shipped prefect.yaml (the checkout's root prefect.yaml links to it)."""
    return configs_dir() / PREFECT_YAML
