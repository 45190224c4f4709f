"""Qwen3.5 designer: parity with transformers' Qwen3_5ForCausalLM both ways, packing exactness (attention, conv
and delta-rule state), HF I/O and sizes, FLOPs, LoRA with PEFT, and end-to-end training through the CLI."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from atelier_studio.designer.hf import args_from_size, init_random, load_pretrained, save_pretrained
from atelier_studio.designer.lora import LoraArgs, LoRALinear, apply_lora, load_peft_adapter, save_peft_adapter
from atelier_studio.designer.qwen35 import FULL, LINEAR, SIZES, Qwen35, Qwen35Args, num_params
from atelier_studio.flows.cli import main

from tests.designer.test_model import (
    FIXTURE,
    check_packed_equals_one_by_one,
    load_hf,
    packed_inputs,
    packing_terms,
    rel_err,
    run_rows,
)
from tests.kernels._compare import assert_no_leak, assert_within_rounding
from tests.kernels.test_gated_delta_rule import _rms_ratio

V = 97


def random_qwen35(seed: int = 0, vocab: int = V, **overrides) -> Qwen35:
    """A tiny fp32 Qwen3.5 whose every parameter matters: norms away from their init, decays and conv taps spread."""
    model = Qwen35(Qwen35Args.from_size("qwen3.5-tiny", vocab, eos_token_id=2, pad_token_id=0, **overrides))
    model.init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred ones around 0, the gated one around 1
                p.copy_(torch.empty_like(p).uniform_(-0.5, 0.5, generator=g) + (1.0 if "linear_attn" in name else 0.0))
            elif name.endswith(("dt_bias", ".bias")):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.empty_like(p).normal_(0.0, 0.5, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-3.0, 1.0, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.empty_like(p).normal_(0.0, 0.04, generator=g))
    return model


def assert_same_math(got: torch.Tensor, want: torch.Tensor, what: str, args: Qwen35Args) -> None:
    """Two fp32 computations of the same model (transformers' and Atelier's, or decoding's recurrence and the
    chunked training forward) agree to rounding: the model's reduction lengths once per layer (packing_terms),
    6e-5 of the output's scale at qwen3.5-tiny; measured up to 2.5e-6. A wrong weight, layout or step is O(1)."""
    assert_within_rounding(got, want, what, torch.float32, packing_terms(args), why="not the same computation")


def save_tiny(root: Path, seed: int = 0, **overrides) -> Path:
    name = f"q35-{seed}-{'-'.join(f'{k}={v}' for k, v in overrides.items())}"
    return save_pretrained(random_qwen35(seed, **overrides), root / name, dtype=torch.float32)


# --- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=False, attention_bias=True),
                                       dict(layer_types=(FULL, LINEAR, LINEAR), num_layers=3,
                                            partial_rotary_factor=0.5)])
def test_logits_match_transformers(tmp_path, overrides):
    path = save_tiny(tmp_path, 1, **overrides)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5_text"
    ours, hf = load_pretrained(path, attention_impl="sdpa"), load_hf(path)
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    tied = ours.args.tie_embeddings
    assert set(ours.state_dict()) == {k for k in hf.state_dict() if not (tied and k == "lm_head.weight")}
    ids = torch.randint(0, V, (2, 75), generator=torch.Generator().manual_seed(2))  # > one 64-token chunk
    with torch.no_grad():
        got, want = ours.logits(run_rows(ours, ids)), hf(input_ids=ids).logits
    print(f"qwen3.5 logits vs transformers {overrides}: relative {rel_err(got, want):.2e}")
    assert_same_math(got, want, "logits vs transformers", ours.args)


def test_loads_a_transformers_written_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                            num_attention_heads=3, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                                         "partial_rotary_factor": 0.5})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # HF inits the zero-centred norms to 0 and the conv small: spread them
        for n, p in hf.named_parameters():
            if "norm" in n or "conv1d" in n:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")  # several shards + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = load_pretrained(tmp_path / "hf")
    assert ours.args.rope_theta == 5e5 and ours.args.rotary_dim == 8 and ours.args.layer_types.count(FULL) == 1
    ids = torch.randint(0, 61, (1, 70), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = ours.logits(run_rows(ours, ids)), hf(input_ids=ids).logits
    print(f"transformers-written qwen3.5 → Atelier: relative {rel_err(got, want):.2e}")
    assert_same_math(got, want, "transformers-written checkpoint", ours.args)


# --- packing: attention, conv and the delta-rule state all see document boundaries ----------------
def test_packed_rows_equal_documents_one_by_one():
    model = random_qwen35(5)
    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 70, 1, 7, 9, 3)]  # 70: two chunks
    # a leak across a boundary shows as O(1) (see the test below)
    check_packed_equals_one_by_one(model, docs, [[0, 1, 2], [3, 4], [5]], seq_len=80)


