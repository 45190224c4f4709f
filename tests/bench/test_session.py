"""bench/session.py on the CPU: the tiny plan through the real driver (wheels installed from a folder, the
checkout's own `atelier_studio/` links on PYTHONPATH, the bundle and summary in the output folder), a step killed at
its time limit keeping what it wrote, a step skipped when its minimum no longer fits, and the packing of wheels into one
archive."""
from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from atelier_studio.bench.session import Part, Step, main, pack, run_session

ROOT = Path(__file__).parents[2]


def _wheel(folder: Path, name: str = "atelierprobe", value: int = 7, extra: dict[str, bytes] | None = None) -> Path:
    """A minimal pure-Python wheel: `import <name>` gives VALUE = value; `extra`: more files, by path."""
    files = {f"{name}/__init__.py": f"VALUE = {value}\n".encode(), **(extra or {}),
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"}
    record = "".join(f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b'=').decode()},"
                     f"{len(v)}\n" for k, v in files.items()) + f"{name}-1.0.dist-info/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{name}-1.0.dist-info/RECORD", record)
    return path


def _bundle(out: Path) -> list[str]:
    with tarfile.open(out / "results.tar.gz") as tar:
        return tar.getnames()


def test_the_tiny_plan_runs_through_the_driver(tmp_path):
    """Parts c and f at CPU size: a wheel installed from the folder and importable by the steps, a broken one named
    as failed, every report in the bundle, the reports' tables in the summary."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels)
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    out, work = tmp_path / "out", tmp_path / "work"
    assert main(["--tiny", "--budget-s", "400", "--parts", "c,f", "--wheels", str(wheels), "--out", str(out),
                 "--work", str(work)]) == 0
    record = json.loads((out / "session.json").read_text())
    assert record["install"]["installed"] == ["atelierprobe-1.0-py3-none-any.whl"]
    assert set(record["install"]["failed"]) == {"broken-1.0-py3-none-any.whl"}
    probe = subprocess.run([sys.executable, "-c", "import atelierprobe; print(atelierprobe.VALUE)"],
                           env={"PYTHONPATH": str(work / "site"), "PATH": ""}, capture_output=True, text=True)
    assert probe.stdout.strip() == "7"
    assert [(s["part"], s["step"], s["status"]) for s in record["steps"]] == [
        ("c", "imagegen", "ok"), ("f", "joint-attention", "ok"), ("f", "gated-delta-rule", "ok")]
    names = _bundle(out)
    for stem in ("c-imagegen-1024/imagegen-sd3-medium-1024", "f-joint-attention/joint-attention",
                 "f-gated-delta-rule/gated-delta-rule"):
        assert any(n.startswith(f"results/{stem}-") and n.endswith(".json") for n in names), (stem, names)
    text = (out / "summary.md").read_text()
    assert "| atelier fp8 tensorwise |" in text and "choice: None" in text and "broken-1.0" in text
    assert (out / "session.log").read_text().count("=== part") == 3
    assert len(list(out.iterdir())) <= 8  # what comes back from the device: at most 8 files


def test_a_step_past_its_limit_is_killed_keeping_what_it_wrote_and_a_step_that_cannot_fit_is_skipped(tmp_path):
    writes_then_hangs = ("-c", "import pathlib, sys, time\n"
                               "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
                               "(out / 'partial.json').write_text('{\"runs\": 1}')\n"
                               "print('wrote', flush=True)\n"
                               "time.sleep(120)\n")
    parts = [Part("a", "slow", (Step("hangs", writes_then_hangs, estimate_s=4, min_s=1, tail_s=0,
                                     takes_budget=False),)),
             Part("b", "big", (Step("needs-time", ("-c", "print('never')"), estimate_s=600, min_s=300, tail_s=0,
                                    takes_budget=False),))]
    out = tmp_path / "out"
    record = run_session(lambda tokenizer: parts, budget_s=60, out=out, wheels=tmp_path / "none", work=tmp_path / "w")
    hung, big = record["steps"]
    assert hung["status"].startswith("killed at its time limit") and hung["rc"] is None
    assert hung["seconds"] < hung["allowed_s"] + 20 and hung["reports"] == ["a-slow/partial.json"]
    assert big["status"].startswith("skipped") and "at least 300 s" in big["status"]
    assert "results/a-slow/partial.json" in _bundle(out)
    summary = (out / "summary.md").read_text()
    assert "not run: part b needs-time" in summary and "print('never')" in summary
    assert "wrote" in (out / "session.log").read_text()


def test_pack_makes_one_archive_the_driver_unpacks_and_its_pth_folders_are_on_the_path(tmp_path):
    """A packed wheel unpacks into the site; a .pth file there (nvidia-cutlass-dsl reaches its `cutlass` module
    through one) adds its folder to the steps' path, as a site-packages folder would."""
    from atelier_studio.bench.session import child_env, install, pth_paths

    (tmp_path / "whl").mkdir()
    wheel = _wheel(tmp_path / "whl", "atelierpacked", 3, extra={"atelierpacked.pth": b"atelierpacked_libs\n",
                                                               "atelierpacked_libs/atelierdeep.py": b"DEEP = 5\n"})
    archive = pack([wheel], tmp_path / "whl" / "site-probe.tar.xz")
    with tarfile.open(archive, "r:xz") as tar:
        assert any(n.endswith("atelierpacked/__init__.py") for n in tar.getnames())
    wheel.unlink()  # only the archive travels
    site = tmp_path / "site"
    got = install(tmp_path / "whl", site)
    assert got["installed"] == ["site-probe.tar.xz"] and not got["failed"]
    assert (site / "atelierpacked" / "__init__.py").read_text() == "VALUE = 3\n"
    assert pth_paths(site) == [site / "atelierpacked_libs"]
    env = child_env([site, *pth_paths(site)])
    done = subprocess.run([sys.executable, "-c", "import atelierpacked, atelierdeep; print(atelierpacked.VALUE, "
                           "atelierdeep.DEEP)"], env=env, capture_output=True, text=True)
    assert done.stdout.split() == ["3", "5"], done.stderr


