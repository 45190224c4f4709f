"""Bad input through the real CLI: one table of cases, each a clear one-line error, status 2, nothing half-written.

Each row of CASES builds one bad input under the test's tmp directory, runs the command through the CLI's
entry point (`atelier_studio.flows.cli.main`, which `python -m atelier_studio.flows.cli` exits with; rows marked
`subprocess`, and the disk-full row, run `python -m atelier_studio.flows.cli` itself in a subprocess) and checks:

- the exit status (2: a user-fixable error);
- stderr is exactly one line, `atelier: error: ...`, with no traceback, containing every `expect` substring
  (the file, line, key or path, and what is wrong);
- no path matching an `absent` glob exists afterwards (e.g. the run directory, a half-written shard set),
  every file matching an `unchanged` glob has the bytes it had before the command, and no temporary or
  aside name of pipeline/atomic.py is left anywhere under tmp.

In this process, stderr is what Python code writes to sys.stderr (pytest collects warnings elsewhere); a
subprocess row checks the whole stream of a real command. A new bad input is one more row. `{tmp}` in
`expect` is the case's directory, `{fixture}` the designer's fixture JSONL. Disk full is simulated in the
subprocess with RLIMIT_FSIZE (writes past the limit fail with EFBIG; Python ignores SIGXFSZ), the same
errno path as ENOSPC.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

from atelier_studio.flows.cli import build_parser, main
from atelier_studio.pipeline.atomic import is_temporary

ROOT = Path(__file__).parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "designer" / "briefs.jsonl"
DESIGNER_DEMO = ROOT / "configs" / "designer" / "demo.toml"
IMAGEGEN_DEMO = ROOT / "configs" / "imagegen" / "demo.toml"
NOT_UTF8 = b"\xff\xfe not utf-8"  # 0xff never occurs in UTF-8
DISK_LIMIT = 32 * 1024  # bytes a file may grow to in the disk-full case: above config.toml and metrics.jsonl


@dataclass(frozen=True)
class World:
    """A tokenizer and a tiny random Qwen3 (fp32), built once for the module."""

    tokenizer: Path
    model: Path


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path, World], list[str]]  # makes the bad input under tmp; returns the argv after `atelier`
    expect: tuple[str, ...]  # substrings of the one error line
    absent: tuple[str, ...] = ()  # globs under tmp that must match nothing afterwards
    unchanged: tuple[str, ...] = ()  # globs under tmp whose files must keep their bytes
    status: int = 2
    file_size_limit: int | None = None  # RLIMIT_FSIZE of the command (a full disk); runs it in a subprocess
    subprocess: bool = False  # run `python -m atelier_studio.flows.cli` in a subprocess instead of `main()` in this one


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    d = tmp_path_factory.mktemp("bad-input-world")
    assert main(["data", "tokenizer", "--corpus", str(FIXTURE), "--vocab-size", "400", "--out", str(d / "tok")]) == 0
    assert main(["designer", "init", "--size", "tiny", "--tokenizer", str(d / "tok"), "--out", str(d / "model"),
                 "--dtype", "float32"]) == 0
    return World(d / "tok", d / "model")


# ----------------------------------------------------------------------------- building bad inputs


def designer_train(tmp: Path, w: World, *sets: str, config: Path = DESIGNER_DEMO) -> list[str]:
    """`designer train` on the fixture data: 2 steps, no saves but the last, output in tmp/run; `sets` override."""
    base = {"model.path": w.model, "data.train": FIXTURE, "data.eval": "", "data.seq_len": 128,
            "train.micro_batch": 2, "train.max_steps": 2, "train.warmup_steps": 1, "train.save_every": 0,
            "train.eval_every": 0, "train.log_every": 1, "output.tensorboard": "false", "output.dir": tmp / "run"}
    argv = ["designer", "train", "--config", str(config)]
    for item in [f"{k}={v}" for k, v in base.items()] + list(sets):
        argv += ["--set", item]
    return argv


def qwen35_tiny(tmp: Path, w: World) -> Path:
    """A tiny random Qwen3.5 (fp32) with the world's tokenizer."""
    assert main(["designer", "init", "--size", "qwen3.5-tiny", "--tokenizer", str(w.tokenizer), "--out",
                 str(tmp / "qwen35"), "--dtype", "float32"]) == 0
    return tmp / "qwen35"


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def moe_model(tmp: Path, w: World, drop: str = "") -> Path:
    """A tiny Qwen3-MoE directory (`designer init`) in tmp/moe; with `drop`, that key taken out of its config.json."""
    assert main(["designer", "init", "--size", "qwen3-moe-tiny", "--tokenizer", str(w.tokenizer), "--out",
                 str(tmp / "moe"), "--dtype", "float32"]) == 0
    if drop:
        cfg = json.loads((tmp / "moe" / "config.json").read_text())
        (tmp / "moe" / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != drop}))
    return tmp / "moe"


def fixture_lines(n: int) -> list[bytes]:
    return FIXTURE.read_bytes().splitlines(keepends=True)[:n]


