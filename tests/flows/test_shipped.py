"""The configs and prefect.yaml ship in the package: named from any working directory, listed and shown by the CLI,
and declared as package data so the wheel carries every one (.ci/install-check runs them from the installed wheel)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest

from atelier_studio.flows.cli import main as atelier
from atelier_studio.flows.shipped import list_configs, prefect_yaml, resolve_config
from atelier_studio.flows.training import FlowInputError, check_config
from atelier_studio.pipeline.config import ConfigError

ROOT = Path(__file__).parents[2]


def test_every_config_file_is_shipped_and_listed():
    names = {p.relative_to(ROOT / "configs").with_suffix("").as_posix() for p in (ROOT / "configs").glob("*/*.toml")}
    assert set(list_configs()) == names and "designer/demo" in names
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert data["package-dir"]["atelier_studio.configs"] == "configs"
    for f in (ROOT / "configs").rglob("*"):
        if f.is_file():
            rel = f.relative_to(ROOT / "configs")
            package = ".".join(("atelier_studio.configs", *rel.parent.parts))
            assert package in data["packages"], f"{package} is not in pyproject.toml's packages"
            patterns = data["package-data"].get(package, [])
            assert any(fnmatch.fnmatch(rel.name, p) for p in patterns), f"{rel} is not package data (pyproject.toml)"
    assert prefect_yaml().is_file() and (ROOT / "prefect.yaml").resolve() == prefect_yaml().resolve()


def test_a_shipped_name_resolves_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config("designer/demo").resolve() == ROOT / "configs" / "designer" / "demo.toml"
    assert resolve_config("demo", "imagegen").name == "demo.toml"
    assert check_config("designer", "designer/demo").output.dir == "runs/d1"  # paths stay relative to the cwd
    (tmp_path / "designer").mkdir()
    (tmp_path / "designer" / "demo").write_text("[train]\nmax_steps = 3\n")  # an existing file wins over a name
    assert resolve_config("designer/demo") == Path("designer/demo")
    with pytest.raises(ConfigError, match=r"config nope\.toml: no such file \(cwd .*\).*shipped: imagegen/demo"):
        resolve_config("nope.toml", "imagegen")
    with pytest.raises(FlowInputError, match="designer config nope"):
        check_config("designer", "nope")


def test_config_list_and_show(capsys):
    assert atelier(["config", "list"]) == 0
    assert capsys.readouterr().out.split() == list_configs()
    assert atelier(["config", "show", "designer/demo"]) == 0
    assert capsys.readouterr().out == (ROOT / "configs" / "designer" / "demo.toml").read_text()
    assert atelier(["config", "show", "designer/nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no shipped config 'designer/nope'; shipped: designer/demo" in err
