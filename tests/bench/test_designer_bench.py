"""bench/designer.py end to end at tiny size on the CPU (fp32): every JSON field, and loss parity with
transformers+PEFT."""

from __future__ import annotations

import copy
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
    build_atelier,
    build_peer,
    default_peers,
    lora_init,
    main,
    make_batches,
    markdown,
    pack_rows,
    peer_floor,
    random_state_dict,
    summarize,
    tiny_config,
    to_device,
)
from atelier_studio.bench.designer_peers import (
    PAD_MULTIPLE,
    PeerUnavailable,
    one_document_batches,
    parse_peer,
    peer_context,
    row_documents,
)
from atelier_studio.data.packing import fixed_shape, make_batch
from atelier_studio.designer.lora import LoraArgs
from atelier_studio.designer.qwen3 import Qwen3Args

from tests.bench._budget import SpentAfter

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["--config", "qwen3-8b-lora", "--tiny", "--out", str(out), "--peers", "hf,hf-liger,hf-1doc@2",
                 "--steps", "2", "--warmup", "1", "--ablation", "--fp8", "rowwise"]) == 0
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
    # every MFU beside the dense bf16 one: the dense FP8 peak is 1,979 (the measured matmul rates need a GPU)
    for row in (a, r["peers"]["hf"], r["fp8"]["rowwise"]):
        assert row["mfu_fp8_peak"] == pytest.approx(row["mfu_4n"] * 989 / 1979, rel=1e-12)
        assert row["mfu_matmul"] is None and row["mfu_matmul_fp8"] is None
    # the strongest peer is the fastest that ran, and every ratio is stated against the peers' rates
    ran = {p: x["tokens_per_s"] for p, x in r["peers"].items() if x.get("tokens_per_s")}
    assert set(ran) == {"hf", "hf-1doc"} and r["strongest_peer"] == max(ran, key=ran.get)
    assert r["speedup_vs_strongest_peer"] == pytest.approx(a["tokens_per_s"] / max(ran.values()), rel=1e-12)
    assert r["peers"]["hf-1doc"]["rows"] == "one document per row" and r["peer_runs"]["hf-1doc"]["2"]["batches"] > 0
    assert set(r["peer_runs"]["hf-1doc"]) == {"2"} and set(r["peer_runs"]["hf"]) == {"1", "2"}  # NAME@2: mb 2 only
    # the FP8 row ran on the bf16 run's batches; bf16 here is fp32 (exact), so any loss difference is the FP8
    # quantisation: nonzero, and far below one E4M3 rounding step of the loss (2^-4 relative: the operands' rounding
    # errors are independent and average out in every dot product)
    f = r["fp8"]["rowwise"]
    assert f["micro_batch"] == a["micro_batch"] and f["tokens_per_s"] > 0
    assert 0 < f["loss_mean_abs_diff_vs_bf16"] < 2**-4 * r["sweep"][str(a["micro_batch"])]["timed_losses"][0]
    assert "| atelier fp8 rowwise |" in markdown(r) and "| FP8 ablation |" in markdown(r)


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


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-lora", "qwen3-30b-a3b-lora-1doc"])
def test_tiny_moe_parity_active_flops_and_expert_spread(name, tmp_path):
    """The MoE configs at tiny size: loss parity with transformers + PEFT (adapters on attention and every expert,
    handed to PEFT in its per-expert layout), and with the same peer under gradient checkpointing (-gc: what fits
    on the GPU), FLOPs from the active parameters, the tokens-per-expert spread."""
    from atelier_studio.bench.designer import step_flops
    from atelier_studio.designer.hf import args_from_size

    cfg = dataclasses.replace(tiny_config(CONFIGS[name]), micro_batches=(2,))
    peers = ["hf", "hf-gc"]
    r = bench(name, cfg, tmp_path, peers, [2], steps=3, warmup=1, ablation=False, tokenizer=None, device=CPU,
              exact=True)
    assert r["loss_mean_abs_diff"] < 1e-4  # fp32 both sides (1e-5 measured), as the dense configs
    losses = {p: r["peer_runs"][p]["2"]["losses"] for p in peers}
    assert losses["hf"] == losses["hf-gc"]  # the recompute is the same arithmetic on the CPU: equal losses
    assert r["peer_config"]["hf-gc"]["gradient_checkpointing"] and not r["peer_config"]["hf"]["gradient_checkpointing"]
    e = r["expert_tokens"]
    assert ((e["layers"], e["experts"]) == (2, 8)
            and e["max_over_mean_worst_layer"] >= e["max_over_mean_median_layer"] >= 1)
    first = make_batches(cfg, 2, 4, None, 2)[0]  # bench()'s batches at micro-batch 2 (seed + 2, warmup + steps)
    assert e["tokens_per_expert_mean"] * e["experts"] == pytest.approx(2 * first.num_tokens)  # k = 2 per real token
    args = args_from_size(cfg.size, vocab_size=cfg.vocab_size)
    batch = make_batches(cfg, 2, 1, None, 0)[0]
    useful, six, _ = step_flops(cfg, args, [batch])
    all_experts = dataclasses.replace(args, top_k=args.num_experts)  # every expert on every token: 4x the experts
    assert step_flops(cfg, all_experts, [batch])[0][0] > useful[0] and six[0] > useful[0]