def png_bytes(seed: int, side: int = 24) -> bytes:
    """A noise PNG: noise does not compress, so the pixel data (IDAT) is most of the file."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_set(tmp: Path, n: int = 3, images: dict[str, bytes] | None = None,
              lines: list[bytes] | None = None) -> list[str]:
    """tmp/images/img<i>.png and tmp/captions.jsonl (`images` replaces files, `lines` the JSONL); the shards argv."""
    for i in range(n):
        write(tmp / "images" / f"img{i}.png", png_bytes(i))
    for name, data in (images or {}).items():
        write(tmp / "images" / name, data)
    if lines is None:
        lines = [json.dumps({"image": f"img{i}.png", "caption": f"a red square, number {i}"}).encode() + b"\n"
                 for i in range(n)]
    write(tmp / "captions.jsonl", b"".join(lines))
    return ["data", "shards", "--images", str(tmp / "images"), "--captions", str(tmp / "captions.jsonl"),
            "--out", str(tmp / "shards"), "--shard-size", "1"]


def good_shards(tmp: Path, n: int = 3) -> Path:
    """A complete image shard set at tmp/shards (one sample per shard), written in-process."""
    assert main(image_set(tmp, n)) == 0
    return tmp / "shards"


def caption_row(image: str, caption: str = "a blue circle") -> bytes:
    return json.dumps({"image": image, "caption": caption}).encode() + b"\n"


# a designer world that fails at the save: the checkpoint is far larger than the file-size limit
def disk_full_at_checkpoint(tmp: Path, w: World) -> list[str]:
    model_bytes = (w.model / "model.safetensors").stat().st_size
    assert model_bytes > 4 * DISK_LIMIT, "the checkpoint must not fit under the limit, or the case cannot fail"
    return designer_train(tmp, w, "train.max_steps=1", "lora.rank=0")


def truncated_checkpoint(tmp: Path, w: World) -> list[str]:
    assert main(designer_train(tmp, w, "train.save_every=1")) == 0
    f = tmp / "run" / "checkpoints" / "step-2" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    return designer_train(tmp, w, "train.save_every=1", "train.max_steps=4")


def resume_with_another_seq_len(tmp: Path, w: World) -> list[str]:
    assert main(designer_train(tmp, w, "train.save_every=1")) == 0
    return designer_train(tmp, w, "train.save_every=1", "train.max_steps=4", "data.seq_len=256")


def shard_with_undecodable_image(tmp: Path, w: World) -> list[str]:
    shards = good_shards(tmp)
    with tarfile.open(shards / "shard-000001.tar") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shards / "shard-000001.tar", "w") as tar:
        for m, data in members:
            data = data[:40] + b"\x00" * (len(data) - 40) if m.name.endswith(".png") else data  # same size, bad body
            tar.addfile(m, io.BytesIO(data))
    return ["data", "validate", str(shards)]


def truncated_tar(tmp: Path, w: World) -> list[str]:
    f = good_shards(tmp) / "shard-000002.tar"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    return ["data", "validate", str(tmp / "shards")]


def index_count_mismatch(tmp: Path, w: World) -> list[str]:
    index = good_shards(tmp) / "index.json"
    data = json.loads(index.read_text())
    data["shards"][0]["count"] = 5
    index.write_text(json.dumps(data))
    return ["data", "validate", str(tmp / "shards")]


def missing_shard(tmp: Path, w: World) -> list[str]:
    (good_shards(tmp) / "shard-000001.tar").unlink()
    return ["data", "validate", str(tmp / "shards")]


def failed_rewrite_of_a_shard_set(tmp: Path, w: World) -> list[str]:
    good_shards(tmp)  # a complete set is there; the new one fails at line 3
    lines = [caption_row("img0.png"), caption_row("img1.png"), caption_row("img9.png")]
    return image_set(tmp, lines=lines)


SD3_CONFIG = ROOT / "configs" / "imagegen" / "sd3-medium.toml"


def sd3_index(tmp: Path, scheduler: dict | None = None, **parts) -> Path:
    """An SD3 pipeline directory's model_index.json (and scheduler config), without the models: what the checks
    that run before anything is loaded read."""
    index = {"_class_name": "StableDiffusion3Pipeline", **{k: ["transformers", "X"] for k in (
        "transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer",
        "tokenizer_2", "tokenizer_3")}, **parts}
    write(tmp / "pipe" / "model_index.json", json.dumps(index))
    if scheduler is not None:
        write(tmp / "pipe" / "scheduler" / "scheduler_config.json",
              json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, **scheduler}))
    return tmp / "pipe"


def sd3_cache(tmp: Path, *sets: str) -> list[str]:
    argv = ["imagegen", "cache", "--config", str(SD3_CONFIG), "--out", str(tmp / "latents"),
            "--set", f"data.image_shards={tmp / 'shards'}"]
    return argv + [a for s in sets for a in ("--set", s)]


def sd3_copy(tmp: Path, w: World, damage: Callable[[Path], object]) -> Path:
    """A copy at tmp/pipe of a tiny random SD3 pipeline (built once beside the world), `damage`d."""
    from tests.imagegen._sd3 import build_pipeline

    shutil.copytree(build_pipeline(w.model.parent / "sd3-pipe"), tmp / "pipe")
    damage(tmp / "pipe")
    return tmp / "pipe"


def cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def garbage_header(path: Path) -> None:
    """The 8-byte length intact, the JSON header overwritten with bytes that are not UTF-8."""
    data = bytearray(path.read_bytes())
    data[8:40] = NOT_UTF8 * 2 + NOT_UTF8[:4]
    path.write_bytes(bytes(data))


def sd3_sample(tmp: Path, pipe: Path) -> list[str]:
    return ["imagegen", "sample", "--model", str(pipe), "--captions", str(write(tmp / "c.txt", "a red square\n")),
            "--out", str(tmp / "samples")]


def sd3_sample_with_karras_sigmas(tmp: Path, w: World) -> list[str]:
    pipe = sd3_index(tmp, scheduler={"use_karras_sigmas": True})
    return ["imagegen", "sample", "--model", str(pipe), "--captions", str(write(tmp / "c.txt", "a red square\n")),
            "--out", str(tmp / "samples")]


def eval_args(tmp: Path, w: World) -> list[str]:
    write(tmp / "mmdit" / "config.json", "{}")  # only its presence is checked before the briefs are read
    write(tmp / "briefs.txt", b"a calm circle\n" + NOT_UTF8 + b"\n")
    return ["eval", "--designer", str(w.model), "--imagegen", str(tmp / "mmdit"), "--briefs", str(tmp / "briefs.txt"),
            "--out", str(tmp / "eval")]


def imagegen_lora_train(tmp: Path, *sets: str, adapter_rank: int = 0) -> list[str]:
    """`imagegen train` on the demo config with a tiny random MMDiT at tmp/mmdit and LoRA on; with `adapter_rank`, a
    LoRA file of that rank for it at tmp/adapter. The checks under test run before any data is read."""
    import torch

    from atelier_studio.imagegen.hf import init_random, load_pretrained
    from atelier_studio.imagegen.lora import apply_lora, save_lora, target_modules
    from atelier_studio.pipeline.lora import LoraArgs

    init_random("tiny", tmp / "mmdit", dtype=torch.float32)
    if adapter_rank:
        model, lora = load_pretrained(tmp / "mmdit"), LoraArgs(rank=adapter_rank, alpha=adapter_rank)
        save_lora(apply_lora(model, lora, target_modules(model, ("attn.to_q",))), lora, tmp / "adapter")
    argv = ["imagegen", "train", "--config", str(IMAGEGEN_DEMO), "--set", f"model.path={tmp / 'mmdit'}",
            "--set", f"output.dir={tmp / 'run'}"]
    return argv + [a for item in ("lora.rank=4", *sets) for a in ("--set", item)]


def train_on(tmp: Path, w: World, key: str, name: str, data: str | bytes) -> list[str]:
    """`designer train` with data.train or data.eval (`key`) pointing at tmp/name holding `data`."""
    return designer_train(tmp, w, f"{key}={write(tmp / name, data)}")


def dpo_on(tmp: Path, w: World, data: str, *sets: str) -> list[str]:
    """`designer train` with train.objective = "dpo" on tmp/pairs.jsonl holding `data` (rows long enough for a pair)."""
    return designer_train(tmp, w, f"data.train={write(tmp / 'pairs.jsonl', data)}", "train.objective=dpo",
                          "data.seq_len=256", *sets)


PAIR = {"brief": "a calm circle", "chosen": "a small blue circle", "rejected": "a large red square"}


def broken_model(tmp: Path, w: World, name: str, cut: int | None = None, text: str | None = None) -> list[str]:
    """A copy of the tiny model with file `name` cut to `cut` bytes or replaced by `text`; `designer train` on it."""
    shutil.copytree(w.model, tmp / "model")
    f = tmp / "model" / name
    f.write_bytes(f.read_bytes()[:cut] if text is None else text.encode())
    return designer_train(tmp, w, f"model.path={tmp / 'model'}")


def output_dir_is_a_file(tmp: Path, w: World) -> list[str]:
    write(tmp / "run", "a file")
    return designer_train(tmp, w)


def generate(tmp: Path, w: World, briefs: Path, out: Path) -> list[str]:
    return ["designer", "generate", "--model", str(w.model), "--briefs", str(briefs), "--out", str(out)]


def generate_into_a_directory(tmp: Path, w: World) -> list[str]:
    (tmp / "outdir").mkdir()
    return generate(tmp, w, write(tmp / "briefs.txt", "a calm circle\n"), tmp / "outdir")


def shards_into_a_file(tmp: Path, w: World) -> list[str]:
    write(tmp / "shards", "a file")
    return image_set(tmp)


def shards_into_other_files(tmp: Path, w: World) -> list[str]:
    write(tmp / "shards" / "notes.txt", "not a shard")
    return image_set(tmp)


LONG_BRIEF = "a calm circle " * 7500  # 105 KB on one line: far past the tiny designer's context


def long_brief_file(tmp: Path) -> Path:
    return write(tmp / "briefs.txt", "a calm circle\n" + LONG_BRIEF + "\n")


def render_args(tmp: Path, w: World) -> list[str]:
    write(tmp / "mmdit" / "config.json", "{}")  # only its presence is checked before the designer runs
    return ["render", "--designer", str(w.model), "--imagegen", str(tmp / "mmdit"), "--briefs",
            str(long_brief_file(tmp)), "--out", str(tmp / "render")]


def sample_at(tmp: Path, resolution: int) -> list[str]:
    """`imagegen sample` of a tiny random MMDiT with the demo config's settings at `resolution` pixels."""
    import torch

    from atelier_studio.imagegen.hf import init_random

    init_random("tiny", tmp / "mmdit", dtype=torch.float32)
    return ["imagegen", "sample", "--model", str(tmp / "mmdit"), "--config", str(IMAGEGEN_DEMO), "--captions",
            str(write(tmp / "c.txt", "a red square\n")), "--out", str(tmp / "samples"), "--resolution",
            str(resolution)]


