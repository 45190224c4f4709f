"""bench/designer.py end to end at tiny size on the CPU (fp32): every JSON field, and loss parity with transformers+PEFT."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch

from atelier_studio.bench.designer import (
    CONFIGS,
    Variant,
    bench,
    markdown,
    build_atelier,
    build_peer,
    lora_init,
    main,
    make_batches,
    peer_floor,
    random_state_dict,
    tiny_config,
    to_device,
)
from atelier_studio.data.packing import fixed_shape
from atelier_studio.designer.lora import LoraArgs
from atelier_studio.designer.model import ModelArgs

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["--config", "qwen3-8b-lora", "--tiny", "--out", str(out), "--peers", "hf,hf-liger",
                 "--steps", "2", "--warmup", "1", "--ablation"]) == 0
    (path,) = out.glob("designer-qwen3-8b-lora-*.json")
    assert path.with_suffix(".md").is_file()
    return json.loads(path.read_text())


def test_tiny_run_writes_every_field(tiny_report):
    r = tiny_report
    for key in ("gpu", "versions", "clocks", "matmul_tflops", "config", "atelier", "peers", "loss_mean_abs_diff",
                "ablation"):
        assert key in r, key
    assert set(r["clocks"]) == {"before", "after"}
    a = r["atelier"]
    for key in ("tokens_per_s", "mfu_4n", "mfu_6n", "peak_gb", "micro_batch"):
        assert key in a, key
    assert a["tokens_per_s"] > 0 and a["micro_batch"] in (1, 2)
    assert a["mfu_6n"] > a["mfu_4n"] > 0  # LoRA: the 6N convention counts the frozen weights' gradients too
    # the peers' convention counts the LM head on every token, Atelier's count only where a loss is taken
    assert a["mfu_4n_head_all"] > a["mfu_4n"] and r["peers"]["hf"]["mfu_4n_head_all"] > r["peers"]["hf"]["mfu_4n"]
    assert r["peers"]["hf"]["tokens_per_s"] > 0 and "mfu_4n" in r["peers"]["hf"] and "peak_gb" in r["peers"]["hf"]
    if importlib.util.find_spec("liger_kernel") is None:
        assert "import failed" in r["peers"]["hf-liger"]["skipped"]
    # exact (tiny, CPU) runs have no compile switch and fp32 adapters already
    assert set(r["ablation"]) == {"all_on", "reference_kernels", "plain_logits", "sdpa_attention", "foreach_adamw"}
    assert r["loss_parity_peer"] == "hf"
    assert all(v > 0 for v in r["ablation"].values())
    for run in r["sweep"].values():  # same batches, same weights: every Atelier variant trains the same way
        assert all(math.isfinite(x) for x in run["timed_losses"])


def test_tiny_packed_loss_parity_with_peft(tiny_report):
    assert tiny_report["loss_mean_abs_diff"] < 1e-4


@pytest.mark.parametrize("name", ["qwen3-8b-lora-64k", "qwen3-1.7b-full"])
def test_tiny_parity_one_doc_rows_and_full_finetuning(name, tmp_path):
    """One document per row (the 64k config) and full fine-tuning with tied embeddings (1.7B)."""
    cfg = dataclasses.replace(tiny_config(CONFIGS[name]), micro_batches=(2,))
    r = bench(name, cfg, tmp_path, ["hf"], [2], steps=3, warmup=1, ablation=False, tokenizer=None, device=CPU,
              exact=True)
    assert r["loss_mean_abs_diff"] < 1e-4
    if name == "qwen3-1.7b-full":  # the losses moved: the optimizer really trained both sides
        losses = r["sweep"]["2"]["losses"]
        assert abs(losses[0] - losses[-1]) > 1e-4


def _setup(seed: int = 0):
    cfg = tiny_config(CONFIGS["qwen3-8b-lora"])
    args = ModelArgs.from_size(cfg.size, vocab_size=cfg.vocab_size)
    sd = random_state_dict(args, torch.float32, CPU, seed)
    lsd = lora_init(args, LoraArgs(), CPU, seed + 1)
    with torch.no_grad():  # a nonzero B so the adapter is in the loss from the first step
        for k in lsd:
            if "lora_B" in k:
                lsd[k] = 0.05 * torch.randn(lsd[k].shape, generator=torch.Generator().manual_seed(7))
    batch = make_batches(cfg, 2, 1, None, seed)[0]
    return cfg, args, sd, lsd, batch


def test_padded_cu_seqlens_and_peer_are_exact_and_leaking_is_caught():
    cfg, args, sd, lsd, batch = _setup()
    assert len(batch.doc_lens) > 2  # really packed
    atelier = build_atelier(cfg, args, sd, lsd, Variant(compile=False), exact=True)
    want = atelier.loss(to_device(batch, CPU))
    padded = fixed_shape(batch, len(batch.cu_seqlens) + 3)
    assert padded.cu_seqlens.numel() == batch.cu_seqlens.numel() + 4 and padded.max_seqlen == cfg.seq_len
    torch.testing.assert_close(atelier.loss(to_device(padded, CPU)), want, rtol=1e-6, atol=1e-6)
    peer = build_peer("hf", cfg, args, sd, lsd, exact=True)
    torch.testing.assert_close(peer.loss(to_device(batch, CPU)), want, rtol=1e-5, atol=1e-5)
    # the same rows with plain positions (what a peer without packing support does) attend across documents
    leaky = dataclasses.replace(batch, position_ids=torch.arange(cfg.seq_len).expand_as(batch.position_ids).clone())
    assert (peer.loss(to_device(leaky, CPU)) - want).abs() > 1e-3


def test_bad_arguments_say_what(capsys):
    with pytest.raises(SystemExit):
        main(["--config", "qwen3-8b-lora", "--tiny", "--peers", "unsloth"])
    assert "--peers: unknown ['unsloth']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", "qwen3-8b-lora", "--tiny", "--micro-batches", "two"])
    assert "expected comma-separated ints" in capsys.readouterr().err
    with pytest.raises(ValueError, match="segments > 1"):
        fixed_shape(_setup()[4], 1)


def test_tiny_qwen35_rows_of_one_document_match_transformers_and_packed_rows_do_not(tmp_path):
    """The Qwen3.5 configs through the same harness: on rows of one document Atelier and transformers+PEFT (its
    torch path here) train alike; on packed rows transformers leaks recurrent state across documents."""
    diffs = {}
    for name in ("qwen3.5-9b-lora-1doc", "qwen3.5-9b-lora"):
        cfg = dataclasses.replace(tiny_config(CONFIGS[name]), micro_batches=(2,))
        r = bench(name, cfg, tmp_path, ["hf", "hf-nofla"], [2], steps=2, warmup=1, ablation=False, tokenizer=None,
                  device=CPU, exact=True)
        diffs[name] = r["loss_mean_abs_diff"]
        assert r["peers"]["hf-nofla"]["tokens_per_s"] > 0
        # the floor: the two transformers paths against each other on the same batches (both leak alike)
        floor = r["loss_mean_abs_diff_between_peers"]
        assert set(floor) == {"hf vs hf-nofla"} and floor["hf vs hf-nofla"]["micro_batch"] == 2
        assert floor["hf vs hf-nofla"]["diff"] < 1e-4
    assert diffs["qwen3.5-9b-lora-1doc"] < 1e-4
    assert diffs["qwen3.5-9b-lora"] > 1e-3


def test_a_liger_peer_does_not_leak_into_later_peers(monkeypatch):
    """Liger patches transformers' classes process-wide with no undo; the bench's peer context re-imports the
    modeling module afterwards, so a later "hf" peer runs transformers' own kernels (a stand-in Liger here)."""
    import sys
    import types

    import transformers.models.qwen3.modeling_qwen3 as modeling

    from atelier_studio.bench.designer import _hf_model, peer_context

    class FakeLigerNorm(modeling.Qwen3RMSNorm):
        pass

    def fused_forward(self, *args, **kwargs):  # stands in for Liger's fused linear-cross-entropy forward
        raise AssertionError("a patched forward ran")

    def apply_liger_kernel_to_qwen3():  # what Liger does: swap the module's classes, replace a class's method
        modeling.Qwen3RMSNorm = FakeLigerNorm
        modeling.Qwen3ForCausalLM.forward = fused_forward

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_qwen3 = apply_liger_kernel_to_qwen3
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    args = ModelArgs.from_size("tiny", vocab_size=64)
    _hf_model(args)  # transformers' package caches the class it hands out: the undo must reach that cache
    with peer_context("hf-liger", args):
        patched = _hf_model(args)
        assert type(patched.model.norm).__name__ == "FakeLigerNorm" and type(patched).forward is fused_forward
    with peer_context("hf", args):
        plain = _hf_model(args)
        assert type(plain.model.norm).__name__ == "Qwen3RMSNorm"
        assert type(plain).forward is not fused_forward