def _setup(seed: int = 0):
    cfg = tiny_config(CONFIGS["qwen3-8b-lora"])
    args = Qwen3Args.from_size(cfg.size, vocab_size=cfg.vocab_size)
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


def test_a_gc_peer_recomputes_every_decoder_layer_in_its_backward():
    """-gc turns on transformers' activation checkpointing: one training step enters a decoder layer's MLP twice (the
    forward, then the recompute in the backward; counted on a module inside the layer, since transformers
    checkpoints the layer's own forward past its hooks) where the plain peer enters it once, with the same loss and
    adapter gradients."""
    cfg, args, sd, lsd, batch = _setup()
    calls, grads, losses = {}, {}, {}
    for name in ("hf", "hf-gc"):
        with peer_context(parse_peer(name), args):
            peer = build_peer(name, cfg, args, sd, lsd, exact=True)
            layers = [m for n, m in peer.model.named_modules() if n.endswith("layers.0.mlp")]
            calls[name] = 0

            def count(*_, name=name):
                calls[name] += 1

            layers[0].register_forward_pre_hook(count)  # a pre-hook: the recompute stops once it has what it needs
            loss = peer.loss(to_device(batch, CPU))
            loss.backward()
            losses[name] = loss.detach()
            grads[name] = [p.grad.clone() for p in peer.params]
    assert (calls["hf"], calls["hf-gc"]) == (1, 2)
    assert torch.equal(losses["hf"], losses["hf-gc"])
    assert all(torch.equal(a, b) for a, b in zip(grads["hf"], grads["hf-gc"]))  # the same arithmetic, recomputed


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

    from atelier_studio.bench.designer_peers import hf_model, parse_peer, peer_context

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
    args = Qwen3Args.from_size("tiny", vocab_size=64)
    hf_model(args)  # transformers' package caches the class it hands out: the undo must reach that cache
    with peer_context(parse_peer("hf-liger"), args):
        patched = hf_model(args)
        assert type(patched.model.norm).__name__ == "FakeLigerNorm" and type(patched).forward is fused_forward
    with peer_context(parse_peer("hf"), args):
        plain = hf_model(args)
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

    assert tiny_report["run"] == {"warmup": 1, "steps": 2, "seed": 0, "tokenizer": None, "budget_s": None}
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
        return {"oom": oom, "timed_losses": losses, **({} if oom else {"tokens_per_s": 1.0})}
    runs = {"hf-nofla": {"2": run([1.0, 2.0]), "4": run([1.0, 1.0])},
            "hf-amp": {"2": run([1.5, 2.5]), "4": run([0.0, 0.0], oom=True)},
            "hf-liger": {"skipped": "import failed"}, "hf": {"8": run([3.0, 3.0])},
            "hf-1doc": {"2": run([7.0, 7.0])}}  # one document per row: other batches, never paired with packed ones
    assert peer_floor(runs) == {"hf-amp vs hf-nofla": {"micro_batch": 2, "diff": 0.5}}
    assert peer_floor({"hf-amp": runs["hf-amp"]}) == {}