EMPTY_CAPTION = '{"brief": "a calm circle", "caption": ""}\n'

CASES = [
    # ---------------------------------------------------------------- configs
    Case("config-unknown-key", lambda t, w: designer_train(t, w, "train.lr_max=1"),
         ("train.lr_max: unknown key",), absent=("run",)),
    Case("config-wrong-type", lambda t, w: designer_train(t, w, "train.micro_batch=two"),
         ("train.micro_batch: expected an integer",), absent=("run",)),
    Case("config-bool-for-a-choice",
         lambda t, w: designer_train(t, w, "train.distributed.activation_checkpointing=true"),
         ("train.distributed.activation_checkpointing", "selective"), absent=("run",)),
    Case("config-file-missing", lambda t, w: designer_train(t, w, config=t / "nope.toml"),
         ("config file not found", "{tmp}/nope.toml"), absent=("run",)),
    Case("config-invalid-toml", lambda t, w: designer_train(t, w, config=write(t / "bad.toml", "[train\nlr = ")),
         ("{tmp}/bad.toml: invalid TOML",), absent=("run",)),
    Case("config-not-utf8",
         lambda t, w: designer_train(t, w, config=write(t / "bad.toml", b"[train]\nlr = 1e-3\n# " + NOT_UTF8)),
         ("{tmp}/bad.toml:3: not valid UTF-8",), absent=("run",)),
    # the family is known only from model.path's config.json, so the names are checked when the run starts
    Case("lora-target-not-in-the-family", lambda t, w: designer_train(t, w, "lora.rank=4", "lora.targets=q,qkv"),
         ("lora.targets", "['qkv'] are not Qwen3 linears", "q, k, v, o, gate, up, down"), absent=("run/checkpoints",)),
    Case("router-aux-loss-on-a-dense-model", lambda t, w: designer_train(t, w, "model.router_aux_loss=on"),
         ("model.router_aux_loss = 'on'", "Qwen3 models have no auxiliary loss"), absent=("run",)),
    Case("moe-config-without-its-expert-keys",
         lambda t, w: designer_train(t, w, f"model.path={moe_model(t, w, drop='moe_intermediate_size')}"),
         ("{tmp}/moe/config.json", "missing keys ['moe_intermediate_size']"), absent=("run",)),
    Case("lora-dropout-on-experts",
         lambda t, w: designer_train(t, w, f"model.path={moe_model(t, w)}", "lora.rank=4", "lora.dropout=0.1"),
         ("lora.dropout = 0.1", "gate, up, down adapters are one per expert", "lora.dropout = 0"), absent=("run",)),
    Case("lora-alpha-negative", lambda t, w: designer_train(t, w, "lora.rank=4", "lora.alpha=-1"),
         ("lora.alpha: must be >= 0", "0 = the rank"), absent=("run",)),
    Case("qlora-with-full-finetuning", lambda t, w: designer_train(t, w, "lora.rank=0", "lora.base_dtype=nf4"),
         ('lora.base_dtype: "nf4"', "rank = 0 is full fine-tuning", "lora.rank > 0"), absent=("run",)),
    Case("qlora-with-fp8", lambda t, w: designer_train(t, w, "lora.rank=4", "lora.base_dtype=nf4",
                                                         "train.precision=fp8"),
         ('lora.base_dtype = "nf4" with train.precision = "fp8"',), absent=("run",)),
    Case("qlora-with-an-fsdp-param-dtype",
         lambda t, w: designer_train(t, w, "lora.rank=4", "lora.base_dtype=nf4",
                                     "train.distributed.param_dtype=bfloat16"),
         ('train.distributed.param_dtype = "bfloat16" with lora.base_dtype = "nf4"', '"auto"'), absent=("run",)),
    # Qwen3.5-tiny's out_proj reads 96 features: not whole blocks of 64, so no target is left to quantise
    Case("qlora-nothing-to-quantise",
         lambda t, w: designer_train(t, w, f"model.path={qwen35_tiny(t, w)}", "lora.rank=4", "lora.targets=out",
                                     "lora.base_dtype=nf4"),
         ('lora.base_dtype = "nf4"', "no LoRA target of this Qwen3.5 model", "multiple of 64", "out_proj"),
         absent=("run/checkpoints",)),
    Case("warmup-longer-than-the-run", lambda t, w: designer_train(t, w, "train.max_steps=5", "train.warmup_steps=20"),
         ("train.warmup_steps", "max_steps 5", "<= 5"), absent=("run",)),
    Case("imagegen-ema-decay-out-of-range",
         lambda t, w: ["imagegen", "train", "--config", str(IMAGEGEN_DEMO), "--set", "ema.decay=1.5",
                       "--set", f"output.dir={t / 'run'}"],
         ("ema.decay", "[0, 1)"), absent=("run",)),
    Case("imagegen-resolution-zero",
         lambda t, w: ["imagegen", "train", "--config", str(IMAGEGEN_DEMO), "--set", "data.resolution=0",
                       "--set", f"output.dir={t / 'run'}"],
         ("data.resolution",), absent=("run",)),
    Case("imagegen-resolution-and-resolutions",
         lambda t, w: ["imagegen", "train", "--config", str(IMAGEGEN_DEMO), "--set", "data.resolutions=[16,32]",
                       "--set", f"output.dir={t / 'run'}"],
         ("data.resolution (32) and resolutions ([16, 32])", "set one of them"), absent=("run",)),
    Case("imagegen-resolutions-listed-twice",
         lambda t, w: ["imagegen", "train", "--config", str(IMAGEGEN_DEMO), "--set", "data.resolution=0",
                       "--set", "data.resolutions=[32,16,32]", "--set", f"output.dir={t / 'run'}"],
         ("data.resolutions", "32 is listed twice"), absent=("run",)),
    Case("imagegen-negative-streams",
         lambda t, w: ["imagegen", "train", "--config", str(IMAGEGEN_DEMO), "--set", "data.streams=-2",
                       "--set", f"output.dir={t / 'run'}"],
         ("data.streams", ">= 0", "-2"), absent=("run",)),
    # the MMDiT's LoRA targets are diffusers' module paths inside a block; the family is known from model.path
    Case("imagegen-lora-target-not-in-the-mmdit", lambda t, w: imagegen_lora_train(t, "lora.targets=to_q,to_x"),
         ("lora.targets", "['to_x'] match no MMDiT linear", "attn.to_q"), absent=("run",)),
    Case("imagegen-lora-negative-rank", lambda t, w: imagegen_lora_train(t, "lora.rank=-1"),
         ("lora.rank", ">= 0", "-1"), absent=("run",)),
    Case("imagegen-lora-init-adapter-of-another-rank",
         lambda t, w: imagegen_lora_train(t, f"lora.init_adapter={t / 'adapter'}", adapter_rank=8),
         ("lora.init_adapter", "{tmp}/adapter has rank 8", "lora.rank = 8"), absent=("run",)),
    Case("sd3-pipeline-without-t5",
         lambda t, w: sd3_cache(t, f"model.path={sd3_index(t, text_encoder_3=[None, None])}", "autoencoder.spec=pixel"),
         ("{tmp}/pipe: this pipeline has no text_encoder_3", "text.use_t5 = false"), absent=("latents",),
         subprocess=True),  # a fresh process: what diffusers and torchao print at import reaches the stream
    Case("sd3-not-an-sd3-pipeline",
         lambda t, w: sd3_cache(t, f"model.path={sd3_index(t, _class_name='FluxPipeline')}", "autoencoder.spec=pixel"),
         ("{tmp}/pipe/model_index.json", "_class_name is 'FluxPipeline'", "StableDiffusion3Pipeline"),
         absent=("latents",)),
    Case("sd3-spec-model-without-vae", lambda t, w: sd3_cache(t, f"model.path={t / 'plain'}"),
         ("no AutoencoderKL found at {tmp}/plain", "vae"), absent=("latents",)),
    # the parts of a pipeline, each checked before transformers / diffusers read it (pipeline/hf_files.py)
    Case("sd3-tokenizer-without-its-vocabulary",
         lambda t, w: sd3_sample(t, sd3_copy(t, w, lambda p: (p / "tokenizer_2" / "tokenizer.json").unlink())),
         ("{tmp}/pipe/tokenizer_2", "no tokenizer vocabulary", "vocab.json + merges.txt"), absent=("samples",)),
    Case("sd3-t5-weights-truncated",
         lambda t, w: sd3_sample(t, sd3_copy(t, w, lambda p: cut(p / "text_encoder_3" / "model.safetensors", 5000))),
         ("{tmp}/pipe/text_encoder_3/model.safetensors", "truncated"), absent=("samples",)),
    Case("sd3-transformer-weights-truncated",
         lambda t, w: sd3_sample(t, sd3_copy(t, w, lambda p: cut(
             p / "transformer" / "diffusion_pytorch_model.safetensors", 20000))),
         ("{tmp}/pipe/transformer/diffusion_pytorch_model.safetensors", "truncated"), absent=("samples",)),
    Case("sd3-transformer-garbage-header",
         lambda t, w: sd3_sample(t, sd3_copy(t, w, lambda p: garbage_header(
             p / "transformer" / "diffusion_pytorch_model.safetensors"))),
         ("{tmp}/pipe/transformer/diffusion_pytorch_model.safetensors", "corrupt safetensors header"),
         absent=("samples",)),
    Case("sd3-vae-without-weights",
         lambda t, w: sd3_sample(t, sd3_copy(t, w, lambda p: (p / "vae" / "diffusion_pytorch_model.safetensors")
                                             .unlink())),
         ("vae {tmp}/pipe/vae", "no safetensors weights"), absent=("samples",)),
    Case("sd3-max-sequence-length-too-long",
         lambda t, w: sd3_cache(t, "model.path=x", "text.max_sequence_length=600"),
         ("text.max_sequence_length", "[1, 512]", "600"), absent=("latents",)),
    Case("sd3-unsupported-scheduler", sd3_sample_with_karras_sigmas,
         ("{tmp}/pipe/scheduler/scheduler_config.json", "use_karras_sigmas"), absent=("samples",)),
    # ---------------------------------------------------------------- designer training data
    Case("jsonl-malformed-line",
         lambda t, w: train_on(t, w, "data.train", "bad.jsonl", b"".join(fixture_lines(1)) + b"{x\n"),
         ("{tmp}/bad.jsonl:2", "malformed JSON"), absent=("run",)),
    Case("jsonl-empty-caption", lambda t, w: train_on(t, w, "data.train", "bad.jsonl", EMPTY_CAPTION),
         ("{tmp}/bad.jsonl:1", "caption is empty"), absent=("run",)),
    Case("jsonl-not-utf8",
         lambda t, w: train_on(t, w, "data.train", "bad.jsonl", b"".join(fixture_lines(2)) + NOT_UTF8),
         ("{tmp}/bad.jsonl:3", "not valid UTF-8", "0xff"), absent=("run",)),
    Case("eval-jsonl-not-utf8", lambda t, w: train_on(t, w, "data.eval", "eval.jsonl", NOT_UTF8 + b"\n"),
         ("{tmp}/eval.jsonl:1", "not valid UTF-8"), absent=("run",)),
    Case("data-no-known-format", lambda t, w: train_on(t, w, "data.train", "bad.csv", "question,answer\nq,a\n"),
         ("{tmp}/bad.csv row 1", "no known format in the columns (answer, question)"), absent=("run",)),
    Case("data-ambiguous-format",
         lambda t, w: train_on(t, w, "data.train", "bad.json", '[{"prompt": "p", "completion": "c", "brief": "b", '
                                                               '"caption": "c"}]'),
         ("{tmp}/bad.json row 1", "fit the formats brief_caption and prompt_completion", "set data.format"),
         absent=("run",)),
    Case("dpo-pair-identical",
         lambda t, w: dpo_on(t, w, json.dumps(PAIR) + "\n" + json.dumps({**PAIR, "rejected": PAIR["chosen"]}) + "\n"),
         ("{tmp}/pairs.jsonl:2", "chosen and rejected are the same text"), absent=("run",)),
    Case("dpo-pair-missing-rejected",
         lambda t, w: dpo_on(t, w, json.dumps({"brief": "b", "chosen": "c"}) + "\n"),
         ("{tmp}/pairs.jsonl:1", "looks like brief_pair but has no column 'rejected'"), absent=("run",)),
    Case("dpo-pair-longer-than-a-row",
         lambda t, w: dpo_on(t, w, json.dumps(PAIR) + "\n", "data.seq_len=40"),
         ("data.seq_len = 40", "{tmp}/pairs.jsonl:1", "set data.seq_len >=", "data.overflow = \"drop\""),
         absent=("run",)),
    Case("dpo-on-caption-data", lambda t, w: designer_train(t, w, "train.objective=dpo"),
         ("{fixture}", "one answer per prompt", "preference pairs"), absent=("run",)),
    Case("jsonl-missing", lambda t, w: designer_train(t, w, f"data.train={t / 'missing.jsonl'}"),
         ("{tmp}/missing.jsonl: no such file",), absent=("run",)),
    Case("seq-len-shorter-than-a-brief", lambda t, w: designer_train(t, w, "data.seq_len=16"),
         ("data.seq_len = 16", "{fixture}:1", "set data.seq_len >="), absent=("run",)),
    Case("overflow-drop-leaves-nothing", lambda t, w: designer_train(t, w, "data.seq_len=16", "data.overflow=drop"),
         ("{fixture}: all", "data.overflow = \"drop\" left every one out", "raise data.seq_len"), absent=("run",)),
    Case("model-dir-missing", lambda t, w: designer_train(t, w, f"model.path={t / 'no-such-model'}"),
         ("model.path: {tmp}/no-such-model is not a directory",), absent=("run",)),
    Case("model-config-not-json", lambda t, w: broken_model(t, w, "config.json", text="{oops"),
         ("{tmp}/model/config.json:1: invalid JSON",), absent=("run",)),
    Case("model-weights-truncated", lambda t, w: broken_model(t, w, "model.safetensors", cut=4096),
         ("{tmp}/model/model.safetensors", "truncated file"), absent=("run",)),
    # ---------------------------------------------------------------- outputs
    Case("output-dir-is-a-file", output_dir_is_a_file,
         ("output.dir {tmp}/run: exists and is a file",), unchanged=("run",)),
    Case("output-dir-under-a-file", lambda t, w: designer_train(t, w, f"output.dir={write(t / 'file', 'x') / 'run'}"),
         ("output.dir {tmp}/file/run", "{tmp}/file is a file"), unchanged=("file",)),
    Case("disk-full-at-the-checkpoint", disk_full_at_checkpoint,
         ("checkpoint {tmp}/run/checkpoints/step-1", "model.safetensors", "lack of space", "file-size limit"),
         absent=("run/checkpoints/step-*", "run/checkpoints/.step-*"), file_size_limit=DISK_LIMIT),
    Case("truncated-checkpoint-on-resume", truncated_checkpoint,
         ("{tmp}/run/checkpoints/step-2/model.safetensors", "truncated"), unchanged=("run/checkpoints/*/*",)),
    Case("resume-with-another-seq-len", resume_with_another_seq_len, ("data.seq_len", "128", "256"),
         unchanged=("run/checkpoints/*/*",)),
    Case("nproc-zero", lambda t, w: designer_train(t, w) + ["--nproc", "0"], ("--nproc 0",), absent=("run",)),
    # ---------------------------------------------------------------- designer generate / init, tokenizer, synth
    Case("briefs-not-utf8",
         lambda t, w: generate(t, w, write(t / "briefs.txt", b"a calm circle\n" + NOT_UTF8 + b"\n"), t / "c.jsonl"),
         ("{tmp}/briefs.txt:2", "not valid UTF-8"), absent=("c.jsonl",)),
    Case("briefs-missing", lambda t, w: generate(t, w, t / "nope.txt", t / "c.jsonl"),
         ("{tmp}/nope.txt: briefs file not found",), absent=("c.jsonl",)),
    Case("generate-out-is-a-directory", generate_into_a_directory, ("--out {tmp}/outdir: is a directory",)),
    Case("init-unknown-size",
         lambda t, w: ["designer", "init", "--size", "huge", "--tokenizer", str(w.tokenizer), "--out", str(t / "m")],
         ("unknown designer size 'huge'",), absent=("m",)),
    Case("imagegen-init-unknown-size", lambda t, w: ["imagegen", "init", "--size", "huge", "--out", str(t / "m")],
         ("unknown imagegen size 'huge'",), absent=("m",)),
    Case("imagegen-init-sample-size-not-whole-patches",
         lambda t, w: ["imagegen", "init", "--size", "tiny", "--out", str(t / "m"), "--sample-size", "1"],
         ("--sample-size 1", "multiple of patch_size = 2"), absent=("m",)),
    Case("imagegen-init-sample-size-past-the-positions",
         lambda t, w: ["imagegen", "init", "--size", "tiny", "--out", str(t / "m"), "--sample-size", "2000"],
         ("--sample-size 2000", "pos_embed_max_size"), absent=("m",)),
    Case("corpus-not-utf8",
         lambda t, w: ["data", "tokenizer", "--corpus", str(write(t / "corpus.txt", b"one\ntwo\n" + NOT_UTF8)),
                       "--vocab-size", "300", "--out", str(t / "tok")],
         ("{tmp}/corpus.txt:3", "not valid UTF-8"), absent=("tok",)),
    Case("synth-out-is-a-file", lambda t, w: ["data", "synth", "--out", str(write(t / "world", "x")), "--n", "10"],
         ("{tmp}/world", "is a file, not a directory"), unchanged=("world",)),
    # ---------------------------------------------------------------- data shards
    Case("shards-corrupt-png", lambda t, w: image_set(t, images={"img1.png": b"this is not a png"}),
         ("{tmp}/captions.jsonl:2", "cannot decode image {tmp}/images/img1.png (not an image format"),
         absent=("shards",)),
    Case("shards-zero-byte-image", lambda t, w: image_set(t, images={"img1.png": b""}),
         ("{tmp}/captions.jsonl:2", "is empty (0 bytes)"), absent=("shards",)),
    Case("shards-missing-image", lambda t, w: image_set(t, lines=[caption_row("img0.png"), caption_row("nope.png")]),
         ("{tmp}/captions.jsonl:2", "image file not found", "nope.png"), absent=("shards",)),
    Case("shards-png-body-cut-off", lambda t, w: image_set(t, images={"img2.png": png_bytes(7, side=64)[:6000]}),
         ("{tmp}/captions.jsonl:3", "cannot decode image", "img2.png"), absent=("shards",), subprocess=True),
    Case("shards-captions-not-utf8", lambda t, w: image_set(t, lines=[caption_row("img0.png"), NOT_UTF8 + b"\n"]),
         ("{tmp}/captions.jsonl:2", "not valid UTF-8"), absent=("shards",)),
    Case("shards-malformed-json", lambda t, w: image_set(t, lines=[caption_row("img0.png"), b"{oops\n"]),
         ("{tmp}/captions.jsonl:2", "invalid JSON"), absent=("shards",)),
    Case("shards-out-is-a-file", shards_into_a_file, ("{tmp}/shards: exists and is a file",), unchanged=("shards",)),
    Case("shards-out-holds-other-files", shards_into_other_files, ("{tmp}/shards", "not a shard set"),
         unchanged=("shards/*",)),
    Case("shards-size-zero", lambda t, w: image_set(t)[:-1] + ["0"], ("--shard-size 0", "must be >= 1"),
         absent=("shards",)),
    Case("shards-failed-rewrite-keeps-the-old-set", failed_rewrite_of_a_shard_set,
         ("{tmp}/captions.jsonl:3", "img9.png"), unchanged=("shards/*",)),
    # ---------------------------------------------------------------- data validate
    Case("validate-missing-folder", lambda t, w: ["data", "validate", str(t / "nope")],
         ("{tmp}/nope: no such directory",), subprocess=True),
    Case("validate-undecodable-image", shard_with_undecodable_image,
         ("{tmp}/shards: 1 bad sample (shard-000001.tar: 1 undecodable image)",), unchanged=("shards/*",)),
    Case("validate-truncated-tar", truncated_tar, ("shard-000002.tar", "truncated tar"), unchanged=("shards/*",)),
    Case("validate-index-count-mismatch", index_count_mismatch,
         ("shard-000000.tar: index.json says 5 samples, read 1 good + 0 bad",), unchanged=("shards/*",)),
    Case("validate-listed-shard-missing", missing_shard, ("shard-000001.tar: listed in index.json but missing",)),
    # ---------------------------------------------------------------- sampling and evaluation inputs
    Case("sample-captions-not-utf8",
         lambda t, w: ["imagegen", "sample", "--model", str(t / "m"), "--captions",
                       str(write(t / "captions.txt", NOT_UTF8)), "--out", str(t / "samples")],
         ("{tmp}/captions.txt:1", "not valid UTF-8"), absent=("samples",)),
    Case("eval-briefs-not-utf8", eval_args, ("{tmp}/briefs.txt:2", "not valid UTF-8"), absent=("eval",)),
    Case("eval-zero-sampling-steps", lambda t, w: eval_args(t, w) + ["--steps", "0"],
         ("--steps 0", "must be >= 1", "Euler steps"), absent=("eval",)),
    # a brief longer than the designer's context: named by file:line with the limit, and (render, eval) the output
    # folder the command had started is gone
    Case("generate-brief-too-long", lambda t, w: generate(t, w, long_brief_file(t), t / "c.jsonl"),
         ("{tmp}/briefs.txt:2", "max_seq_len", "shorten the brief"), absent=("c.jsonl",)),
    Case("render-brief-too-long", render_args, ("{tmp}/briefs.txt:2", "max_seq_len", "shorten the brief"),
         absent=("render",)),
    Case("eval-brief-too-long",
         lambda t, w: eval_args(t, w)[:-4] + ["--briefs", str(long_brief_file(t)), "--out", str(t / "eval")],
         ("{tmp}/briefs.txt:2", "max_seq_len", "shorten the brief"), absent=("eval",)),
    Case("sample-resolution-not-a-multiple", lambda t, w: sample_at(t, 33),
         ("--resolution", "33x33", "multiple of 4", "32 or 36"), absent=("samples",)),
    Case("eval-clip-not-a-clip-directory", lambda t, w: eval_args(t, w) + ["--clip", str(t / "clip")],
         ("clip {tmp}/clip", "not a local transformers CLIP directory"), absent=("eval",)),
]


