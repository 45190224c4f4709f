"""Designer model: parity with transformers' Qwen3ForCausalLM, packing exactness, HF I/O, FLOPs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atelier_studio.designer.hf import init_random, load_pretrained, save_pretrained
from atelier_studio.designer.qwen3 import SIZES, Qwen3, Qwen3Args, num_params
from atelier_studio.kernels.cross_entropy import linear_cross_entropy
from atelier_studio.kernels.gated_delta_rule import CHUNK

from tests.kernels._compare import assert_no_leak

FIXTURE = Path(__file__).parents[1] / "fixtures" / "designer" / "briefs.jsonl"


# --- helpers shared by the designer tests ---------------------------------------------------------
def make_tokenizer_dir(root: Path) -> Path:
    from atelier_studio.data.tokenizer import train_tokenizer

    return train_tokenizer([FIXTURE], 300, root / "tokenizer")


def make_model_dir(root: Path, vocab_size: int, seed: int = 0, **overrides) -> tuple[Path, Qwen3Args]:
    """A tiny fp32 HF directory written by save_pretrained."""
    args = Qwen3Args.from_size("tiny", vocab_size, eos_token_id=2, pad_token_id=0, **overrides)
    model = norms_away_from_one(Qwen3(args).init_weights(seed), seed)
    name = f"model-{seed}-{'-'.join(f'{k}' for k in overrides)}"
    return save_pretrained(model, root / name, dtype=torch.float32), args


def norms_away_from_one(model, seed: int):
    """Every norm weight uniform in [0.5, 1.5], so a wrong norm weight cannot hide; returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed + len(name)))
    return model


def randomise_adapters(model, seed: int) -> None:
    """Non-zero B in every adapter (LoRALinear and the experts' GroupedLoRA), so each changes the logits (PEFT's
    init makes B = 0)."""
    from atelier_studio.designer.lora import GroupedLoRA, LoRALinear

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (LoRALinear, GroupedLoRA)):
                (m.lora_B.weight if isinstance(m, LoRALinear) else m.lora_B).normal_(0, 0.05, generator=g)


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def packed_inputs(docs: list[list[int]], rows: list[list[int]], seq_len: int, pad_id: int = 0):
    """Pack docs into rows (lists of doc indices), pad each row as its own document."""
    ids, pos, lens = [], [], []
    for row in rows:
        r_ids, r_pos = [], []
        for d in row:
            r_ids += docs[d]
            r_pos += list(range(len(docs[d])))
            lens.append(len(docs[d]))
        pad = seq_len - len(r_ids)
        if pad:
            r_ids += [pad_id] * pad
            r_pos += list(range(pad))
            lens.append(pad)
        ids.append(r_ids)
        pos.append(r_pos)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return torch.tensor(ids), torch.tensor(pos), cu, max(lens), lens


def run_rows(model: Qwen3, ids: torch.Tensor) -> torch.Tensor:
    """Each row one document: hidden [B,T,D]."""
    b, t = ids.shape
    cu = torch.arange(0, b * t + 1, t, dtype=torch.int32)
    return model(ids, torch.arange(t).repeat(b, 1), cu, t)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


# --- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    dict(),  # tied, head_dim 32 != 64 / 4
    dict(tie_embeddings=False),
    dict(tie_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    dict(tie_embeddings=False, attention_bias=True),
])
def test_logits_match_transformers(tmp_path, overrides):
    path, args = make_model_dir(tmp_path, 97, seed=1, **overrides)
    if overrides.get("attention_bias"):  # biases are zero-initialised: make them count
        model = load_pretrained(path)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
        path = save_pretrained(model, tmp_path / "with-bias", dtype=torch.float32)
    ours, hf = load_pretrained(path), load_hf(path)
    assert set(ours.state_dict()) == set(k for k in hf.state_dict()
                                         if not (args.tie_embeddings and k == "lm_head.weight"))
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = ours.logits(run_rows(ours, ids))
        want = hf(input_ids=ids).logits
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)