def test_a_preceding_document_does_not_change_a_document():
    model = random_qwen35(7).eval()
    g = torch.Generator().manual_seed(8)
    doc, other = torch.randint(0, V, (20,), generator=g).tolist(), torch.randint(0, V, (30,), generator=g).tolist()
    with torch.no_grad():
        alone = run_rows(model, torch.tensor([doc]))[0]
        ids, pos, cu, max_len, _ = packed_inputs([other, doc], [[0, 1]], seq_len=50)
        after = model(ids, pos, cu, max_len)[0, 30:]
        # equal up to rounding: matmuls over 50 vs 20 rows may block, and so add, differently
        assert_no_leak(after, alone, "a document after another", torch.float32, packing_terms(model.args))
        # the same row as ONE document (positions continuing): conv taps and state now cross — the check fails
        leaky = model(ids, torch.arange(50)[None], torch.tensor([0, 50], dtype=torch.int32), 50)[0, 30:]
    with pytest.raises(AssertionError, match="leak across the document boundary"):
        assert_no_leak(leaky, alone, "one document: the boundary ignored", torch.float32, packing_terms(model.args))


# --- HF I/O, sizes, CLI ---------------------------------------------------------------------------
def test_config_round_trip_sizes_and_init(tmp_path):
    for size in SIZES:
        args = args_from_size(size, 248320)
        assert Qwen35Args.from_hf_config(args.to_hf_config()) == args
    big = args_from_size("qwen3.5-9b", 248320)
    assert big.layer_types.count(LINEAR) == 24 and big.layer_types.count(FULL) == 8
    assert big.layer_types[3] == FULL and big.rotary_dim == 64
    assert abs(num_params(big) / 1e9 - 8.95) < 0.01  # 9B-class text model (embeddings + untied head: 2.03e9)
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**{k: v for k, v in big.to_hf_config().items()
                               if k not in ("architectures", "dtype", "torch_dtype", "model_type")})
    assert cfg.layer_types == list(big.layer_types) and cfg.linear_num_value_heads == 32
    with pytest.raises(ValueError, match="gdn_num_value_heads"):
        Qwen35Args.from_size("qwen3.5-tiny", 17, gdn_num_value_heads=3)
    with pytest.raises(ValueError, match="delta_rule_impl"):
        Qwen35Args.from_size("qwen3.5-tiny", 17, delta_rule_impl="triton")


