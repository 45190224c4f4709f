"""QLoRA on Qwen3-MoE (`lora.base_dtype = "nf4"`) on the CPU: every sparse layer's expert stacks are stored in NF4
(the router, norms, embeddings and LM head as the dense QLoRA path leaves them); a run through the CLI trains and
exports the adapter a bf16-base run exports; the exported adapter rebuilds the model the trainer evaluated, and
merged onto the unquantised base gives the trainer's logits up to the NF4 error (bound below); packed rows equal
documents one by one; the Triton path equals the reference inside the model; two gloo processes (FSDP2 sharding
the NF4 expert bytes by expert) train as one.

The merged-logits bound is tests/designer/test_qlora.py's, with the expert stacks among the NF4 layers: the trainer
computes with Ŵ = dequantise(NF4(W)), the released base holds W, the adapter is the same on both, so
  (a) over a base holding Ŵ, the merged model gives the trainer's logits up to two fp32 implementations' rounding;
  (b) over W, a logit z moves by Σ_l ⟨∂z/∂W_l, ε_l⟩ to first order in ε = W − Ŵ (|ε| within
      kernels.nf4.nf4_error_bound, checked element by element), and
        |z(W) − z(Ŵ)| ≤ Σ_l |⟨∂z/∂W_l, ε_l⟩|  (+ second order),
      each matrix's own cancellations kept (an expert's matrix is one term: it is one per-expert linear on disk),
      the terms added by absolute value; ε is a few percent of W, so the second-order remainder is that fraction of
      the first-order terms, which the triangle inequality's slack covers. ∂z/∂W_l is taken by autograd on the model
      over Ŵ with its base weights as leaves, for every logit at one position.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atelier_studio.designer.hf import load_pretrained, save_pretrained
from atelier_studio.designer.lora import GroupedLoRA, LoraArgs, LoRALinear, apply_lora, load_peft_adapter, merge_lora
from atelier_studio.flows.cli import main
from atelier_studio.kernels.nf4 import nf4_error_bound
from atelier_studio.pipeline.lora_nf4 import NF4LoRALinear, quantize_lora_bases
from atelier_studio.pipeline.nf4 import NF4ExpertStack

from tests.designer.test_fp8_train import _tensors
from tests.designer.test_model import load_hf, packed_inputs, rel_err, run_rows
from tests.designer.test_qlora import _qlora_model, rebuilt_and_logged_eval_loss
from tests.designer.test_train import train_args, train_losses
from tests.kernels._compare import assert_no_leak

STEPS = 8
PARITY = 1e-5  # two fp32 implementations of the same network: test_qlora.py's bound (~80 ulps of the largest logit)
STACKS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def moe_runs(world, tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen3-MoE (two sparse layers around a dense one), an 8-step QLoRA run on it (adapters on attention
    and every expert) and the one-step bf16-base twin."""
    d = tmp_path_factory.mktemp("qlora-moe")
    assert main(["designer", "init", "--size", "qwen3-moe-tiny", "--tokenizer", str(world / "tok"), "--out",
                 str(d / "model"), "--dtype", "float32"]) == 0
    common = ("--set", f"model.path={d / 'model'}", "--set", "lora.rank=4", "--set", "train.lr=3e-3",
              "--set", "train.warmup_steps=1", "--set", f"train.save_every={STEPS}")
    assert main(train_args(world, d / "nf4", *common, "--set", f"train.max_steps={STEPS}",
                           "--set", "lora.base_dtype=nf4")) == 0
    assert main(train_args(world, d / "bf16", *common, "--set", "train.max_steps=1")) == 0
    return {"nf4": d / "nf4", "bf16": d / "bf16", "model": d / "model"}


def _experts(model) -> list:
    return [b.mlp.experts for b in model.model.layers if b.sparse]