def test_loads_a_transformers_written_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
                      num_key_value_heads=1, head_dim=24, tie_word_embeddings=False, rope_theta=5e5)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")  # several shards + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = load_pretrained(tmp_path / "hf")
    assert ours.args.rope_theta == 5e5 and ours.args.head_dim == 24
    ids = torch.randint(0, 61, (1, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel_err(ours.logits(run_rows(ours, ids)), hf(input_ids=ids).logits) <= 1e-5


# --- packing --------------------------------------------------------------------------------------
def packing_terms(args) -> int:
    """The no-leak check's rounding budget for a whole fp32 model (tests/kernels/_compare.py rounding_tolerance): its
    longest reduction (the model dim, the MLP's hidden dim, or a delta-rule chunk) once per layer. A document in a
    packed row and alone differ only in layout, so by reordered sums; a leak differs by O(1) of the output."""
    return args.num_layers * max(args.dim, args.ffn_dim, CHUNK)


def check_packed_equals_one_by_one(model, docs: list[list[int]], rows: list[list[int]], seq_len: int) -> None:
    """Packed rows of `docs` give each document's hidden states, the loss and every gradient of the documents run
    one by one, up to rounding (fp32). Shared by every designer architecture's test.

    Hidden states: no leak within packing_terms. The loss, a sum over the documents in another order: 1e-5
    relative (~80 eps, for a handful of O(1) terms). A gradient sums every token's contribution through every
    layer, in another order packed than one by one: terms = tokens × layers. Small parameters summed over every
    token (Qwen3.5's per-head dt_bias and A_log) cancel, which makes their error relative to the result largest
    (61 eps measured, of 380 allowed); a leak moves the gradients by O(1)."""
    ids, pos, cu, max_len, _ = packed_inputs(docs, rows, seq_len=seq_len)
    # labels: next token inside each document, nothing across boundaries or on padding
    labels, starts = torch.full_like(ids, -100), {}
    for r, row in enumerate(rows):
        off = 0
        for d in row:
            n = len(docs[d])
            labels[r, off : off + n - 1] = torch.tensor(docs[d][1:])
            starts[d] = (r, off)
            off += n
    hidden = model(ids, pos, cu, max_len)
    loss = linear_cross_entropy(hidden.reshape(-1, model.args.dim), model.lm_head_weight, labels.reshape(-1))
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0.0
    for d, doc in enumerate(docs):
        t = torch.tensor([doc])
        h = run_rows(model, t)
        r, off = starts[d]
        assert_no_leak(hidden[r, off : off + len(doc)], h[0], f"document {d}'s hidden states", torch.float32,
                       packing_terms(model.args))
        lab = torch.tensor(doc[1:] + [-100])
        total = total + linear_cross_entropy(h[0], model.lm_head_weight, lab)
    total.backward()
    assert abs(loss.item() - total.item()) <= 1e-5 * abs(total.item())
    terms = sum(map(len, docs)) * model.args.num_layers
    for n, p in model.named_parameters():
        assert_no_leak(packed_grads[n], p.grad, f"gradient of {n}", torch.float32, terms)


def test_packed_rows_equal_documents_one_by_one():
    torch.manual_seed(0)
    args = Qwen3Args.from_size("tiny", 53, attention_impl="sdpa")
    model = Qwen3(args).init_weights(5)
    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(0, 53, (n,), generator=g).tolist() for n in (5, 11, 1, 7, 9, 3)]
    check_packed_equals_one_by_one(model, docs, [[0, 1, 2], [3, 4], [5]], seq_len=20)


# --- HF I/O ---------------------------------------------------------------------------------------
def test_init_random_streams_init_weights_and_shards(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    one = init_random("tiny", tok_dir, tmp_path / "one", seed=3, dtype=torch.float32)
    many = init_random("tiny", tok_dir, tmp_path / "many", seed=3, dtype=torch.float32, max_shard_bytes=40_000)
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (many / "model.safetensors").exists()
    tok = AutoTokenizer.from_pretrained(str(one), local_files_only=True)
    a, b = load_pretrained(one), load_pretrained(many)
    ref = Qwen3(Qwen3Args.from_size("tiny", len(tok))).init_weights(3)
    assert a.args.vocab_size == len(tok) and a.args.eos_token_id == tok.eos_token_id
    for k, v in ref.state_dict().items():
        assert torch.equal(a.state_dict()[k], v) and torch.equal(b.state_dict()[k], v), k
    gen = json.loads((one / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    # bf16 on disk, and overwriting an existing directory is atomic (old contents replaced)
    init_random("tiny", tok_dir, one, seed=4)
    assert load_pretrained(one).model.embed_tokens.weight.dtype == torch.float32
    assert json.loads((one / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_config_round_trip_and_sizes():
    for size in SIZES:
        args = Qwen3Args.from_size(size, 151936, rope_scaling={"rope_type": "linear", "factor": 2.0})
        assert Qwen3Args.from_hf_config(args.to_hf_config()) == args
    from transformers import Qwen3Config

    cfg = Qwen3Config(**{k: v for k, v in Qwen3Args.from_size("8b", 151936).to_hf_config().items()
                         if k not in ("architectures", "dtype", "torch_dtype")})
    assert cfg.tie_word_embeddings is False and cfg.head_dim == 128
    # published parameter counts (Qwen3 model cards: 0.6B, 1.7B, 4.0B, 8.2B, 14.8B, 32.8B)
    expected = {"0.6b": 0.6, "1.7b": 1.7, "4b": 4.0, "8b": 8.2, "14b": 14.8, "32b": 32.8}
    for size, billions in expected.items():
        assert abs(num_params(Qwen3Args.from_size(size, 151936)) / 1e9 - billions) < 0.05, size


def test_bad_inputs_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_pretrained(tmp_path / "does-not-exist")
    path, _ = make_model_dir(tmp_path, 31)
    st = path / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        load_pretrained(path)
    st.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        load_pretrained(path)
    st.write_bytes(data)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"model\.safetensors: model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        load_pretrained(path)
    (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing weights.*layers\.2"):
        load_pretrained(path)
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json.*model_type"):
        load_pretrained(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_pretrained(path)


def test_forward_rejects_bad_shapes():
    model = Qwen3(Qwen3Args.from_size("tiny", 17))
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, torch.zeros(2, 5, dtype=torch.long), torch.tensor([0, 8], dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids, torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 8]), 8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        Qwen3Args.from_size("tiny", 17, num_kv_heads=3)


# --- FLOPs ----------------------------------------------------------------------------------------
def count_flops(model: Qwen3, ids, pos, cu, max_len) -> tuple[int, int]:
    """(matmul FLOPs, attention FLOPs) of one forward+backward as FlopCounterMode sees them.

    SDPA runs on the MATH backend so its matmuls are visible as bmm (the CPU fused kernel has no FLOP
    formula). Linear layers are mm; the attention matmuls are the only bmm.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    labels = ids.reshape(-1).roll(-1)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        hidden = model(ids, pos, cu, max_len)
        linear_cross_entropy(hidden.reshape(-1, model.args.dim), model.lm_head_weight, labels).backward()
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    matmul = ops.pop("aten.mm", 0) + ops.pop("aten.addmm", 0)
    attention = ops.pop("aten.bmm", 0)
    assert not ops, f"unexpected FLOP-counted ops {ops}"
    return matmul, attention


def check_flops_match_counter(model, vocab: int) -> tuple[list[int], int]:
    """model.matmul_flops and attention_flops equal what FlopCounterMode sees on two packed rows (shared by every
    designer architecture's test). Returns (segment lengths, head tokens) of the batch."""
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 11, 7, 9)]
    ids, pos, cu, max_len, lens = packed_inputs(docs, [[0, 1], [2, 3]], seq_len=18)
    matmul, attention = count_flops(model, ids, pos, cu, max_len)
    want_matmul = model.matmul_flops(sum(lens), head_tokens=ids.numel())
    assert abs(matmul - want_matmul) <= 0.02 * want_matmul, (matmul, want_matmul)
    # the counter charges the full L² square; causal attention does (and is credited) half of it
    assert attention == 2 * model.attention_flops(lens)
    return lens, ids.numel()


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_train_flops_match_flop_counter(mode):
    from atelier_studio.designer.lora import LoraArgs, apply_lora

    args = Qwen3Args.from_size("tiny", 67, tie_embeddings=(mode == "full"), attention_impl="sdpa")
    model = Qwen3(args).init_weights(0)
    if mode == "lora":
        apply_lora(model, LoraArgs(rank=4, alpha=8, targets=("q", "v", "down")))
        # With a frozen embedding, autograd skips the input-gradient of layer 0's q/k/v/gate/up (nothing
        # upstream needs it); train_flops counts every input-gradient, as docs/mfu.md's 2·N·T does. Let the
        # gradient flow to the embedding (whose backward is not a matmul) so both count the same work.
        model.model.embed_tokens.weight.requires_grad_(True)
    lens, head_tokens = check_flops_match_counter(model, 67)
    want_matmul = model.matmul_flops(sum(lens), head_tokens)
    assert model.train_flops(lens, head_tokens) == want_matmul + model.attention_flops(lens)
    if mode == "lora":  # frozen base weights get no weight-gradient FLOPs
        full = Qwen3(args)
        assert model.matmul_flops(10, 0) < full.matmul_flops(10, 0)


def test_full_finetuning_under_bf16_autocast_keeps_an_fp32_stream():
    """fp32 master weights under bf16 autocast (full fine-tuning): matmul outputs are bf16, the residual stream
    fp32 (as transformers' eager model); the fused add + norm promotes instead of rejecting the mix."""
    args = Qwen3Args.from_size("tiny", vocab_size=64)
    model = Qwen3(args).init_weights(0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).repeat(2, 1)
    cu = torch.tensor([0, 12, 24], dtype=torch.int32)
    want = model(ids, pos, cu, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(ids, pos, cu, 12)
    assert got.dtype == torch.float32  # the final norm keeps the stream's dtype: the stream stayed fp32
    got.float().pow(2).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert (got.float() - want).abs().max() < 0.1 * want.abs().max()