def test_recount_adds_the_head_on_every_token_mfu_the_bench_now_writes(tiny_report):
    """bench/recount.py on a report stripped of the field gives back what the bench computed, reading the run's
    settings from the report (or, for older reports, from its command, the last of a repeated flag winning),
    and refuses batches or step counts that do not reproduce the report's own MFU."""
    import copy

    from atelier_studio.bench.recount import recount, replace_table

    def stripped() -> dict:
        r = copy.deepcopy(tiny_report)
        runs = [r["atelier"], *r["sweep"].values(), *r["peers"].values(),
                *(x for p in r["peer_runs"].values() for x in p.values() if isinstance(x, dict))]
        for x in runs:
            x.pop("mfu_4n_head_all", None)
        return r

    assert tiny_report["run"] == {"warmup": 1, "steps": 2, "seed": 0, "tokenizer": None}
    got = recount(stripped())
    assert got["atelier"]["mfu_4n_head_all"] == pytest.approx(tiny_report["atelier"]["mfu_4n_head_all"], rel=1e-12)
    assert got["peers"]["hf"]["mfu_4n_head_all"] == pytest.approx(tiny_report["peers"]["hf"]["mfu_4n_head_all"],
                                                                  rel=1e-12)
    old = stripped()
    del old["run"]
    old["command"] = "bench/designer.py --config qwen3-8b-lora --tiny --steps 5 --warmup 1 --steps 2"
    assert recount(old)["atelier"]["mfu_4n_head_all"] == pytest.approx(got["atelier"]["mfu_4n_head_all"], rel=1e-12)
    with pytest.raises(ValueError, match="do not give the report's mfu_4n"):
        recount(stripped(), warmup=0, steps=3)  # other steps timed: other FLOPs per step
    with pytest.raises(ValueError, match="step times"):
        recount(stripped(), warmup=1, steps=3)
    table = "| run | a |\n|---|---|\n| x | 1 |\n"
    assert replace_table("# t\n\n" + table + "\nNote: kept\n", "| run | b |\n|---|---|\n") == \
        "# t\n\n| run | b |\n|---|---|\n\nNote: kept\n"