def test_one_document_rows_hold_the_same_documents_right_padded():
    """The -1doc peer's rows: every document segment of Atelier's packed rows exactly once (tokens and shifted
    labels), one per row, padded on the right to a multiple of 8 with labels -100, within the token budget."""
    cfg = tiny_config(CONFIGS["qwen3-8b-lora"])
    packed = pack_rows(cfg, 6, None, seed=3)
    budget = 2 * cfg.seq_len
    batches = one_document_batches(packed, range(6), budget, seed=3)
    want = sorted((tuple(i.tolist()), tuple(l.tolist())) for i, l in row_documents(packed, range(6)))
    assert len(want) > 6  # the rows were really packed with several documents each
    got = []
    for b in batches:
        rows, width = b.input_ids.shape
        assert width % PAD_MULTIPLE == 0 and rows * width <= budget and b.max_seqlen == width
        for i, n in enumerate(b.doc_lens):
            assert width - PAD_MULTIPLE < max(b.doc_lens) <= width  # padded to the longest, no further
            got.append((tuple(b.input_ids[i, :n].tolist()), tuple(b.labels[i, :n].tolist())))
            assert (b.labels[i, n:] == -100).all() and (b.input_ids[i, n:] == packed.pad_id).all()
        assert b.num_tokens == sum(b.doc_lens) and b.num_loss_tokens == int((b.labels != -100).sum())
    assert sorted(got) == want
    assert sum(b.num_tokens for b in batches) == sum(map(sum, packed.doc_lens[:6]))


def test_one_document_rows_train_exactly_like_the_packed_rows_and_left_padding_would_not():
    """transformers+PEFT on one-document rows with no mask and no position ids (the -1doc peer) computes the same
    summed loss over the documents as Atelier on the packed rows: right padding is invisible to a causal row. The
    same rows padded on the LEFT (what a careless peer does without a mask) attend to the padding and move it."""
    cfg, args, sd, lsd, _ = _setup()
    packed = pack_rows(cfg, 4, None, seed=5)
    atelier = build_atelier(cfg, args, sd, lsd, Variant(compile=False), exact=True)
    peer = build_peer("hf-1doc", cfg, args, sd, lsd, exact=True)
    with torch.no_grad():
        want = sum(atelier.loss(to_device(b, CPU)) * b.num_loss_tokens for b in
                   (make_batch(packed, [0, 1]), make_batch(packed, [2, 3])))
        rows = one_document_batches(packed, range(4), 2 * cfg.seq_len, seed=5)
        got = sum(peer.loss(to_device(b, CPU)) * b.num_loss_tokens for b in rows)
        # fp32 sums of the same terms in another order: a few eps of the total per reduction level
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        left = [dataclasses.replace(b, input_ids=_left(b.input_ids, b.doc_lens, 0), labels=_left(b.labels, b.doc_lens,
                                                                                             -100)) for b in rows]
        leaked = sum(peer.loss(to_device(b, CPU)) * b.num_loss_tokens for b in left)
    # random-init attention is nearly uniform, so padding in front moves the loss little, but ten times past the
    # bound the right-padded rows meet
    assert (leaked - want).abs() > 10 * 1e-5 * want.abs()


def _left(x: torch.Tensor, lens: list[int], fill: int) -> torch.Tensor:
    """Each row's document moved to the end of the row, the padding (`fill`) before it."""
    out = torch.full_like(x, fill)
    for i, n in enumerate(lens):
        out[i, x.shape[1] - n:] = x[i, :n]
    return out


def test_peer_names_parse_and_bad_ones_are_named(capsys):
    spec = parse_peer("hf-liger-bf16lora-compiled-1doc")
    assert (spec.base, spec.compiled, spec.one_doc, spec.liger) == ("hf-liger-bf16lora", True, True, True)
    assert (parse_peer("hf-1doc").compiled, parse_peer("hf-compiled").one_doc) == (False, False)
    spec = parse_peer("hf-amp-gc-compiled-1doc")
    assert (spec.base, spec.checkpointing, spec.compiled, spec.one_doc) == ("hf-amp", True, True, True)
    assert not parse_peer("hf-amp-compiled").checkpointing
    for bad in ("hf-1doc-compiled", "unsloth-1doc", "hf-", "hf-compiled-gc"):
        with pytest.raises(ValueError, match="then optionally -compiled"):
            parse_peer(bad)
    with pytest.raises(SystemExit):
        main(["--config", "qwen3-8b-lora", "--tiny", "--peers", "hf,hf-1doc-compiled"])
    assert "--peers: unknown ['hf-1doc-compiled']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", "qwen3-8b-lora", "--tiny", "--peers", "hf@two"])
    assert "--peers: unknown ['hf@two']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", "qwen3-8b-lora", "--tiny", "--fp8", "blockwise"])
    assert "--fp8: unknown ['blockwise']" in capsys.readouterr().err