def test_every_sparse_layers_experts_are_stored_in_nf4(moe_runs):
    """With adapters on q only, the experts still go to NF4 (they are frozen either way); the router, the dense
    layer's MLP, norms, embeddings and head stay as they were; the NF4 bytes are 0.52 per expert weight."""
    m = apply_lora(load_pretrained(moe_runs["model"]), LoraArgs(rank=2, targets=("q",)))
    before = {k: v.clone() for k, v in m.state_dict().items() if "experts" not in k and "q_proj" not in k}
    done, kept = quantize_lora_bases(m)
    assert not kept
    sparse = [i for i, s in enumerate(m.args.sparse_layers) if s]
    assert done == [n for i in range(m.args.num_layers) for n in
                    ([f"model.layers.{i}.self_attn.q_proj"] + ([f"model.layers.{i}.mlp.experts.{s}" for s in STACKS]
                                                               if i in sparse else []))]
    a = m.args
    for experts in _experts(m):
        assert experts.quantized and all(isinstance(getattr(experts, s), NF4ExpertStack) for s in STACKS)
        assert experts.gate_up_proj.shape == (a.num_experts, 2 * a.moe_ffn_dim, a.dim)
        assert experts.down_proj.shape == (a.num_experts, a.dim, a.moe_ffn_dim)
        for s in STACKS:
            stack = getattr(experts, s)
            nbytes = stack.quantized_data.numel() + stack.quantized_scalers.numel()
            assert nbytes == stack.numel // 2 + stack.numel // 64  # 4 bits + one int8 scale per 64 weights
            assert stack.quantized_data.shape[0] == a.num_experts  # rows are experts: what FSDP2 shards
    sd = m.state_dict()
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in sd)
    assert f"model.layers.{sparse[0]}.mlp.experts.down_proj.quantized_data" in sd
    for k, v in before.items():
        assert torch.equal(sd[k], v), k  # router, dense MLP, norms, embeddings, head: untouched
    assert not any(p.requires_grad for n, p in m.named_parameters() if "lora_" not in n)
    with pytest.raises(TypeError, match="stored in NF4"):
        _experts(m)[0].grouped_lora_weight("down_proj")  # merge_lora's way in: a merge goes onto the bf16 base