def run_cli(argv: list[str], cwd: Path, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """`python -m atelier_studio.flows.cli ARGV` in a subprocess (this checkout's code first on the path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run([sys.executable, "-m", "atelier_studio.flows.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600,
                          preexec_fn=limit_file_size if file_size_limit else None)


def run_in_process(argv: list[str], cwd: Path, capsys: pytest.CaptureFixture, monkeypatch) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `main(argv)`; an exception that escapes it fails the test with its traceback."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()  # drop what building the input printed
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        status = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


def snapshot(tmp: Path, globs: tuple[str, ...]) -> dict[str, bytes]:
    files = {p for g in globs for p in tmp.glob(g) if p.is_file()}
    return {str(p.relative_to(tmp)): p.read_bytes() for p in sorted(files)}


def test_the_table_names_every_case_once():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_clear_error(case: Case, world: World, tmp_path: Path, capsys, monkeypatch):
    argv = case.build(tmp_path, world)
    assert argv, f"{case.name}: the build returned no command"
    before = snapshot(tmp_path, case.unchanged)
    assert before or not case.unchanged, f"{case.name}: `unchanged` matched no file before the run"
    if case.subprocess or case.file_size_limit:
        result = run_cli(argv, tmp_path, case.file_size_limit)
        status, out, err = result.returncode, result.stdout, result.stderr
    else:
        status, out, err = run_in_process(argv, tmp_path, capsys, monkeypatch)
    detail = f"\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert status == case.status, detail
    assert "Traceback" not in err, detail
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("atelier: error: "), detail
    for needle in case.expect:
        assert needle.format(tmp=tmp_path, fixture=FIXTURE) in lines[0], detail
    for pattern in case.absent:
        assert not list(tmp_path.glob(pattern)), f"{pattern} exists after the failure{detail}"
    assert snapshot(tmp_path, case.unchanged) == before, f"files changed: {case.unchanged}{detail}"
    leftovers = [str(p) for p in tmp_path.rglob(".*") if is_temporary(p.name)]
    assert not leftovers, f"temporary files left behind: {leftovers}"


def test_validate_accepts_a_good_set(tmp_path, capsys, monkeypatch):
    """The counterpart of the validate rows: a complete, intact set exits 0 and reports every sample good."""
    shards = good_shards(tmp_path)
    status, out, err = run_in_process(["data", "validate", str(shards)], tmp_path, capsys, monkeypatch)
    assert status == 0 and not err.strip(), err
    report = json.loads(out)
    assert report["total_ok"] == 3 and report["total_bad"] == 0 and report["problems"] == []


# ----------------------------------------------------------------------------- every numeric option, from the parser


def numeric_options() -> list[tuple[list[str], argparse.Action]]:
    """(command words, action) for every int or float option of every sub-command of `atelier`'s parser."""
    found = []

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, words + [name])
            elif action.type in (int, float):
                found.append((words, action))

    walk(build_parser(), [])
    return found