def test_a_spent_budget_skips_the_rest_and_every_run_is_reported(tmp_path):
    """Atelier's one bf16 run fits the budget; the FP8 row and the peer's run are recorded as skipped, and the
    report was handed out after every run (a run killed from outside still leaves what finished)."""
    cfg = dataclasses.replace(tiny_config(CONFIGS["qwen3-1.7b-full"]), micro_batches=(2,))
    seen = []
    r = bench("qwen3-1.7b-full", cfg, tmp_path, ["hf"], [2], steps=1, warmup=1, ablation=False, tokenizer=None,
              device=CPU, exact=True, fp8=("rowwise",), budget=SpentAfter(1), on_result=lambda rep: seen.append(
                  (rep["atelier"].get("tokens_per_s"), dict(rep["fp8"]), dict(rep["peers"]))))
    assert r["atelier"]["tokens_per_s"] > 0
    assert r["fp8"]["rowwise"]["skipped"].startswith("time budget")
    assert r["peers"]["hf"]["skipped"].startswith("time budget")
    assert len(seen) >= 3 and seen[0][0] == r["atelier"]["tokens_per_s"]  # the first report already held it
    assert "time budget" in markdown(r)


def test_summarize_states_ratios_against_the_strongest_peer_and_parity_against_packed_peers():
    """Synthetic runs: the strongest peer is the fastest configuration that ran (a one-document peer here), every
    ratio is against the peers' best micro-batch, FP8 rows compare with bf16 on the same batches, and loss parity
    skips the one-document peer (other batches)."""
    def run(tps, losses, **kw):
        return {"oom": False, "tokens_per_s": tps, "tokens_per_s_min": tps, "tokens_per_s_max": tps, "tflops": tps,
                "mfu_4n": tps / 989, "mfu_6n": 0.0, "mfu_4n_head_all": 0.0, "peak_gb": 1.0, "timed_losses": losses,
                **kw}
    bf16 = {"compile": True, "precision": "bf16", "lora_dtype": "bfloat16"}
    report = {"matmul_tflops": 800.0, "matmul_tflops_fp8_best": 1600.0,
              "config": {"lora": True, "lora_dtype": "bfloat16"},
              "atelier_runs": {"4": {"True": run(100.0, [2.0, 2.0], variant=bf16)},
                               "8": {"True": run(120.0, [3.0, 3.0], variant=bf16)}},
              "fp8_runs": {"rowwise": {"8": {"True": run(180.0, [3.1, 2.9], variant={**bf16, "precision": "fp8"})}}},
              "peer_runs": {"hf-liger-bf16lora": {"4": run(60.0, [2.5, 2.0]), "8": {"oom": True}},
                            "hf-liger-bf16lora-1doc": {"4": run(80.0, [9.0, 9.0]), "8": run(90.0, [9.0, 9.0])}},
              "peer_config": {}, "ablation_runs": {}}
    r = summarize(report)
    assert r["atelier"]["micro_batch"] == 8 and r["strongest_peer"] == "hf-liger-bf16lora-1doc"
    assert r["speedup_vs_strongest_peer"] == pytest.approx(120 / 90)
    assert r["speedup"]["hf-liger-bf16lora"] == pytest.approx(120 / 60)
    assert r["atelier"]["mfu_matmul"] == pytest.approx(120 / 800) and r["atelier"]["mfu_matmul_fp8"] == pytest.approx(
        120 / 1600)
    f = r["fp8"]["rowwise"]
    assert f["speedup_vs_bf16_same_batches"] == pytest.approx(1.5)
    assert f["speedup_vs_strongest_peer"] == pytest.approx(2)
    assert f["loss_mean_abs_diff_vs_bf16"] == pytest.approx(0.1)
    assert r["loss_parity_peer"] == "hf-liger-bf16lora" and r["loss_mean_abs_diff"] == pytest.approx(0.25)
    assert set(r["loss_mean_abs_diff_by_peer"]) == {"hf-liger-bf16lora"}
    before = copy.deepcopy(r)
    assert summarize(r) == before  # idempotent: the bench calls it after every run


