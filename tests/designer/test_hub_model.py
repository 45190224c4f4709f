"""Hub ids as designer model arguments, through the CLI, from a hub cache laid out by the test (offline): a LoRA run
trains from `org/name`, generate reads `--model org/name`, and an id not in the cache is exit 2 with one line."""
from __future__ import annotations

import json

import pytest

from atelier_studio.flows.cli import main

from tests.designer.test_train import train_args, train_losses
from tests.pipeline.test_hub import lay_out_cache, offline_cache  # noqa: F401 (a fixture)


def test_a_lora_run_trains_from_a_hub_id_and_generate_reads_one(world, offline_cache, tmp_path):  # noqa: F811
    snapshot = lay_out_cache(offline_cache, "atelier-test/designer-tiny", world / "model")
    out = tmp_path / "run"
    assert main(train_args(world, out, "--set", "model.path=atelier-test/designer-tiny", "--set", "lora.rank=4",
                           "--set", "train.max_steps=2", "--set", "train.save_every=2")) == 0
    assert [s for s, _ in train_losses(out)] == [1, 2]
    adapter_cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(snapshot.resolve())  # a base PEFT can load
    briefs = tmp_path / "briefs.txt"
    briefs.write_text("a red circle\n")
    assert main(["designer", "generate", "--model", "atelier-test/designer-tiny", "--adapter", str(out / "adapter"),
                 "--briefs", str(briefs), "--out", str(tmp_path / "captions.jsonl"), "--max-new-tokens", "4"]) == 0
    assert len((tmp_path / "captions.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("argv", [
    lambda world, tmp: train_args(world, tmp / "run", "--set", "model.path=atelier-test/absent", "--set",
                                  "lora.rank=4"),
    lambda world, tmp: ["designer", "generate", "--model", "atelier-test/absent", "--briefs", str(tmp / "b.txt"),
                        "--out", str(tmp / "c.jsonl")],
    lambda world, tmp: ["imagegen", "sample", "--model", "atelier-test/absent", "--captions", str(tmp / "c.txt"),
                        "--out", str(tmp / "out")],
    lambda world, tmp: ["render", "--designer", "atelier-test/absent", "--imagegen", str(tmp), "--briefs",
                        str(tmp / "b.txt"), "--out", str(tmp / "out")],
], ids=["train", "generate", "imagegen sample", "render"])
def test_an_id_not_in_the_cache_is_one_line_naming_it_and_the_cache(argv, world, offline_cache, tmp_path,  # noqa: F811
                                                                     capsys):
    assert main(argv(world, tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atelier: error: "), err
    assert "'atelier-test/absent'" in err[0] and str(offline_cache) in err[0], err
    assert "huggingface-cli download atelier-test/absent" in err[0], err
    assert not (tmp_path / "run").exists()