def test_qlora_moe_trains_and_exports_what_a_bf16_base_run_exports(moe_runs):
    losses = [l for _, l in train_losses(moe_runs["nf4"])]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses  # the adapters learn over the NF4 experts
    assert train_losses(moe_runs["bf16"])[0][1] != losses[0]  # the first loss differs: the base was quantised
    mine = _tensors(moe_runs["nf4"] / "adapter" / "adapter_model.safetensors")
    twin = _tensors(moe_runs["bf16"] / "adapter" / "adapter_model.safetensors")
    assert mine == twin  # the same keys, dtypes and shapes: only the adapters, in PEFT's layout
    assert any(".mlp.experts.7.down_proj.lora_B" in k for k in mine)  # per-expert keys: PEFT's layout
    assert json.loads((moe_runs["nf4"] / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((moe_runs["bf16"] / "adapter" / "adapter_config.json").read_text())


def test_the_rebuilt_model_is_the_one_the_trainer_evaluated(moe_runs):
    """The run's final eval loss, recomputed by a task over the exported adapter on a freshly quantised base: the
    same kernels on the same tensors in the same order, so equal exactly."""
    got, want = rebuilt_and_logged_eval_loss(moe_runs["nf4"])
    assert got == want


def _dequantised_base(q, model_dir: Path, out: Path) -> Path:
    """The base the trainer computed with (Ŵ in every NF4 linear and expert stack) as a plain fp32 HF directory."""
    deq = load_pretrained(model_dir)
    with torch.no_grad():
        for n, m in q.named_modules():
            if isinstance(m, NF4LoRALinear):
                deq.get_submodule(n).weight.copy_(m.base_layer.dequantized_weight())
            elif isinstance(m, NF4ExpertStack):
                host, leaf = n.rsplit(".", 1)
                getattr(deq.get_submodule(host), leaf).copy_(m.experts().dequantize())
    return save_pretrained(deq, out, dtype=torch.float32)


@pytest.mark.slow  # ~60 s on 2 cores: one backward pass per logit of the vocabulary for the bound
def test_merged_adapter_on_the_unquantised_base_is_the_trainers_model_up_to_the_nf4_error(moe_runs, tmp_path):
    from peft import PeftModel

    model_dir, adapter = moe_runs["model"], moe_runs["nf4"] / "adapter"
    q = _qlora_model(model_dir, adapter)  # quantises the expert stacks too
    ids = torch.randint(0, q.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = q.logits(run_rows(q, ids))

    # (a) over Ŵ: transformers + PEFT (converting the per-expert adapters onto its stacked experts) and the merged
    # export both give the trainer's logits
    deq_dir = _dequantised_base(q, model_dir, tmp_path / "dequantised")
    with torch.no_grad():
        assert rel_err(PeftModel.from_pretrained(load_hf(deq_dir), str(adapter)).eval()(input_ids=ids).logits,
                       want) <= PARITY

    # (b) over W, through the existing export path: the adapter loaded onto the released base, merged (W + s·B·A),
    # saved as an HF model and run by transformers
    merged = load_pretrained(model_dir)
    load_peft_adapter(merged, adapter)
    merged_dir = save_pretrained(merge_lora(merged), tmp_path / "merged", dtype=torch.float32)
    merged_sd, w_sd = load_pretrained(merged_dir).state_dict(), load_pretrained(model_dir).state_dict()
    errors = {}  # ε = W − Ŵ of every NF4 matrix, by state-dict key
    for name, m in q.named_modules():  # each merged weight is the trainer's Ŵ + s·B·A plus ε, |ε| within the bound
        if isinstance(m, NF4LoRALinear):
            key, w_hat, nf4 = f"{name}.weight", m.base_layer.dequantized_weight(), m.base_layer.nf4_weight()
            delta = m.scale * m.lora_B.weight.double() @ m.lora_A.weight.double()
            size = m.scale * m.lora_B.weight.double().abs() @ m.lora_A.weight.double().abs()
            original = w_sd[key]
        elif isinstance(m, NF4ExpertStack):
            host, leaf = name.rsplit(".", 1)
            key, w_hat, nf4 = name, m.experts().dequantize(), m.experts().nf4_weight()
            adapters = q.get_submodule(host).lora_adapters
            parts = [adapters["gate_proj"], adapters["up_proj"]] if leaf == "gate_up_proj" else [adapters["down_proj"]]
            delta = torch.cat([a.delta().double() for a in parts], dim=1)  # [E, O, I]
            size = torch.cat([a.scale * a.lora_B.double().abs() @ a.lora_A.double().abs() for a in parts], dim=1)
            original = w_sd[key].reshape(nf4.data.shape[0], -1, 64)  # each expert's blocks, as it was quantised
        else:
            continue
        eps = w_sd[key].double() - w_hat.double()
        assert (eps.abs() <= nf4_error_bound(nf4, original).reshape(eps.shape)).all(), key
        theirs, ours = merged_sd[key].double(), w_hat.double() + delta
        # the fp32 merge rounds s·B·A (a sum of r products: r roundings of their sizes) and W + ΔW, on each side
        rounding = (q.get_submodule(next(iter(adapter_names(q)))).rank + 4) * torch.finfo(torch.float32).eps * (
            theirs.abs() + ours.abs() + size)
        assert ((theirs - ours - eps).abs() <= rounding).all(), key
        errors[key] = eps
    assert sum(k.endswith(STACKS) for k in errors) == 2 * sum(q.args.sparse_layers)

    bound = _first_order_logit_bound(deq_dir, adapter, errors, ids, position=-1)
    with torch.no_grad():
        theirs = load_hf(merged_dir)(input_ids=ids).logits[0, -1].double()
    actual = (theirs - want[0, -1].double()).abs()
    allowed = bound + PARITY * want[0, -1].abs().max().item()
    assert (actual <= allowed).all(), f"{int((actual > allowed).sum())} logits beyond the bound"
    assert actual.max() > PARITY * want.abs().max()  # the NF4 error is really there, above parity's rounding
    print(f"NF4 logit error at the last position: max {actual.max():.3e}, at most {(actual / bound).max():.2f} of "
          f"its first-order bound (max {bound.max():.3e}), median {(actual / bound).median():.2f}")


def adapter_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (LoRALinear, GroupedLoRA))]


def _first_order_logit_bound(deq_dir: Path, adapter: Path, eps: dict[str, torch.Tensor], ids: torch.Tensor,
                             position: int) -> torch.Tensor:
    """Σ_l |⟨∂z/∂W_l, ε_l⟩| for every logit z at `position` (module docstring), on the model over Ŵ with the
    adapter merged, its NF4 matrices as autograd leaves; an expert stack's experts are one term each. fp64 sums."""
    m = load_pretrained(deq_dir, kernels="ref")
    load_peft_adapter(m, adapter)
    merge_lora(m)  # Ŵ + s·B·A: z depends on a base weight only through that sum, so ∂z/∂W_l is ∂z/∂(merged)_l
    leaves = {}
    for key in eps:  # <linear>.weight or <experts>.gate_up_proj / down_proj
        host, leaf = key.rsplit(".", 1)
        leaves[key] = getattr(m.get_submodule(host), leaf).requires_grad_(True)
    logits = m.logits(run_rows(m, ids))[0, position]  # [V]
    keys = list(leaves)
    bound = torch.zeros(logits.shape[0], dtype=torch.float64)
    for v in range(logits.shape[0]):
        grads = torch.autograd.grad(logits[v], [leaves[k] for k in keys], retain_graph=True)
        total = 0.0
        for k, g in zip(keys, grads):
            prod = g.double() * eps[k]
            total += (prod.sum(dim=(1, 2)).abs().sum() if k.endswith(STACKS) else prod.sum().abs()).item()
        bound[v] = total
    return bound


def _nf4_moe(model_dir: Path, kernels: str):
    """The tiny MoE with LoRA on attention and every expert (random non-zero B), bases and experts in NF4."""
    m = load_pretrained(model_dir, kernels=kernels)
    torch.manual_seed(0)
    apply_lora(m, LoraArgs(rank=4, alpha=8.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, (LoRALinear, GroupedLoRA)):
                b = mod.lora_B.weight if isinstance(mod, LoRALinear) else mod.lora_B
                b.normal_(0, 0.05, generator=g)
    quantize_lora_bases(m)
    return m


@pytest.mark.parametrize("kernels", ["ref", "triton"])
def test_packed_rows_equal_documents_one_by_one(moe_runs, kernels):
    """Three documents packed in one row against each alone, over NF4 experts (routing is per token, dropless):
    within fp32 reordered sums over the model's depth (assert_no_leak)."""
    m = _nf4_moe(moe_runs["model"], kernels).eval()
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, m.args.vocab_size, (n,), generator=g).tolist() for n in (9, 14, 6)]
    ids, pos, cu, max_len, _ = packed_inputs(docs, [[0, 1, 2]], 29)
    with torch.no_grad():
        packed = m(ids, pos, cu, max_len)[0]
        start = 0
        for d in docs:
            alone = run_rows(m, torch.tensor([d]))[0]
            assert_no_leak(packed[start:start + len(d)], alone, f"document of {len(d)}", torch.float32,
                           terms=4 * m.args.dim)
            start += len(d)