def required_argv(words: list[str]) -> list[str]:
    """`words` and a stand-in value for each required option and positional: the numeric checks run before any is
    read, so none needs to exist."""
    parser = build_parser()
    for w in words:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[w]
    argv = list(words)
    for action in parser._actions:
        bounds = getattr(action, "bounds", None)
        stand_in = str(int(bounds.low) + 1) if bounds is not None else "x"  # a valid number, or a path
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            argv.append(stand_in)
        elif action.required:
            argv += [action.option_strings[0], stand_in]
    return argv


def outside(bounds) -> list[float]:
    """Values each option must refuse: 0 and -1 where they are outside, just below the lowest, above the highest."""
    values = {v for v in (0, -1) if not bounds.holds(v)}
    values.add(bounds.low if bounds.low_open else bounds.low - 1)
    if bounds.high is not None:
        values.add(bounds.high + 1)
    return sorted(values)


NUMERIC = [(words, action, value) for words, action in numeric_options()
           for value in (outside(action.bounds) if hasattr(action, "bounds") else [None])]


@pytest.mark.parametrize("words, action, value", NUMERIC,
                         ids=[f"{' '.join(w)} {a.option_strings[0]} {v}" for w, a, v in NUMERIC])
def test_every_numeric_option_refuses_values_outside_its_range(words, action, value, tmp_path, capsys, monkeypatch):
    """Each int/float option of each sub-command, given 0, a negative or an out-of-range value: exit 2, one line
    naming the option and the range, no traceback. A new numeric option is walked here without a new row; one
    declared without bounds (flows/cli.py's `number`) fails."""
    assert value is not None, f"atelier {' '.join(words)} {action.option_strings[0]}: declare it with number(...)"
    flag = action.option_strings[0]
    typed = str(int(value)) if action.type is int else str(float(value))
    argv = required_argv(words)
    if flag in argv:  # a required numeric option: replace its stand-in
        argv[argv.index(flag) + 1] = typed
    else:
        argv += [flag, typed]
    status, out, err = run_in_process(argv, tmp_path, capsys, monkeypatch)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, f"{argv}\n{err}"
    assert lines[0].startswith(f"atelier: error: {flag} {typed}: must be"), lines[0]
    assert not list(tmp_path.iterdir()), "nothing is written before the numbers are checked"