def test_cli_init_writes_a_loadable_tiny_model(tmp_path):
    from atelier_studio.data.tokenizer import train_tokenizer

    tok = train_tokenizer([FIXTURE], 300, tmp_path / "tok")
    out = tmp_path / "m"
    assert main(["designer", "init", "--size", "qwen3.5-tiny", "--tokenizer", str(tok), "--out", str(out),
                 "--dtype", "float32", "--seed", "3"]) == 0
    model = load_pretrained(out)
    ref = Qwen35(model.args).init_weights(3)  # init_random streams init_weights' draws
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert load_hf(out).config.model_type == "qwen3_5_text"
    init_random("qwen3.5-tiny", tok, tmp_path / "sharded", max_shard_bytes=40_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()


def test_reads_the_vision_language_checkpoint_layout(tmp_path):
    """The released Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration: model_type "qwen3_5", a text_config,
    the text model under model.language_model.*, plus model.visual.* and mtp.* (left out), as transformers'
    AutoModelForCausalLM reads them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    text = save_tiny(tmp_path, 3, tie_embeddings=False)
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in load_file(str(text / "model.safetensors")).items()}
    state["model.visual.patch_embed.proj.weight"], state["mtp.fc.weight"] = torch.randn(4, 3), torch.randn(2, 2)
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    save_file(state, str(vlm / "model.safetensors"), metadata={"format": "pt"})
    text_config = {k: v for k, v in json.loads((text / "config.json").read_text()).items()
                   if k not in ("architectures", "tie_word_embeddings", "torch_dtype")}
    (vlm / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text_config,
        "tie_word_embeddings": False, "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32,
                                                        "num_heads": 2, "out_hidden_size": 64}}))
    ours, want = load_pretrained(vlm), load_pretrained(text)
    assert not ours.args.tie_embeddings
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = want.logits(run_rows(want, ids))
        assert torch.equal(ours.logits(run_rows(ours, ids)), expected)
        hf = AutoModelForCausalLM.from_pretrained(str(vlm), dtype=torch.float32).eval()
        assert_same_math(hf(input_ids=ids).logits, expected, "the text model through transformers", ours.args)


# --- FLOPs ----------------------------------------------------------------------------------------
def test_train_flops():
    model = Qwen35(Qwen35Args.from_size("qwen3.5-tiny", V))
    a = model.args
    lens = [64, 65, 1, 130]
    linear = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    assert model.matmul_flops(260, 10) == 6 * linear * 260 + 6 * V * a.dim * 10
    assert model.attention_flops(lens) == 6 * 1 * sum(n * n for n in lens) * a.num_heads * a.head_dim
    dk, dv = a.gdn_key_head_dim, a.gdn_value_head_dim

    def chunk(c):  # forward FLOPs of one chunk and value head (qwen35.delta_rule_flops' docstring)
        return c * c * (3 * dk + 2 * dv) + 6 * c * dk * dv + c ** 3 // 3

    per_head = chunk(64) + (chunk(64) + chunk(1)) + chunk(1) + (2 * chunk(64) + chunk(2))
    assert model.delta_rule_flops(lens) == 3 * 3 * a.gdn_num_value_heads * per_head  # 3 GDN layers, ×3 fwd+bwd
    assert model.train_flops(lens, 10) == (model.matmul_flops(260, 10) + model.attention_flops(lens)
                                           + model.delta_rule_flops(lens))
    apply_lora(model, LoraArgs(rank=4, alpha=8.0))
    assert model.matmul_flops(260, 10) < 6 * linear * 260  # frozen bases: no weight-gradient FLOPs


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_matmul_and_attention_flops_match_flop_counter(monkeypatch, mode):
    """FlopCounterMode sees the weight matmuls (mm) and the full-attention layer's SDPA (bmm) once the delta rule,
    whose FLOPs test_train_flops checks from the kernel's shapes, is swapped for a matmul-free stand-in."""
    import atelier_studio.designer.qwen35 as q35

    from tests.designer.test_model import check_flops_match_counter

    monkeypatch.setattr(q35, "gated_delta_rule", lambda q, k, v, g, beta, cu, impl, chunks: v * beta[..., None])
    model = Qwen35(Qwen35Args.from_size("qwen3.5-tiny", 67, tie_embeddings=(mode == "full"),
                                        attention_impl="sdpa")).init_weights(0)
    if mode == "lora":
        apply_lora(model, LoraArgs(rank=4, alpha=8.0, targets=("q", "qkv", "out", "down")))
        model.model.embed_tokens.weight.requires_grad_(True)  # as in test_model: every input-gradient runs
    check_flops_match_counter(model, 67)


# --- LoRA -----------------------------------------------------------------------------------------
def test_lora_targets_the_gdn_projections_and_peft_loads_the_adapter(tmp_path):
    from peft import PeftModel

    path = save_tiny(tmp_path, 4, tie_embeddings=False)
    ours = apply_lora(load_pretrained(path), LoraArgs(rank=4, alpha=8.0))  # default: every linear
    wrapped = {n for n, m in ours.named_modules() if isinstance(m, LoRALinear)}
    assert "model.layers.0.linear_attn.in_proj_qkv" in wrapped and "model.layers.0.linear_attn.in_proj_a" in wrapped
    assert "model.layers.3.self_attn.q_proj" in wrapped and "model.layers.0.self_attn.q_proj" not in wrapped
    assert len(wrapped) == 3 * (5 + 3) + 1 * (4 + 3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.05, generator=g)
    ours.eval()
    ids = torch.randint(0, V, (2, 33), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ours.logits(run_rows(ours, ids))
    adapter = save_peft_adapter(ours, LoraArgs(rank=4, alpha=8.0), tmp_path / "adapter", base_model_path=str(path))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert set(cfg["target_modules"]) == {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj",
                                          "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    peft = PeftModel.from_pretrained(load_hf(path), str(adapter)).eval()
    with torch.no_grad():
        got = peft(input_ids=ids).logits
    print(f"qwen3.5 LoRA adapter through PEFT: relative {rel_err(got, want):.2e}")
    assert_same_math(got, want, "LoRA through PEFT", ours.args)
    again = load_pretrained(path)
    load_peft_adapter(again, adapter)
    with torch.no_grad():
        assert rel_err(again.eval().logits(run_rows(again, ids)), want) <= 1e-5
    all_attention = Qwen35(Qwen35Args.from_size("qwen3.5-tiny", V, num_layers=2, layer_types=(FULL, FULL)))
    with pytest.raises(ValueError, match="name no linear"):
        apply_lora(all_attention, LoraArgs(rank=4, targets=("qkv", "z")))


# --- training through the CLI ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def q35_world(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("q35")
    assert main(["data", "tokenizer", "--corpus", str(FIXTURE), "--vocab-size", "400", "--out", str(d / "tok")]) == 0
    assert main(["designer", "init", "--size", "qwen3.5-tiny", "--tokenizer", str(d / "tok"), "--out",
                 str(d / "model"), "--dtype", "float32"]) == 0
    return d


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_training_reduces_the_loss(q35_world, tmp_path, mode):
    from tests.designer.test_train import train_args, train_losses

    out = tmp_path / mode
    extra = ["--set", "lora.rank=0", "--set", "train.lr=3e-3"] if mode == "full" else \
        ["--set", "lora.rank=8", "--set", "train.lr=1e-2"]
    assert main(train_args(q35_world, out, *extra, "--set", "train.max_steps=30", "--set", "train.warmup_steps=2",
                           "--set", "train.eval_every=0", "--set", "train.save_every=0")) == 0
    losses = [l for _, l in train_losses(out)]
    print(f"qwen3.5 {mode}: losses {losses[0]:.3f} → {losses[-1]:.3f}")
    # it learns (LoRA on a frozen random base moves slower: the embedding and head are not trained)
    assert sum(losses[-4:]) / 4 < (0.8 if mode == "full" else 0.92) * sum(losses[:4]) / 4, losses
    exported = out / ("model" if mode == "full" else "adapter")
    assert exported.is_dir()
    if mode == "full":
        assert load_hf(exported).config.model_type == "qwen3_5_text"
    else:
        assert "in_proj_qkv" in json.loads((exported / "adapter_config.json").read_text())["target_modules"]


def test_a_cuda_run_without_fla_stops_before_loading(q35_world, monkeypatch):
    import atelier_studio.kernels.gated_delta_rule as gdr
    from atelier_studio.designer.config import DesignerConfig, ModelConfig
    from atelier_studio.designer.hf import read_args
    from atelier_studio.designer.task import _preflight
    from atelier_studio.pipeline.config import ConfigError

    monkeypatch.setattr(gdr, "has_fla", lambda: False)
    cuda, model = torch.device("cuda"), q35_world / "model"
    args = read_args(model)
    for delta_rule in ("auto", "fla"):
        cfg = DesignerConfig(model=ModelConfig(path=str(model), dtype="bfloat16", delta_rule=delta_rule))
        with pytest.raises(ConfigError, match=r"model.delta_rule.*pip install fla-core"):
            _preflight(cfg, args, cuda)
    for ok in (ModelConfig(path=str(model), delta_rule="ref"), ModelConfig(path=str(model), dtype="float32")):
        _preflight(DesignerConfig(model=ok), args, cuda)
    _preflight(DesignerConfig(model=ModelConfig(path=str(model))), args, torch.device("cpu"))


def test_default_lora_targets_are_every_linear_of_the_family():
    """The config's default (no targets) is the family's every linear; each name is the family's own."""
    from atelier_studio.designer.config import LoraConfig
    from atelier_studio.designer.registry import family_of_size

    q3, q35 = family_of_size("tiny"), family_of_size("qwen3.5-tiny")
    assert LoraConfig().targets == ()
    assert q3.resolve_lora_targets(()) == ("q", "k", "v", "o", "gate", "up", "down")
    assert q35.resolve_lora_targets(()) == ("q", "k", "v", "o", "gate", "up", "down", "qkv", "z", "b", "a", "out")
    with pytest.raises(ValueError, match=r"\['qkv'\] are not Qwen3 linears"):
        q3.resolve_lora_targets(("q", "qkv"))


@pytest.mark.multigpu
def test_two_processes_equal_one(q35_world, tmp_path):
    """FSDP2 on two processes (gloo, CPU), each rank reading only its shard of the Qwen3.5 weights, with activation
    checkpointing: the same losses and adapter as one process on the same global batch."""
    from tests.designer.test_distributed import LORA, args, assert_same_losses, assert_same_safetensors, launch_two

    two = tmp_path / "two"
    launch_two({"lora": args(q35_world, two, *LORA, "--set", "train.micro_batch=1",
                             "--set", "train.distributed.activation_checkpointing=full")}, tmp_path)
    one = tmp_path / "one"
    assert main(args(q35_world, one, *LORA, "--set", "train.micro_batch=2")) == 0
    assert_same_losses(one, two, range(1, 5))
    # the bounds of the Qwen3 test (tests/designer/test_distributed.py's docstring derives them): its lr 1e-3 keeps
    # Adam from turning the rounding noise in in_proj_a's near-zero gradients into lr-sized steps
    assert_same_safetensors(one / "adapter" / "adapter_model.safetensors",
                            two / "adapter" / "adapter_model.safetensors")


def test_compiled_blocks_train_like_eager():
    """`[train.distributed] compile = true` on Qwen3.5: per-block torch.compile (graph breaks where the CPU
    reference kernels read cu_seqlens on the host) gives the eager LoRA gradients, both layer kinds."""
    import copy

    from atelier_studio.pipeline.policies import compile_blocks

    model = random_qwen35(3)
    apply_lora(model, LoraArgs(rank=4, alpha=8.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(4))
    compiled = compile_blocks(copy.deepcopy(model))
    g = torch.Generator().manual_seed(10)
    docs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 1, 20, 25)]
    ids, pos, cu, max_len, _ = packed_inputs(docs, [[0, 1], [2, 3]], seq_len=45)
    grads = []
    for m in (model, compiled):
        m(ids, pos, cu, max_len).pow(2).mean().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and any("linear_attn" in n for n in grads[0])
    for n, want in grads[0].items():
        assert rel_err(grads[1][n], want) < 1e-4, n


def _differently_packed_batches(device: str = "cpu") -> list:
    """Three micro-batches of 2 rows × 70 tokens, each packed from different documents (segment and chunk counts)."""
    from atelier_studio.data.packing import Batch

    g = torch.Generator().manual_seed(10)

    def batch(lens_per_row: list[list[int]]) -> Batch:
        docs = [torch.randint(0, V, (n,), generator=g).tolist() for row in lens_per_row for n in row]
        rows, i = [], 0
        for row in lens_per_row:
            rows.append(list(range(i, i + len(row))))
            i += len(row)
        ids, pos, cu, max_len, lens = packed_inputs(docs, rows, seq_len=70)
        return Batch(ids, ids, pos, cu, max_len, lens, ids.numel(), ids.numel()).to(device)

    return [batch([[40, 1, 20], [25, 45]]), batch([[70], [3, 3, 3, 61]]), batch([[9] * 7, [66, 4]])]


def test_compiled_blocks_compile_once_per_segment_bucket(monkeypatch):
    """No recompiles: batches of one packed shape but different documents (segment counts, chunk
    counts) reach compiled blocks through data.packing.compile_shape, and nothing compiles after the first
    batch. The delta rule's chunk index rides along as on CUDA (the CPU reference ignores it): its row count is
    fixed by the tokens and segments, so it adds no guard either. Without compile_shape, every new segment
    count compiles again."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import atelier_studio.designer.qwen35 as q35
    from atelier_studio.data.packing import compile_shape
    from atelier_studio.kernels.gated_delta_rule import chunk_index
    from atelier_studio.pipeline.policies import compile_blocks

    monkeypatch.setattr(q35.PackedDocs, "of", classmethod(lambda cls, cu, impl: cls(cu, impl, chunk_index(cu))))
    model = random_qwen35(3)
    apply_lora(model, LoraArgs(rank=4, alpha=8.0))
    compile_blocks(model)
    batches = _differently_packed_batches()

    def graphs_after(prepare) -> list[int]:
        torch._dynamo.reset()
        counters.clear()
        seen = []
        for b in batches:
            b = prepare(b)
            model(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen).pow(2).mean().backward()
            seen.append(counters["stats"]["unique_graphs"])
        return seen

    bucketed = graphs_after(compile_shape)
    assert bucketed[0] > 0 and bucketed[1:] == [bucketed[0]] * 2, bucketed
    raw = graphs_after(lambda b: b)
    assert raw[2] > raw[0], raw  # the test can tell: unbucketed shapes do recompile


# --- the fast path on the GPU ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_path_matches_the_reference_in_bf16():
    """Whole model on CUDA: fla's delta rule and varlen attention ("auto") under bf16 autocast, measured against
    the fp32 model (fp32 delta-rule reference, per-document SDPA). Its error must be bf16-sized: within a few
    times that of the reference path under the same autocast (which keeps the delta rule itself in fp32). A
    wrong kernel, or state leaking across the packed documents, is off by O(1)."""
    from atelier_studio.kernels.gated_delta_rule import has_fla

    if not has_fla():
        pytest.skip("needs fla-core (pip install fla-core)")
    model = random_qwen35(9, gdn_key_head_dim=128, gdn_value_head_dim=64).cuda()  # fla's fast-tier heads
    g = torch.Generator().manual_seed(10)
    docs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (300, 1, 64, 65, 80)]
    ids, pos, cu, max_len, _ = packed_inputs(docs, [[0, 1, 2], [3, 4]], seq_len=365)
    ids, pos, cu = ids.cuda(), pos.cuda(), cu.cuda()
    fast_args = model.args
    ref_args = dataclasses.replace(model.args, delta_rule_impl="ref", attention_impl="sdpa")

    with torch.no_grad():
        model.args = ref_args
        truth = model(ids, pos, cu, max_len).float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = model(ids, pos, cu, max_len).float()
            model.args = fast_args
            fast = model(ids, pos, cu, max_len).float()
    fast_err, ref_err = _rms_ratio(fast, truth), _rms_ratio(ref, truth)
    print(f"Qwen3.5 tiny, bf16 vs fp32 logits, RMS ratio: fast path {fast_err:.2e}, reference path {ref_err:.2e}")
    assert fast_err < 3 * ref_err + 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_layers_train_without_a_host_sync():
    """PackedDocs builds the delta rule's chunk index once per forward (its one host sync); after that the
    layers' forward and backward never wait on the GPU. (fla builds the index per call when not given one: a
    sync per layer and pass, which kept the 9B step's GPU idle between layers.)"""
    from atelier_studio.designer.decoder import PackedAttention
    from atelier_studio.designer.qwen35 import PackedDocs
    from atelier_studio.kernels.gated_delta_rule import has_fla
    from atelier_studio.kernels.rope import rope_cos_sin

    if not has_fla():
        pytest.skip("needs fla-core (pip install fla-core)")
    model = random_qwen35(9, gdn_key_head_dim=128, gdn_value_head_dim=64).cuda()  # fla trains key dims 65–128
    g = torch.Generator().manual_seed(10)
    docs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (300, 1, 64, 65, 80)]
    ids, pos, cu, max_len, _ = packed_inputs(docs, [[0, 1, 2], [3, 4]], seq_len=365)
    ids, pos, cu = ids.cuda(), pos.cuda(), cu.cuda()
    a = model.args

    def layers_step(strict: bool) -> None:
        packed, attend = PackedDocs.of(cu, a.delta_rule_impl), PackedAttention(cu, max_len, a.attention_impl)
        assert packed.chunks is not None
        cos, sin = rope_cos_sin(pos, a.rotary_dim, a.rope_theta)
        x = model.model.embed_tokens(ids)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if strict else 0)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for block in model.model.layers:
                    x = block(x, cos, sin, attend, packed)
            x.float().pow(2).mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)

    layers_step(strict=False)  # first calls autotune and compile, which sync freely
    layers_step(strict=True)
    assert all(p.grad is not None for n, p in model.named_parameters() if "linear_attn" in n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_fla_blocks_match_eager_and_compile_once():
    """The fast path inside compiled blocks (fla's custom ops with the chunk index's host-side count as an input,
    saved for the backward): the eager gradients under bf16 autocast, and nothing compiles after the first of three
    differently packed batches (data.packing.compile_shape)."""
    import copy

    import torch._dynamo
    from torch._dynamo.utils import counters

    from atelier_studio.data.packing import compile_shape
    from atelier_studio.kernels.gated_delta_rule import has_fla
    from atelier_studio.pipeline.policies import compile_blocks

    if not has_fla():
        pytest.skip("needs fla-core (pip install fla-core)")
    model = random_qwen35(9, gdn_key_head_dim=128, gdn_value_head_dim=64)  # fla trains key dims 65–128
    apply_lora(model, LoraArgs(rank=4, alpha=8.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(4))
    model = model.cuda()
    compiled = compile_blocks(copy.deepcopy(model))
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for b in _differently_packed_batches("cuda"):
        b = compile_shape(b)
        grads = []
        for m in (model, compiled):
            m.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)
            out.float().pow(2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad})
        graphs.append(counters["stats"]["unique_graphs"])
        assert any("linear_attn" in n for n in grads[0])
        for n, want in grads[0].items():
            assert _rms_ratio(grads[1][n], want) < 2e-2, n
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs


# --- generation (no cache: the packed forward re-run each step) --------------------------------------
def _decoded_hidden(model: Qwen35, seqs: list[list[int]], new: int) -> list[torch.Tensor]:
    """Each sequence's hidden states [len, D] through the decoding cache: its prompt (all but the last `new`
    tokens) prefilled with the others, left-padded, then its last tokens fed one a step."""
    from atelier_studio.designer.decode import KVCache, left_padded
    from atelier_studio.designer.qwen35 import LinearAttentionState

    device = model.lm_head_weight.device
    prompts = [x[:-new] for x in seqs]
    pads, tokens, positions = left_padded(prompts, device)
    layers = model.model.layers
    cache = KVCache(model, pads, tokens.shape[1], new, [i for i, b in enumerate(layers) if b.layer_type == FULL])
    states = [None if b.layer_type == FULL else LinearAttentionState.zeros(b.linear_attn, len(seqs), device)
              for b in layers]
    got = [[] for _ in seqs]
    with torch.no_grad():
        for step in range(new + 1):
            t = tokens.shape[1]
            valid = cache.valid[:, cache.length: cache.length + t]
            hidden = model.decode_hidden_states(tokens, positions, cache.attends, states, valid)  # [B,T,D]
            cache.length += t
            for r in range(len(seqs)):
                got[r].append(hidden[r][valid[r]])
            nxt = torch.tensor([x[len(p) + step] if step < new else 0 for x, p in zip(seqs, prompts)], device=device)
            tokens, positions = nxt[:, None], positions[:, -1:] + 1
    return [torch.cat(g)[: len(x)] for g, x in zip(got, seqs)]


