"""`atelier` — one command line for everything; the Prefect flows call the same entry points.

    atelier data tokenizer --corpus FILE... --vocab-size N --out DIR
    atelier data synth --out DIR --n N --seed S [--n-text M]
    atelier data shards --images DIR --captions FILE --out DIR --shard-size N
    atelier data validate DIR
    atelier designer init --size tiny|0.6b|...|qwen3.5-9b|qwen3-moe-tiny|qwen3-30b-a3b --tokenizer DIR --out DIR  (registered sizes)
    atelier designer train --config FILE [--set a.b=c ...] [--nproc N [--nnodes M --node-rank I --master-addr H]]
    atelier designer generate --model DIR [--adapter DIR] --briefs FILE --out FILE
    atelier imagegen init --size tiny|sd3-medium|... --out DIR
    atelier imagegen cache --config FILE --out DIR [--set ...]
    atelier imagegen train --config FILE [--set ...] [--nproc N ...]
    atelier imagegen sample --model DIR --captions FILE --out DIR [--resolution PX]   (DIR: a run's or an SD3 pipeline)
    atelier eval --designer DIR --imagegen DIR --briefs FILE --out DIR [--clip DIR]
    atelier eval --captions FILE [--imagegen DIR] --out DIR
    atelier render --designer DIR --imagegen DIR --briefs FILE --out DIR

`--nproc N` (and, for several nodes, --nnodes/--node-rank/--master-addr/--master-port) re-launches the
train command through torchrun (`python -m torch.distributed.run`), one process per GPU; docs/distributed.md.

Each command imports only what it needs, so `atelier --help` is instant. Errors a user can fix (a bad
config key, a missing file, a malformed line, a file where a directory should be, a full disk: every
`pipeline.errors.AtelierError`, and the OS errors that name a path) print one line,
`atelier: error: <what is wrong, naming the file, line or key>`, and exit with 2; nothing is left
half-written (pipeline/atomic.py). `data validate` exits 2 as well when it finds anything bad.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence


# ----------------------------------------------------------------------------- designer


def _torchrun(args: argparse.Namespace) -> int | None:
    """Re-launch this train command under torchrun when asked for several processes; None: run here."""
    import os
    import subprocess

    from atelier_studio.pipeline.distributed import launched_by_torchrun

    from atelier_studio.pipeline.distributed import DistributedError

    if args.nproc < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise DistributedError(f"--nproc {args.nproc} --nnodes {args.nnodes} --node-rank {args.node_rank}: need "
                               f"nproc >= 1, nnodes >= 1 and 0 <= node-rank < nnodes")
    if (args.nproc <= 1 and args.nnodes <= 1) or launched_by_torchrun():
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--nnodes", str(args.nnodes)]
    if args.nnodes == 1 and not args.master_addr:
        cmd += ["--standalone"]  # a free local port: runs on one machine never collide
    else:
        cmd += ["--node-rank", str(args.node_rank), "--master-addr", args.master_addr or "127.0.0.1",
                "--master-port", str(args.master_port)]
    cmd += ["-m", "atelier_studio.flows.cli", args.group, args.command, "--config", args.config]
    for item in args.set:
        cmd += ["--set", item]
    # this process's process group is the launcher's: a cancelled flow kills both (flows/launch.py)
    return subprocess.call(cmd, env=os.environ.copy())


def _train(args: argparse.Namespace, config_cls: type, task_cls: Callable) -> int:
    """Shared by both train commands: config, process group, task, the loop; rank 0 writes the run files."""
    import contextlib
    import inspect
    import os

    from atelier_studio.pipeline.atomic import check_dir_path, ensure_dir
    from atelier_studio.pipeline.config import load_config, save_config
    from atelier_studio.pipeline.distributed import DistributedError, init_distributed, shutdown
    from atelier_studio.pipeline.run_lock import lock_output_dir
    from atelier_studio.pipeline.trainer import Trainer, exit_code, seed_everything

    launched = _torchrun(args)
    if launched is not None:
        return launched
    cfg = load_config(config_cls, args.config, args.set)
    out = Path(cfg.output.dir)
    check_dir_path(out, "output.dir")  # a file in the way is named now, before anything is loaded
    dist = init_distributed(cfg.train)
    lock = None
    try:
        lock = lock_output_dir(out, dist)  # one run per output.dir, held for the whole run (pipeline/run_lock.py)
        seed_everything(cfg.train.seed)
        # progress lines from rank 0 only; errors (stderr) from every rank
        quiet = contextlib.nullcontext() if dist.is_main else contextlib.redirect_stdout(open(os.devnull, "w"))
        if dist.enabled and "dist" not in inspect.signature(task_cls).parameters:
            # without FSDP every rank would train its own copy on its own slice: refuse, never diverge silently
            raise DistributedError(f"{task_cls.__name__} does not support several processes yet (it takes no "
                                   f"`dist` context); run it with --nproc 1")
        with quiet:
            # the task reads and checks the data and the model; the run's files are written only after that
            task = task_cls(cfg, dist.device, dist=dist) if dist.enabled else task_cls(cfg, dist.device)
            if dist.is_main:
                save_config(cfg, ensure_dir(out, "output.dir") / "config.toml")
            result = Trainer(task, cfg.train, cfg.output, dist.device, dist=dist).fit()
        if dist.is_main:
            _write_summary(out, result)
        return exit_code(result)
    finally:
        if lock is not None:
            lock.release()
        shutdown(dist)


def designer_train(args: argparse.Namespace) -> int:
    from atelier_studio.designer.config import DesignerConfig
    from atelier_studio.designer.task import DesignerTask

    return _train(args, DesignerConfig, DesignerTask)


def designer_init(args: argparse.Namespace) -> int:
    import torch

    from atelier_studio.designer.hf import init_random
    from atelier_studio.designer.registry import family_of_size

    family = family_of_size(args.size)  # an unknown size lists the registered ones
    path = init_random(args.size, Path(args.tokenizer), Path(args.out), seed=args.seed, dtype=getattr(torch, args.dtype))
    print(f"wrote a random-init {family.name} {args.size} model to {path}")
    return 0


def designer_generate(args: argparse.Namespace) -> int:
    from atelier_studio.designer.captions import generate_captions

    generate_captions(model_dir=Path(args.model), adapter_dir=Path(args.adapter) if args.adapter else None,
                      briefs_file=Path(args.briefs), out_file=Path(args.out), max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p, seed=args.seed, batch_size=args.batch_size)
    return 0


# ----------------------------------------------------------------------------- imagegen


def imagegen_train(args: argparse.Namespace) -> int:
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.imagegen.task import ImagegenTask

    return _train(args, ImagegenConfig, ImagegenTask)


def imagegen_init(args: argparse.Namespace) -> int:
    import torch

    from atelier_studio.imagegen.hf import init_random
    from atelier_studio.imagegen.registry import family_of_size

    family = family_of_size(args.size)  # an unknown size lists the registered ones
    overrides = {name: getattr(args, name) for name in ("in_channels", "out_channels", "sample_size",
                                                         "joint_attention_dim", "pooled_projection_dim")
                 if getattr(args, name)}
    path = init_random(args.size, Path(args.out), seed=args.seed, dtype=getattr(torch, args.dtype), **overrides)
    print(f"wrote a random-init {family.name} {args.size} to {path}")
    return 0


def imagegen_cache(args: argparse.Namespace) -> int:
    from atelier_studio.imagegen.cache import cache_latents
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.pipeline.config import load_config

    cfg = load_config(ImagegenConfig, args.config, args.set)
    cache_latents(cfg, Path(args.out), shard_size=args.shard_size)
    return 0


def imagegen_sample(args: argparse.Namespace) -> int:
    from atelier_studio.imagegen.sample import sample_to_dir

    sample_to_dir(model_dir=Path(args.model), captions_file=Path(args.captions), out_dir=Path(args.out),
                  steps=args.steps, guidance=args.guidance, seed=args.seed, config_path=args.config,
                  resolution=args.resolution)
    return 0


# ----------------------------------------------------------------------------- data and eval


def data_tokenizer(args: argparse.Namespace) -> int:
    from atelier_studio.data.tokenizer import train_tokenizer

    path = train_tokenizer([Path(p) for p in args.corpus], args.vocab_size, Path(args.out))
    print(f"wrote a byte-level BPE tokenizer ({args.vocab_size} tokens) to {path}")
    return 0


def data_synth(args: argparse.Namespace) -> int:
    from atelier_studio.data.synthetic import generate_world

    stats = generate_world(Path(args.out), n=args.n, seed=args.seed, image_size=args.image_size, n_text=args.n_text)
    print(f"wrote the shapes world to {args.out}: {stats}")
    return 0


def data_shards(args: argparse.Namespace) -> int:
    from atelier_studio.data.shards import write_image_shards

    stats = write_image_shards(Path(args.images), Path(args.captions), Path(args.out), args.shard_size)
    print(f"wrote shards to {args.out}: {stats}")
    return 0


def data_validate(args: argparse.Namespace) -> int:
    """The report as JSON on stdout; anything bad (samples, tars, index) is also one error line and status 2."""
    import json

    from atelier_studio.data.shards import ShardError, validate_shards

    report = validate_shards(Path(args.dir))
    print(json.dumps(report.as_dict(), indent=1))
    if not report.ok:
        raise ShardError(report.summary())
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from atelier_studio.flows.evaluate import describe_scores, evaluate_brief_to_image, evaluate_captions
    from atelier_studio.pipeline.errors import UsageError

    if args.captions:
        if args.designer or args.briefs:
            raise UsageError("--captions replaces the designer: pass either --captions or --designer with --briefs")
        result = evaluate_captions(Path(args.captions), Path(args.out), Path(args.imagegen) if args.imagegen else None,
                                   seed=args.seed, steps=args.steps, guidance=args.guidance)
        print(result)
        return 0
    if not (args.designer and args.briefs and args.imagegen):
        raise UsageError("eval needs --designer, --briefs and --imagegen (or --captions, to judge given captions)")
    result = evaluate_brief_to_image(designer=Path(args.designer), imagegen=Path(args.imagegen),
                                     briefs=Path(args.briefs), out_dir=Path(args.out), seed=args.seed,
                                     steps=args.steps, guidance=args.guidance,
                                     clip=Path(args.clip) if args.clip else None)
    print(f"scores run: {describe_scores(result)}")
    print(result)
    return 0


def run_render(args: argparse.Namespace) -> int:
    from atelier_studio.flows.render import render_briefs_plain

    result = render_briefs_plain(designer=Path(args.designer), imagegen=Path(args.imagegen), briefs=Path(args.briefs),
                                 out_dir=Path(args.out), seed=args.seed, steps=args.steps, guidance=args.guidance)
    print(result)
    return 0


# ----------------------------------------------------------------------------- parser


def _write_summary(out: Path, result) -> None:
    import json

    from atelier_studio.pipeline.atomic import atomic_write_text

    summary = {"step": result.step, "interrupted": result.interrupted, "final_loss": result.final_loss,
               "exports": {k: str(v) for k, v in result.exports.items()}, **result.summary}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1), what="run summary")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atelier", description=__doc__.split("\n")[0])
    groups = p.add_subparsers(dest="group", required=True)

    def command(group: argparse._SubParsersAction, name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        sp = group.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    def train_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", required=True, help="TOML config file")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")

    def launch_args(sp: argparse.ArgumentParser) -> None:
        g = sp.add_argument_group("several processes (torchrun; see docs/distributed.md)")
        g.add_argument("--nproc", type=int, default=1, help="processes on this node, one per GPU (default 1)")
        g.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
        g.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
        g.add_argument("--master-addr", default="", help="address of node 0 (several nodes)")
        g.add_argument("--master-port", type=int, default=29500, help="a free port on node 0 (default 29500)")

    d = groups.add_parser("designer", help="the caption LM").add_subparsers(dest="command", required=True)
    sp = command(d, "train", designer_train, "fine-tune the designer (LoRA or full)")
    train_args(sp)
    launch_args(sp)
    sp = command(d, "init", designer_init, "write a random-init model directory of a registered family (HF layout)")
    sp.add_argument("--size", required=True,
                    help="a size of a registered family (designer/registry.py), e.g. Qwen3's tiny, demo, 0.6b ... 32b "
                         "Qwen3.5's qwen3.5-tiny, qwen3.5-9b, Qwen3-MoE's qwen3-moe-tiny, qwen3-30b-a3b, qwen3-235b-a22b; "
                         "an unknown size lists them all")
    sp.add_argument("--tokenizer", required=True, help="HF tokenizer directory (see `atelier data tokenizer`)")
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    sp = command(d, "generate", designer_generate, "write captions for briefs (one per line)")
    sp.add_argument("--model", required=True, help="HF model directory (base or fully fine-tuned)")
    sp.add_argument("--adapter", default="", help="PEFT adapter directory to apply")
    sp.add_argument("--briefs", required=True)
    sp.add_argument("--out", required=True, help="JSONL of {brief, caption}")
    sp.add_argument("--max-new-tokens", type=int, default=64)
    sp.add_argument("--temperature", type=float, default=0.0)
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--batch-size", type=int, default=16)

    i = groups.add_parser("imagegen", help="the MMDiT").add_subparsers(dest="command", required=True)
    sp = command(i, "train", imagegen_train, "train the MMDiT with rectified flow")
    train_args(sp)
    launch_args(sp)
    sp = command(i, "init", imagegen_init, "write a random-init model of a registered family (diffusers layout)")
    sp.add_argument("--size", required=True,
                    help="a size of a registered family (imagegen/registry.py), e.g. the MMDiT's tiny, demo, sd3-medium, "
                         "sd3.5-medium, sd3.5-large; an unknown size lists them all")
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    sp.add_argument("--in-channels", type=int, default=0, help="latent channels (default: the size's)")
    sp.add_argument("--out-channels", type=int, default=0, help="output channels (default: in-channels)")
    sp.add_argument("--sample-size", type=int, default=0, help="latent side the model is built for")
    sp.add_argument("--joint-attention-dim", type=int, default=0,
                    help="text encoder hidden size (e.g. 384 for MiniLM, 4096 for T5-XXL)")
    sp.add_argument("--pooled-projection-dim", "--pooled-dim", type=int, default=0, dest="pooled_projection_dim",
                    help="pooled text vector size")
    sp = command(i, "cache", imagegen_cache, "encode image shards into latent shards (once, offline)")
    train_args(sp)
    sp.add_argument("--out", required=True)
    sp.add_argument("--shard-size", type=int, default=1000)
    sp = command(i, "sample", imagegen_sample, "render images for captions (one per line)")
    sp.add_argument("--model", required=True,
                    help="a transformer/ or ema/ directory from a run, or a diffusers SD3 pipeline directory")
    sp.add_argument("--captions", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--config", default=None, help="the run's config.toml (default: next to the model dir)")
    sp.add_argument("--steps", type=int, default=28)
    sp.add_argument("--guidance", type=float, default=4.0)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--resolution", type=int, default=0,
                    help="image side in pixels (default: the run's data.resolution, or the pipeline's default size)")

    dd = groups.add_parser("data", help="datasets, tokenizers, shards").add_subparsers(dest="command", required=True)
    sp = command(dd, "tokenizer", data_tokenizer, "train a byte-level BPE tokenizer with a chat template")
    sp.add_argument("--corpus", nargs="+", required=True)
    sp.add_argument("--vocab-size", type=int, required=True)
    sp.add_argument("--out", required=True)
    sp = command(dd, "synth", data_synth, "generate the shapes world")
    sp.add_argument("--out", required=True)
    sp.add_argument("--n", type=int, default=2000)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--image-size", type=int, default=32)
    sp.add_argument("--n-text", type=int, default=0,
                    help="text-only train samples (brief + caption, no image) added to designer_train.jsonl")
    sp = command(dd, "shards", data_shards, "write WebDataset image shards")
    sp.add_argument("--images", required=True)
    sp.add_argument("--captions", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--shard-size", type=int, default=1000)
    sp = command(dd, "validate", data_validate, "check shards and count bad samples")
    sp.add_argument("dir")

    sp = command(groups, "eval", run_eval, "brief → designer → imagegen → scores")
    sp.add_argument("--designer", default="", help="the designer (model, adapter or run directory)")
    sp.add_argument("--imagegen", default="", help="the MMDiT (a run's ema/ or transformer/ directory, or the run)")
    sp.add_argument("--briefs", default="", help="briefs, one per line (.txt) or {\"brief\"} rows (.jsonl)")
    sp.add_argument("--captions", default="",
                    help="instead of --designer and --briefs: {\"brief\", \"caption\"} JSONL rows to judge (e.g. the "
                         "world's eval.jsonl); without --imagegen the images the rows name are judged")
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--steps", type=int, default=20, help="Euler steps per image (default 20)")
    sp.add_argument("--guidance", type=float, default=4.0,
                    help="classifier-free guidance scale (default 4.0; the shapes-world demo uses its config's "
                         "sample.guidance)")
    sp.add_argument("--clip", default="", help="a local transformers CLIP directory: CLIP scores for every image "
                                               "(the only scores briefs outside the shapes world get)")
    sp = command(groups, "render", run_render, "briefs (any text) → designer captions → images")
    sp.add_argument("--designer", required=True, help="a designer model, adapter or run directory")
    sp.add_argument("--imagegen", required=True, help="what `imagegen sample --model` takes, or a run directory")
    sp.add_argument("--briefs", required=True, help=".txt (one brief per line) or .jsonl ({\"brief\": ...})")
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--steps", type=int, default=28)
    sp.add_argument("--guidance", type=float, default=4.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from atelier_studio.pipeline.errors import AtelierError, one_line, user_os_error

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except AtelierError as e:
        message = str(e)
    except OSError as e:  # a missing file, a file in the way, no permission, a full disk: the path is named
        message = user_os_error(e)
        if message is None:
            raise
    print(f"atelier: error: {one_line(message)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