@pytest.mark.parametrize("words, action", [(w, a) for w, a in numeric_options() if not a.required][:1] +
                         [(w, a) for w, a in numeric_options() if a.type is float][:1],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v.option_strings[0])
def test_a_word_where_a_number_goes_is_one_line(words, action, tmp_path, capsys, monkeypatch):
    """argparse's own errors are one line as well (flows/cli.py's OneLineParser), naming the option."""
    status, out, err = run_in_process(required_argv(words) + [action.option_strings[0], "many"], tmp_path, capsys,
                                      monkeypatch)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("atelier: error: "), err
    assert action.option_strings[0] in lines[0] and "'many'" in lines[0], lines[0]


def test_the_walk_finds_the_options_of_the_issue():
    """The cases found by hand (docs/training.md's bad-input table) are among the walked ones, so the walk itself
    cannot go empty."""
    walked = {(" ".join(w), a.option_strings[0]) for w, a, _ in NUMERIC}
    for case in [("designer generate", "--batch-size"), ("designer generate", "--max-new-tokens"),
                 ("designer generate", "--temperature"), ("designer generate", "--top-p"),
                 ("imagegen sample", "--steps"), ("imagegen sample", "--resolution"), ("render", "--steps"),
                 ("data synth", "--n"), ("imagegen init", "--in-channels"), ("eval", "--guidance")]:
        assert case in walked, case