def _forward_hidden(model: Qwen35, x: list[int]) -> torch.Tensor:
    """The packed training forward of one sequence: hidden [len, D]."""
    device, n = model.lm_head_weight.device, len(x)
    with torch.no_grad():
        return model(torch.tensor([x], device=device), torch.arange(n, device=device)[None],
                     torch.tensor([0, n], dtype=torch.int32, device=device), n)[0]


def test_decoding_cache_equals_the_training_forward():
    """Left-padded prompts of 1, 2 (fewer than the conv's K−1 = 3 earlier taps), 7 and 70 (past one 64-token chunk)
    tokens prefilled together, then 4 tokens a step: every real position's hidden state equals the packed
    training forward of that sequence alone (chunked delta rule, conv with per-document reset), in fp32."""
    model = random_qwen35(11).eval()
    g = torch.Generator().manual_seed(12)
    seqs = [torch.randint(3, V, (n + 4,), generator=g).tolist() for n in (1, 2, 7, 70)]
    for r, (mine, x) in enumerate(zip(_decoded_hidden(model, seqs, 4), seqs)):
        want = _forward_hidden(model, x)
        assert mine.shape == want.shape
        assert_same_math(mine, want, f"prompt {r}, decoded vs the training forward", model.args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decoding_a_bf16_model_on_the_gpu_is_as_close_to_fp32_as_its_training_forward():
    """On the GPU the model is bf16 and trains through fla's chunk kernel, while decoding runs the fp32
    recurrence: measured against the fp32 model, decoding's error must be bf16-sized like the forward's."""
    from atelier_studio.kernels.gated_delta_rule import has_fla

    if not has_fla():
        pytest.skip("needs fla-core (pip install fla-core)")
    g = torch.Generator().manual_seed(14)
    seqs = [torch.randint(3, V, (n + 5,), generator=g).tolist() for n in (3, 40, 130)]
    heads = dict(gdn_key_head_dim=128, gdn_value_head_dim=64)  # fla's fast-tier heads: its autotune runs once
    fp32 = random_qwen35(15, **heads).cuda().eval()
    fp32.args = dataclasses.replace(fp32.args, delta_rule_impl="ref", attention_impl="sdpa")
    truth = [_forward_hidden(fp32, x) for x in seqs]
    bf16 = random_qwen35(15, **heads).cuda().to(torch.bfloat16).eval()
    for r, (dec, x, t) in enumerate(zip(_decoded_hidden(bf16, seqs, 5), seqs, truth)):
        fwd = _forward_hidden(bf16, x)
        dec_err, fwd_err = _rms_ratio(dec, t), _rms_ratio(fwd, t)
        print(f"sequence {r}: bf16 decoding vs fp32 RMS ratio {dec_err:.2e}, bf16 forward {fwd_err:.2e}")
        assert dec_err < 3 * fwd_err + 1e-2


def test_padding_never_reaches_the_linear_attention_state():
    """A prompt decoded beside a much longer one (so behind many pads) gives the tokens it gives alone."""
    from atelier_studio.designer.generate import generate

    model = random_qwen35(13)
    short, long = [7, 9], list(range(3, 60))
    alone = generate(model, None, [short], max_new_tokens=5, eos_token_id=[])[0]
    beside = generate(model, None, [long, short], max_new_tokens=5, eos_token_id=[], batch_size=2)[1]
    assert beside == alone


def test_batched_generation_equals_one_by_one_greedy():
    """Prompts of different lengths decoded together equal each decoded alone by re-running the whole forward."""
    from atelier_studio.designer.generate import generate, generate_greedy_ref

    model = random_qwen35(4)
    prompts = [[5, 9, 12, 40, 7], [3, 3], [11, 60, 2 + 1, 8, 90, 14, 22]]
    got = generate(model, None, prompts, max_new_tokens=6, eos_token_id=[])
    assert got == [generate_greedy_ref(model, p, 6) for p in prompts]
    assert all(len(g) == 6 for g in got)


def test_generation_stops_at_eos_and_sampling_is_seeded():
    from atelier_studio.designer.generate import generate

    model = random_qwen35(5)
    prompts = [[5, 9, 12], [3, 4, 6, 8]]
    first = generate(model, None, prompts, max_new_tokens=5, eos_token_id=[])
    eos = first[0][2]  # stop where prompt 0 produced this token
    stopped = generate(model, None, prompts, max_new_tokens=5, eos_token_id=eos)
    assert stopped[0] == first[0][: first[0].index(eos)]
    a = generate(model, None, prompts, max_new_tokens=5, temperature=1.0, seed=3, eos_token_id=[])
    assert a == generate(model, None, prompts, max_new_tokens=5, temperature=1.0, seed=3, eos_token_id=[])


def test_designer_generate_writes_captions_for_a_qwen35_model(q35_world, tmp_path):
    """`atelier designer generate` (the flows' caption step) on a Qwen3.5 model directory."""
    import json

    briefs = tmp_path / "briefs.txt"
    briefs.write_text("a red circle\na small blue square on the left\n")
    out = tmp_path / "captions.jsonl"
    assert main(["designer", "generate", "--model", str(q35_world / "model"), "--briefs", str(briefs), "--out",
                 str(out), "--max-new-tokens", "6"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["brief"] for r in rows] == ["a red circle", "a small blue square on the left"]
    assert all(isinstance(r["caption"], str) for r in rows)


def test_kernels_on_equals_kernels_off(monkeypatch):
    """Qwen35Args.kernels reaches every fused op (norms, RoPE, conv, gated norm, SwiGLU): the Triton kernels (CPU:
    the interpreter) and the references give the same packed loss and gradients in fp32."""
    import importlib

    from atelier_studio.kernels.cross_entropy import linear_cross_entropy

    launched: dict[str, int] = {}
    for module, launcher in (("rmsnorm", "rmsnorm_fwd"), ("rope", "rope_apply"), ("swiglu", "swiglu_fwd"),
                             ("causal_conv1d", "conv_fwd"), ("gated_rmsnorm", "gated_rmsnorm_fwd")):
        mod = importlib.import_module(f"atelier_studio.kernels.{module}")
        real = getattr(mod, launcher)
        monkeypatch.setattr(mod, launcher,
                            lambda *a, _r=real, _k=launcher, **kw: launched.update({_k: 1}) or _r(*a, **kw))

    ref = random_qwen35(6)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    cu = torch.tensor([0, 10, 24, 34, 48], dtype=torch.int32)
    runs = []
    for kernels in ("ref", "triton"):
        model = Qwen35(dataclasses.replace(ref.args, kernels=kernels, delta_rule_impl="ref"))
        model.load_state_dict(ref.state_dict())
        hidden = model(ids, pos, cu, 14).reshape(-1, ref.args.dim)
        loss = linear_cross_entropy(hidden, model.lm_head_weight, ids.reshape(-1), impl="torch")
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l_ref, g_ref), (l_tri, g_tri) = runs
    assert len(launched) == 5, launched  # every Triton launcher ran in the "triton" model
    assert abs(l_tri - l_ref) <= 1e-5 * abs(l_ref)
    for n, g in g_ref.items():
        assert rel_err(g_tri[n], g) <= 1e-4, n