def test_triton_path_equals_the_reference_inside_the_model(moe_runs):
    """kernels = "triton" (the Triton dispatch / combine and dequantiser through the interpreter, the NF4 grouped
    GEMMs) and "ref" (moe_ref on the dequantised experts) on the same NF4 model: loss and every adapter gradient
    within fp32 reordered sums over the model's depth (test_qwen3_moe.py's kernels-on-off bounds)."""
    results = []
    for kernels in ("triton", "ref"):
        m = _nf4_moe(moe_runs["model"], kernels)
        ids = torch.randint(3, m.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
        loss = m.logits(run_rows(m, ids)).float().logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    (l_tri, g_tri), (l_ref, g_ref) = results
    assert any("lora_adapters" in n for n in g_ref) and set(g_tri) == set(g_ref)
    assert abs(l_tri - l_ref) <= 1e-5 * abs(l_ref)
    for n, g in g_ref.items():
        assert rel_err(g_tri[n], g) <= 1e-4, n


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_nf4_experts_exactly(moe_runs, mode):
    """Checkpointed blocks (the recompute runs the NF4 grouped GEMMs and dequantiser again; selective AC keeps the
    grouped GEMMs' outputs, never the dequantised stacks): the loss and adapter gradients of the blocks run
    plainly, exactly (the same kernels on the same values in the same order)."""
    from atelier_studio.designer.registry import family_of_args
    from atelier_studio.pipeline.policies import checkpoint_blocks

    results = []
    for ac in ("none", mode):
        m = _nf4_moe(moe_runs["model"], "triton")
        checkpoint_blocks(family_of_args(m.args).blocks(m), ac)
        ids = torch.randint(3, m.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
        loss = m.logits(run_rows(m, ids)).float().logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    (l_plain, g_plain), (l_ac, g_ac) = results
    assert torch.equal(l_plain, l_ac)
    assert all(torch.equal(g_ac[n], g) for n, g in g_plain.items())


def test_an_expert_parallel_shard_computes_with_its_experts_rows_of_every_nf4_tensor():
    """NF4ExpertStack.shard (expert parallelism's placement, here with a plain slicing function in place of the
    DTensor one): the local stack is the full stack's experts 4..7, bytes and per-expert scales alike, so its
    dequantised weights are those rows of the full stack's; the small buffers stay whole (one checkpoint layout);
    a second shard and a strided or empty run of experts are refused."""
    torch.manual_seed(0)
    w = torch.randn(8, 64, 32)
    full = NF4ExpertStack.from_weight(w, kernels="ref")
    stack = NF4ExpertStack.from_weight(w, kernels="ref")
    stack.shard(lambda t: torch.nn.Parameter(t.detach()[4:8], requires_grad=False), slice(4, 8))
    local = stack.experts()
    assert local.shape == (4, 64, 32) and stack.shape == (8, 64, 32)
    assert torch.equal(local.dequantize(), full.experts().dequantize()[4:8])
    assert torch.equal(local.factor, full.quantization_factor[4:8])
    assert not torch.equal(local.factor, full.quantization_factor[:4])  # the rows differ: the slice is checked
    assert stack.quantization_factor.shape[0] == stack.scaler_mean.shape[0] == 8  # whole on every rank
    with pytest.raises(ValueError, match="already sharded"):
        stack.shard(lambda t: t, slice(0, 4))
    for bad in (slice(0, 8, 2), slice(3, 3)):
        with pytest.raises(ValueError, match="contiguous non-empty"):
            NF4ExpertStack.from_weight(w, kernels="ref").shard(lambda t: t, bad)


@pytest.mark.multigpu
@pytest.mark.slow
def test_qlora_moe_two_processes_equal_one_with_the_nf4_experts_sharded(moe_runs, world, tmp_path):
    """Two gloo processes, the same losses and adapter as one process on the same global batch
    (tests/designer/test_distributed.py's bounds; the aux loss off there: a product of batch means, test_qwen3_moe.py
    says why), with the NF4 experts sharded two ways:
      FSDP2: each rank reads every whole expert stack, quantises it per expert as one process does and keeps its 4
        of the 8 experts' NF4 bytes (and its rows of the attention bases), all-gathered per block;
      expert parallelism: the same 4 experts' bytes stay on their rank (never all-gathered), the tokens travel to
        them by all-to-all, each rank dequantises only its experts; with activation checkpointing, whose recompute
        exchanges and dequantises again; and the same run stopped at step 2 and resumed."""
    from tests.designer.test_distributed import (
        LORA,
        QLORA,
        args,
        assert_same_losses,
        assert_same_safetensors,
        launch_two,
    )

    moe = ("--set", f"model.path={moe_runs['model']}", "--set", "model.router_aux_loss=off")
    ep = ("--set", "train.distributed.expert_parallel=2", "--set", "train.distributed.activation_checkpointing=full")
    two = tmp_path / "two"
    two1 = ("--set", "train.micro_batch=1")
    log = launch_two({"qlora": args(world, two / "qlora", *LORA, *QLORA, *moe, *two1),
                      "qlora_ep": args(world, two / "qlora_ep", *LORA, *QLORA, *moe, *ep, *two1),
                      # stopped at step 2 and resumed: the adapters come back from the sharded checkpoint, the NF4
                      # experts are quantised again from the HF weights, each rank keeping its own
                      "qlora_ep_cut": args(world, two / "qlora_ep_cut", *LORA, *QLORA, *moe, *ep, *two1,
                                           "--set", "train.max_steps=2"),
                      "qlora_ep_cut_resumed": args(world, two / "qlora_ep_cut", *LORA, *QLORA, *moe, *ep, *two1)},
                     tmp_path)
    one = tmp_path / "one"
    assert main(args(world, one, *LORA, *QLORA, *moe, "--set", "train.micro_batch=2")) == 0
    for run in ("qlora", "qlora_ep", "qlora_ep_cut"):
        assert_same_losses(one, two / run, range(1, 5))
        assert_same_safetensors(one / "adapter" / "adapter_model.safetensors",
                                two / run / "adapter" / "adapter_model.safetensors")
    assert_same_losses(two / "qlora_ep", two / "qlora_ep_cut", range(1, 5))  # the resume changes nothing
    # the 88,704 NF4 bytes: 50,688 of expert stacks (8 experts × (2·32·64 + 64·32) weights at 0.516 bytes, two
    # layers) and 38,016 of attention bases; each rank holds half under both plans (the main rank reports it)
    held = [line for line in log.splitlines() if "of the" in line and "NF4" in line]
    assert len(held) >= 2 and all("of the 88,704 bytes" in line for line in held), log[-3000:]
    # only the three expert-parallel runs place experts by rank (the main rank reports it): 2 sparse layers of 8
    placed = "expert parallelism: rank 0 of 2 holds experts 0..3 of 8 in each of 2 MoE layers"
    assert log.count(placed) == 3, log[-3000:]
    for line in held:
        words = line.split()
        mine, total = (int(words[words.index(w) + 1].replace(",", "")) for w in ("holds", "the"))
        assert 2 * mine == total, line


@pytest.mark.gpu
@pytest.mark.slow  # a second compile of MoE blocks (~20 s): the fast tier's compiled-MoE test covers the graph
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_nf4_blocks_match_eager_on_the_gpu():
    """The bench's configuration at tiny size on the GPU: bf16 base with attention bases and experts in NF4
    (quantised on the device), LoRA on every expert, per-block torch.compile around the dequantiser (a custom op),
    torch._grouped_mm and the Triton dispatch / combine: the eager loss and adapter gradients within bf16
    (norm-relative 2e-2, test_qwen3_moe.py's bound for the bf16 base: a few bf16 roundings; a wrong graph is O(1));
    no bf16 expert stack left in the model."""
    from tests.designer.test_model import randomise_adapters
    from tests.designer.test_qwen3_moe import assert_compiled_blocks_give_the_eager_gradients, random_moe

    model = random_moe(9, dim=128, num_heads=4, head_dim=32, moe_ffn_dim=64)  # 16-byte rows for the grouped GEMMs
    apply_lora(model, LoraArgs(rank=8, alpha=16.0))
    randomise_adapters(model, 10)
    model = model.to(torch.bfloat16)
    quantize_lora_bases(model, "cuda")
    model = model.cuda()
    assert all(e.quantized and e.gate_up_proj.quantized_data.is_cuda for e in _experts(model))
    assert_compiled_blocks_give_the_eager_gradients(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantising_at_load_never_holds_the_bf16_experts_on_the_gpu():
    """A model held on the host, quantised onto the GPU as the trainer loads QLoRA: the GPU's peak during the load is
    the NF4 result plus one bf16 stack and the quantiser's temporaries (per expert), far below the bf16 MoE (12
    sparse layers of 64 experts: 302 MB of bf16 stacks, 78 MB of NF4); the bound, half the bf16 MoE, would fail for
    a load that moved the model over first."""
    from tests.designer.test_qwen3_moe import random_moe

    model = random_moe(5, dim=256, num_heads=4, head_dim=64, moe_ffn_dim=256, num_experts=64, top_k=4,
                       num_layers=12, mlp_only_layers=())
    apply_lora(model, LoraArgs(rank=4, alpha=8.0, targets=("q", "down")))
    model = model.to(torch.bfloat16)
    stacks = [getattr(e, s) for e in _experts(model) for s in STACKS]
    bf16_moe = sum(t.numel() * t.element_size() for t in stacks)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    quantize_lora_bases(model, "cuda")
    peak = torch.cuda.max_memory_allocated() - start
    nf4 = sum(t.numel() * t.element_size() for e in _experts(model) for s in STACKS
              for t in getattr(e, s).state_dict().values())
    print(f"bf16 experts {bf16_moe / 2**20:.0f} MiB, NF4 {nf4 / 2**20:.0f} MiB, load peak {peak / 2**20:.0f} MiB")
    assert all(e.gate_up_proj.quantized_data.is_cuda for e in _experts(model))
    assert peak < bf16_moe / 2, (peak, bf16_moe)