def test_peer_floor_pairs_peers_at_the_largest_micro_batch_both_ran():
    def run(losses, oom=False):
        return {"oom": oom, "timed_losses": losses}
    runs = {"b": {"2": run([1.0, 2.0]), "4": run([1.0, 1.0])},
            "a": {"2": run([1.5, 2.5]), "4": run([0.0, 0.0], oom=True)},
            "c": {"skipped": "import failed"}, "d": {"8": run([3.0, 3.0])}}
    assert peer_floor(runs) == {"a vs b": {"micro_batch": 2, "diff": 0.5}}
    assert peer_floor({"a": runs["a"]}) == {}


def test_tiny_qlora_rows_against_the_bf16_base_twin(tmp_path):
    """The QLoRA config: at each micro-batch the NF4 run and its bf16-base twin on the same batches and adapters
    (their losses differ by the NF4 error of the base: above zero, far below the loss), the 4-bit peer skipped
    on the CPU with the reason, and the summary's targets left open where nothing was measured."""
    cfg = dataclasses.replace(tiny_config(CONFIGS["qwen3-8b-qlora"]), micro_batches=(1, 2))
    assert cfg.base == "nf4" and cfg.ac == "full"
    r = bench("qwen3-8b-qlora", cfg, tmp_path, ["hf-bnb"], [1, 2], steps=2, warmup=1, ablation=False,
              tokenizer=None, device=CPU, exact=True)
    assert "CUDA only" in r["peers"]["hf-bnb"]["skipped"]
    q = r["qlora"]
    assert set(q["by_micro_batch"]) == {"1", "2"} == set(r["bf16_base"])
    for row in q["by_micro_batch"].values():
        assert row["tokens_per_s"] > 0 and row["bf16_base_tokens_per_s"] > 0 and row["vs_bf16_base"] > 0
        assert 0 < row["loss_mean_abs_diff_vs_bf16_base"] < 0.05
        assert row["peer_tokens_per_s"] is None and row["vs_peer"] is None
    assert q["met"]["vs_peer"] is None and q["met"]["peak_gb_at_mb1"] is None  # no peer, no CUDA peak here
    assert "QLoRA (NF4 bases)" in markdown(r)