def test_bad_arguments_say_what(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--budget-s", "100", "--parts", "a,z", "--out", str(tmp_path)])
    assert "--parts: unknown ['z']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--budget-s", "5", "--out", str(tmp_path)])
    assert "--budget-s must be > 10" in capsys.readouterr().err
    assert main(["--budget-s", "500", "--plan", "--parts", "a,d"]) == 0
    assert "total ~440 s of estimates" in capsys.readouterr().out


def test_every_step_of_the_gpu_plan_is_a_valid_command_of_its_bench():
    """The H200 plan is never run here: each of its commands is parsed by its bench's own parser (with what the
    driver appends), and the values the benches check after parsing (peer names, FP8 recipes, attention paths,
    configs) are checked the same way, so a typo cannot cost device time."""
    import importlib

    from atelier_studio.bench.designer_peers import parse_peer
    from atelier_studio.bench.joint_attention import PATHS
    from atelier_studio.bench.session import plan
    from atelier_studio.kernels.fp8_linear import TRAIN_RECIPES

    steps = [s for part in plan("/tok") for s in part.steps]
    assert [p.key for p in plan(None)] == list("abcdefghijklmnop") and len(steps) == 21
    for s in steps:
        assert s.command[0] == "-m" and s.min_s <= s.estimate_s and s.tail_s < s.estimate_s
        module = importlib.import_module(s.command[1])
        args = [*s.command[2:], "--out", "x", *(["--budget-s", "1"] if s.takes_budget else [])]
        if module.__name__.endswith("joint_attention"):
            paths = args[args.index("--paths") + 1].split(",")
            assert set(paths) <= set(PATHS), paths
            continue
        a = module.parser().parse_args(args)
        if hasattr(a, "peers") and module.__name__.endswith("designer"):
            for item in filter(None, a.peers.split(",")):
                name, _, mbs = item.partition("@")
                parse_peer(name)
                assert all(m.isdigit() for m in filter(None, mbs.split("+"))), item
        if module.__name__.endswith("imagegen"):
            assert set(filter(None, a.peers.split(","))) <= set(module.PEERS)
        if getattr(a, "fp8", ""):
            assert set(a.fp8.split(",")) <= set(TRAIN_RECIPES)
        if "--tokenizer" in args:
            assert a.tokenizer == "/tok"