def test_tiny_qlora_rows_against_the_bf16_base_twin(tmp_path):
    """The QLoRA config through the command line, with no --peers (its default: the 4-bit peer): at each
    micro-batch the NF4 run and its bf16-base twin on the same batches and adapters (their losses differ by the NF4
    error of the base: above zero, far below the loss), the 4-bit peer skipped on the CPU with the reason, and the
    summary's targets left open where nothing was measured."""
    assert main(["--config", "qwen3-8b-qlora", "--tiny", "--out", str(tmp_path), "--micro-batches", "1,2",
                 "--steps", "2", "--warmup", "1"]) == 0
    (path,) = tmp_path.glob("designer-qwen3-8b-qlora-*.json")
    r = json.loads(path.read_text())
    assert (r["config"]["base"], r["config"]["ac"]) == ("nf4", "full")
    assert list(r["peer_runs"]) == ["hf-bnb"] and "CUDA only" in r["peers"]["hf-bnb"]["skipped"]
    assert {x["variant"]["base"] for x in r["sweep"].values()} == {"nf4"}
    assert {x["variant"]["base"] for x in r["bf16_base_runs"].values()} == {"bf16"}
    q = r["qlora"]
    assert q["peer"] == "hf-bnb" and "CUDA only" in q["peer_skipped"]
    assert set(q["by_micro_batch"]) == {"1", "2"} == set(r["bf16_base_runs"])
    for row in q["by_micro_batch"].values():
        assert row["tokens_per_s"] > 0 and row["bf16_base_tokens_per_s"] > 0 and row["vs_bf16_base"] > 0
        assert 0 < row["loss_mean_abs_diff_vs_bf16_base"] < 0.05
        assert row["peer_tokens_per_s"] is None and row["vs_peer"] is None
    assert q["met"]["vs_peer"] is None and q["met"]["peak_gb_at_mb1"] is None  # no peer, no CUDA peak here
    md = path.with_suffix(".md").read_text()
    assert "| atelier qlora (nf4 base) |" in md and "QLoRA (NF4 bases)" in md and "hf-bnb: skipped (" in md


def test_tiny_moe_qlora_rows_against_the_bf16_base_twin(tmp_path, monkeypatch):
    """The MoE QLoRA config through the command line at tiny size, without peers: every sparse layer's expert stacks
    are quantised by the runs of the sweep (not by the twin's), each micro-batch has its QLoRA row and its bf16-base
    twin (their losses differ by the NF4 error of attention and experts: above zero, far below the loss), with the
    expert spread, and no targets stated (the issue's are for Qwen3-8B)."""
    from atelier_studio.designer import qwen3_moe

    quantised = []
    real = qwen3_moe.Experts.quantize_nf4
    monkeypatch.setattr(qwen3_moe.Experts, "quantize_nf4", lambda self, device=None: quantised.append(1)
                        or real(self, device))
    assert main(["--config", "qwen3-30b-a3b-qlora", "--tiny", "--out", str(tmp_path), "--micro-batches", "1",
                 "--steps", "2", "--warmup", "1", "--peers", ""]) == 0
    (path,) = tmp_path.glob("designer-qwen3-30b-a3b-qlora-*.json")
    r = json.loads(path.read_text())
    assert (r["config"]["size"], r["config"]["base"], r["config"]["ac"]) == ("qwen3-moe-tiny", "nf4", "none")
    assert len(quantised) == 2 * 2  # the sweep's run and the expert-spread run, two sparse layers each
    row = r["qlora"]["by_micro_batch"]["1"]
    assert row["tokens_per_s"] > 0 and row["bf16_base_tokens_per_s"] > 0
    assert 0 < row["loss_mean_abs_diff_vs_bf16_base"] < 0.05
    assert r["qlora"]["targets"] is None and set(r["qlora"]["met"].values()) == {None}
    assert r["expert_tokens"]["experts"] == 8
    md = path.with_suffix(".md").read_text()
    assert "| atelier qlora (nf4 base) |" in md and "QLoRA (NF4 bases)" in md and "targets (met" not in md


def test_qlora_summary_against_the_twin_and_the_fastest_4bit_peer():
    """Synthetic runs: per micro-batch, QLoRA against its bf16-base twin and the fastest 4-bit peer configuration
    at the same micro-batch; a twin out of memory leaves that row's ratio and loss difference open, and each target
    is judged on what was measured."""
    def run(tps, losses, peak, **kw):
        return {"oom": False, "tokens_per_s": tps, "tokens_per_s_min": tps, "tokens_per_s_max": tps, "tflops": tps,
                "mfu_4n": tps / 989, "mfu_6n": 0.0, "mfu_4n_head_all": 0.0, "peak_gb": peak, "timed_losses": losses,
                **kw}
    nf4 = {"compile": False, "precision": "bf16", "lora_dtype": "mixed", "base": "nf4"}
    report = {"gpu": {"name": "test"}, "matmul_tflops": None, "matmul_tflops_fp8_best": None,
              "config": {"name": "qwen3-8b-qlora", "lora": True, "lora_dtype": "mixed", "base": "nf4"},
              "atelier_runs": {"1": {"False": run(80.0, [2.0, 2.0], 12.0, variant=nf4)},
                               "2": {"False": run(150.0, [2.1, 2.1], 15.0, variant=nf4)}},
              "bf16_base_runs": {"1": run(100.0, [2.01, 1.99], 30.0), "2": {"oom": True}},
              "fp8_runs": {}, "peer_config": {}, "ablation_runs": {},
              "peer_runs": {"hf-bnb": {"1": run(30.0, [2.0, 2.2], 9.0), "2": run(50.0, [2.1, 2.3], 11.0)},
                            "hf-bnb-1doc": {"1": run(40.0, [5.0, 5.0], 9.0), "2": run(70.0, [5.0, 5.0], 10.0)}}}
    q = summarize(report)["qlora"]
    assert q["peer"] == "hf-bnb-1doc"  # the fastest 4-bit configuration that ran
    one, two = q["by_micro_batch"]["1"], q["by_micro_batch"]["2"]
    assert one["vs_bf16_base"] == pytest.approx(0.8) and one["vs_peer"] == pytest.approx(2.0)
    assert one["loss_mean_abs_diff_vs_bf16_base"] == pytest.approx(0.01)
    assert (one["peak_gb"], one["bf16_base_peak_gb"], one["peer_peak_gb"]) == (12.0, 30.0, 9.0)
    assert two["vs_bf16_base"] is None and two["loss_mean_abs_diff_vs_bf16_base"] is None
    assert two["vs_peer"] == pytest.approx(150 / 70)
    assert q["met"] == {"peak_gb_at_mb1": True, "vs_bf16_base": True, "vs_peer": True}
    # loss parity: the packed 4-bit peer (the same batches), at the largest micro-batch both ran
    assert report["loss_parity_peer"] == "hf-bnb" and report["loss_mean_abs_diff"] == pytest.approx(0.1)
    md = markdown(report)
    assert "| atelier qlora (nf4 base) |" in md and "| 2 | 150 | 15.0 | OOM | — | — | 70 | 10.0 | 2.14 | — |" in md
    report["atelier_runs"]["1"]["False"]["peak_gb"] = 17.0
    report["bf16_base_runs"]["2"] = run(200.0, [2.1, 2.1], 40.0)
    assert summarize(report)["qlora"]["met"] == {"peak_gb_at_mb1": False, "vs_bf16_base": False, "vs_peer": True}


def test_the_4bit_peer_parses_is_the_qlora_default_and_says_why_it_cannot_run(capsys):
    """hf-bnb takes the modifiers like every base, is the QLoRA config's default peer and no other's, is refused
    with its reason on the CPU and in full fine-tuning (nothing of it is built), and the QLoRA config refuses FP8
    as the trainer's config does."""
    spec = parse_peer("hf-bnb-1doc")
    assert (spec.base, spec.one_doc, spec.four_bit, spec.autocast) == ("hf-bnb", True, True, True)
    assert parse_peer("hf-bnb").four_bit and not parse_peer("hf-amp").four_bit
    assert default_peers(CONFIGS["qwen3-8b-qlora"]) == ("hf-bnb",)
    assert default_peers(CONFIGS["qwen3-8b-lora"]) == ("hf", "hf-amp", "hf-liger", "hf-liger-bf16lora", "hf-nofla")
    cfg, args, sd, lsd, _ = _setup()
    with pytest.raises(PeerUnavailable, match="CUDA only"):
        build_peer("hf-bnb", cfg, args, sd, lsd, exact=True)
    full = tiny_config(CONFIGS["qwen3-1.7b-full"])
    with pytest.raises(PeerUnavailable, match="adapters only"):
        build_peer("hf-bnb", full, args, sd, {}, exact=True)
    with pytest.raises(SystemExit):
        main(["--config", "qwen3-8b-qlora", "--tiny", "--fp8", "rowwise"])
    assert "stored in NF4 or computed in FP8" in capsys.readouterr().err
