"""`atelier` — one command line for everything; the Prefect flows call the same entry points.

    atelier data tokenizer --corpus FILE... --vocab-size N --out DIR
    atelier data synth --out DIR --n N --seed S [--n-text M]
    atelier data shards --images DIR --captions FILE --out DIR --shard-size N
    atelier data shards --from DIR --out DIR   (images + caption files, imagefolder, parquet)
    atelier data validate DIR
    atelier designer init --size tiny|0.6b|...|qwen3.5-9b|qwen3-moe-tiny|qwen3-30b-a3b --tokenizer DIR --out DIR
        (registered sizes)
    atelier designer train --config FILE [--set a.b=c ...] [--dry-run]
        [--nproc N [--nnodes M --node-rank I --master-addr H]]
    atelier designer generate --model DIR [--adapter DIR] --briefs FILE --out FILE
    atelier designer export --merge RUN --out DIR [--dtype bfloat16|float16|float32]   (a LoRA / QLoRA run → full model)
    atelier imagegen init --size tiny|sd3-medium|... --out DIR
    atelier imagegen cache --config FILE --out DIR [--set ...]
    atelier imagegen train --config FILE [--set ...] [--dry-run] [--nproc N ...]
    atelier imagegen sample --model DIR --captions FILE --out DIR [--resolution PX]   (DIR: a run's or an SD3 pipeline)
    atelier imagegen export RUN --out PATH --lora-format diffusers|kohya | --merge | --single-file
    atelier eval --designer DIR --imagegen DIR --briefs FILE --out DIR [--clip DIR]
    atelier eval --captions FILE [--imagegen DIR] --out DIR
    atelier render --designer DIR --imagegen DIR --briefs FILE --out DIR
    atelier serve [--stop | --status | --foreground]   (zero setup: a local Prefect server + every deployment served)
    atelier deploy [--pool atelier-gpu] [--gpus N]    (work pool + `gpu` limit + `prefect deploy --all`)
    atelier run DEPLOYMENT [--config X] [--set k=v ...] [--timeout S]   (a flow run, its logs followed to the end)
    atelier runs [--limit N]                          (recent flow runs: state, output folder, MFU)
    atelier config list | show NAME   (the shipped configs: `atelier config show designer/demo > my.toml`)

A model DIR (and a config's model.path, lora.init_adapter, text.encoder, autoencoder.spec) may also be a Hugging
Face hub id, `org/name[@revision]`, found in the local cache only (pipeline/hub.py; an existing path always wins).

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

from atelier_studio.flows.cli_args import (  # noqa: F401  (re-exported: `from atelier_studio.flows.cli import number`)
    GUIDANCE,
    SEED,
    SHARD_SIZE,
    STEPS,
    Bounds,
    OneLineParser,
    check_numbers,
    command_parser,
    number,
)

# ----------------------------------------------------------------------------- designer


def _torchrun(args: argparse.Namespace) -> int | None:
    """Re-launch this train command under torchrun when asked for several processes; None: run here."""
    from atelier_studio.pipeline.distributed import DistributedError, launched_by_torchrun

    if args.nproc < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise DistributedError(f"--nproc {args.nproc} --nnodes {args.nnodes} --node-rank {args.node_rank}: need "
                               f"nproc >= 1, nnodes >= 1 and 0 <= node-rank < nnodes")
    if (args.nproc <= 1 and args.nnodes <= 1) or launched_by_torchrun():
        return None
    launch = ["--nproc-per-node", str(args.nproc), "--nnodes", str(args.nnodes)]
    if args.nnodes == 1 and not args.master_addr:
        launch += ["--standalone"]  # a free local port: runs on one machine never collide
    else:
        launch += ["--node-rank", str(args.node_rank), "--master-addr", args.master_addr or "127.0.0.1",
                   "--master-port", str(args.master_port)]
    launch += ["-m", "atelier_studio.flows.cli", args.group, args.command, "--config", args.config]
    for item in args.set:
        launch += ["--set", item]
    return _run_torchrun(launch)


def _run_torchrun(launch: list[str]) -> int:
    """torchrun's launcher in this process (this process group is the launcher's: a cancelled flow kills it and the
    workers together, flows/launch.py). Run in-process rather than as `python -m torch.distributed.run` so a failed
    worker's exit status is ours, with no launcher traceback after the workers' own lines: workers that stopped on a
    user error (each printed its one line) give exit 2, also when the launcher had to stop the others (SIGTERM,
    128 + 15); a run stopped by a signal after saving gives 128 + that signal; anything else says which codes."""
    import logging
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # the launcher's per-worker log lines ("failed (exitcode: 2) ...", "Sending process ... SIGTERM") repeat what the
    # workers said; the outcome is summarised below instead
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(launch))
    except ChildFailedError as e:
        codes = sorted({f.exitcode if f.exitcode >= 0 else 128 - f.exitcode for f in e.failures.values()})
        stopped = 128 + signal.SIGTERM  # a worker the launcher stopped because another had failed
        if 2 in codes and set(codes) <= {2, stopped}:
            return 2
        if len(codes) == 1 and codes[0] in (128 + signal.SIGTERM, 128 + signal.SIGINT, 1):
            return codes[0]  # stopped by a signal after saving (the log says so), or a bug's traceback above
        print(f"atelier: error: the workers exited with codes {codes} (a code above 128 is 128 + the signal that "
              f"killed the worker, e.g. 137: SIGKILL, often the out-of-memory killer)", file=sys.stderr)
        return codes[-1]
    return 0


def _train(args: argparse.Namespace, config_cls: type, task_cls: Callable) -> int:
    """Shared by both train commands: config, process group, task, the loop; rank 0 writes the run files."""
    import contextlib
    import inspect
    import os

    from atelier_studio.pipeline.atomic import check_dir_path
    from atelier_studio.pipeline.config import config_to_dict, flatten, load_config
    from atelier_studio.pipeline.config_diff import check_resume, record_run_config
    from atelier_studio.pipeline.distributed import DistributedError, init_distributed, shutdown
    from atelier_studio.pipeline.progress import reset_fallbacks
    from atelier_studio.pipeline.run_lock import lock_output_dir
    from atelier_studio.pipeline.trackers import check_installed
    from atelier_studio.pipeline.trainer import Trainer, exit_code, seed_everything

    if args.dry_run:
        return _dry_run(args, config_cls)
    launched = _torchrun(args)
    if launched is not None:
        return launched
    reset_fallbacks()  # this run's own, for its summary
    cfg = load_config(config_cls, args.config, args.set)
    out = Path(cfg.output.dir)
    check_dir_path(out, "output.dir")  # a file in the way is named now, before anything is loaded
    check_installed(cfg.output.active_trackers())  # a tracker asked for but not installed: its extra, named now
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
            # a resume that changes what the checkpoint is trained on stops here, before anything loads (rank 0
            # decides for all); the task then reads and checks the data and the model, the trainer restores the
            # checkpoint, and only then are the run's files written
            resume_check = _on_rank_0(dist, lambda: check_resume(cfg, config_cls.resume_policy, out))
            task = task_cls(cfg, dist.device, dist=dist) if dist.enabled else task_cls(cfg, dist.device)
            trainer = Trainer(task, cfg.train, cfg.output, dist.device, dist=dist,
                              params=flatten(config_to_dict(cfg)))
            trainer.resume()
            if dist.is_main:
                record_run_config(cfg, out, resume_check, trainer.step)
            result = trainer.fit()
        if dist.is_main:
            _write_summary(out, result)
        return exit_code(result)
    finally:
        if lock is not None:
            lock.release()
        shutdown(dist)


def _dry_run(args: argparse.Namespace, config_cls: type) -> int:
    """`train --dry-run`: the resolved config with where each value came from, and the trainer's plan (parameters,
    units and FLOPs per step, dataset size, a peak-memory estimate) from the model's config alone
    (pipeline/dry_run.py)."""
    from atelier_studio.pipeline.config import load_config
    from atelier_studio.pipeline.dry_run import config_sources, format_report

    cfg = load_config(config_cls, args.config, args.set)
    if args.group == "designer":
        from atelier_studio.designer.dry_run import designer_plan as make_plan
    else:
        from atelier_studio.imagegen.dry_run import imagegen_plan as make_plan
    print(format_report(args.group, config_sources(cfg, args.config, args.set), make_plan(cfg)))
    return 0


def _on_rank_0(dist, fn: Callable):
    """fn() run by rank 0 only, its result (or its AtelierError, raised) on every rank."""
    from atelier_studio.pipeline.distributed import broadcast_object
    from atelier_studio.pipeline.errors import AtelierError

    if not dist.enabled:
        return fn()
    try:
        result = fn() if dist.is_main else None
    except AtelierError as e:
        result = e
    result = broadcast_object(dist, result)
    if isinstance(result, AtelierError):
        raise result
    return result


def designer_train(args: argparse.Namespace) -> int:
    from atelier_studio.designer.config import DesignerConfig
    from atelier_studio.designer.preference import designer_task

    return _train(args, DesignerConfig, designer_task)


def designer_init(args: argparse.Namespace) -> int:
    import torch

    from atelier_studio.designer.hf import init_random
    from atelier_studio.designer.registry import family_of_size

    family = family_of_size(args.size)  # an unknown size lists the registered ones
    path = init_random(args.size, Path(args.tokenizer), Path(args.out), seed=args.seed,
                       dtype=getattr(torch, args.dtype))
    print(f"wrote a random-init {family.name} {args.size} model to {path}")
    return 0


def _model_arg(value: str, option: str) -> Path | None:
    """A model option's directory: a local path, or a hub id's snapshot in the local cache (pipeline/hub.py);
    None for an option left empty."""
    from atelier_studio.pipeline.hub import resolve_model_path

    return Path(resolve_model_path(value, option)) if value else None


def designer_generate(args: argparse.Namespace) -> int:
    from atelier_studio.designer.captions import generate_captions

    generate_captions(model_dir=_model_arg(args.model, "--model"), adapter_dir=_model_arg(args.adapter, "--adapter"),
                      briefs_file=Path(args.briefs), out_file=Path(args.out), max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p, seed=args.seed, batch_size=args.batch_size)
    return 0


def designer_export(args: argparse.Namespace) -> int:
    from atelier_studio.designer.export import export_merged

    export_merged(Path(args.merge), Path(args.out), dtype=args.dtype or None)
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
    from atelier_studio.pipeline.errors import AtelierError, UsageError

    family = family_of_size(args.size)  # an unknown size lists the registered ones
    overrides = {name: getattr(args, name) for name in ("in_channels", "out_channels", "sample_size",
                                                         "joint_attention_dim", "pooled_projection_dim")
                 if getattr(args, name)}
    try:
        path = init_random(args.size, Path(args.out), seed=args.seed, dtype=getattr(torch, args.dtype), **overrides)
    except AtelierError:
        raise
    except ValueError as e:  # the args' own checks (MMDiTArgs.sample_size=...: why), for the options given
        given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items())
        raise UsageError(f"imagegen init --size {args.size} {given}: {e}") from None
    print(f"wrote a random-init {family.name} {args.size} to {path}")
    return 0


def imagegen_export(args: argparse.Namespace) -> int:
    from atelier_studio.imagegen.export_run import export_run
    from atelier_studio.pipeline.errors import UsageError

    forms = [f for f, on in (("lora", args.lora_format), ("merge", args.merge), ("single-file", args.single_file))
             if on]
    if len(forms) != 1:
        raise UsageError("imagegen export: choose one of --lora-format diffusers|kohya, --merge, --single-file")
    export_run(Path(args.run), Path(args.out), args.lora_format or forms[0])
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

    sample_to_dir(model_dir=_model_arg(args.model, "--model"), captions_file=Path(args.captions),
                  out_dir=Path(args.out),
                  steps=args.steps, guidance=args.guidance, seed=args.seed, config_path=args.config,
                  resolution=args.resolution)
    return 0


# ----------------------------------------------------------------------------- shipped configs


def config_list(args: argparse.Namespace) -> int:
    from atelier_studio.flows.shipped import configs_dir, list_configs

    for name in list_configs():
        print(name)
    print(f"(in {configs_dir()}; `atelier config show NAME > my.toml` copies one)", file=sys.stderr)
    return 0


def config_show(args: argparse.Namespace) -> int:
    from atelier_studio.flows.shipped import shipped_config

    sys.stdout.write(shipped_config(args.name).read_text(encoding="utf-8"))
    return 0


# ----------------------------------------------------------------------------- Prefect: serve, deploy, run, runs


def serve_cmd(args: argparse.Namespace) -> int:
    from atelier_studio.flows import serve
    from atelier_studio.flows.local_server import ServerNotRunning
    from atelier_studio.pipeline.errors import UsageError

    try:
        if args.stop:
            serve.stop()
        elif args.status:
            import json

            print(json.dumps(serve.status(), indent=1))
        elif args.foreground:
            serve.run()
        else:
            serve.start(server_timeout=args.timeout)
    except (ServerNotRunning, TimeoutError, RuntimeError) as e:
        raise UsageError(f"serve: {e}") from None
    return 0


def deploy_cmd(args: argparse.Namespace) -> int:
    from atelier_studio.flows.front_door import deploy

    return deploy(args.pool, args.gpus, args.prefect_file)


def run_cmd(args: argparse.Namespace) -> int:
    from atelier_studio.flows.front_door import run

    return run(args.deployment, args.config, args.set, timeout=args.timeout)


def runs_cmd(args: argparse.Namespace) -> int:
    from atelier_studio.flows.front_door import runs

    return runs(args.limit)


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
    from atelier_studio.pipeline.errors import UsageError

    if args.source is not None:
        if args.images is not None or args.captions is not None:
            raise UsageError("data shards: --from reads images and captions together; drop --images / --captions")
        from atelier_studio.data.image_sources import write_source_shards

        got = write_source_shards(Path(args.source), Path(args.out), args.shard_size, args.caption_column)
        print(f"wrote {got.shards.total} samples ({got.images} images, {got.layout} layout) in "
              f"{len(got.shards.shards)} shards to {args.out}; {got.skipped.summary()}")
        return 0
    if args.images is None or args.captions is None:
        raise UsageError("data shards: give --from SRC (an image folder, an imagefolder or parquet), or --images DIR "
                         "with --captions FILE")
    if args.caption_column is not None:
        raise UsageError("data shards: --caption-column goes with --from; the --captions JSONL's column is 'caption'")
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
        result = evaluate_captions(Path(args.captions), Path(args.out), _model_arg(args.imagegen, "--imagegen"),
                                   seed=args.seed, steps=args.steps, guidance=args.guidance)
        print(result)
        return 0
    if not (args.designer and args.briefs and args.imagegen):
        raise UsageError("eval needs --designer, --briefs and --imagegen (or --captions, to judge given captions)")
    result = evaluate_brief_to_image(designer=_model_arg(args.designer, "--designer"),
                                     imagegen=_model_arg(args.imagegen, "--imagegen"),
                                     briefs=Path(args.briefs), out_dir=Path(args.out), seed=args.seed,
                                     steps=args.steps, guidance=args.guidance,
                                     clip=_model_arg(args.clip, "--clip"))
    print(f"scores run: {describe_scores(result)}")
    print(result)
    return 0


def run_render(args: argparse.Namespace) -> int:
    from atelier_studio.flows.render import render_briefs_plain

    result = render_briefs_plain(designer=_model_arg(args.designer, "--designer"),
                                 imagegen=_model_arg(args.imagegen, "--imagegen"), briefs=Path(args.briefs),
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
    p = OneLineParser(prog="atelier", description=__doc__.split("\n")[0])
    groups = p.add_subparsers(dest="group", required=True)

    def command(group: argparse._SubParsersAction, name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        sp = group.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    def train_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", required=True, help="TOML config file")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")
        if sp.prog.endswith(" train"):
            sp.add_argument("--dry-run", action="store_true",
                            help="print the resolved config (each value's source), parameters, tokens or images and "
                                 "FLOPs per step, the dataset size and a peak-memory estimate; load no weights, train "
                                 "nothing")

    def launch_args(sp: argparse.ArgumentParser) -> None:
        g = sp.add_argument_group("several processes (torchrun; see docs/distributed.md)")
        number(g, "--nproc", type=int, bounds=Bounds(1, meaning="processes on this node"), default=1,
               help="processes on this node, one per GPU (default 1)")
        number(g, "--nnodes", type=int, bounds=Bounds(1, meaning="number of nodes"), default=1,
               help="number of nodes (default 1)")
        number(g, "--node-rank", type=int, bounds=Bounds(0, meaning="this node's index, below --nnodes"), default=0,
               help="this node's index, 0..nnodes-1")
        g.add_argument("--master-addr", default="", help="address of node 0 (several nodes)")
        number(g, "--master-port", type=int, bounds=Bounds(1, 65535, meaning="a TCP port"), default=29500,
               help="a free port on node 0 (default 29500)")

    d = groups.add_parser("designer", help="the caption LM").add_subparsers(dest="command", required=True)
    sp = command(d, "train", designer_train, "fine-tune the designer (LoRA or full)")
    train_args(sp)
    launch_args(sp)
    sp = command(d, "init", designer_init, "write a random-init model directory of a registered family (HF layout)")
    sp.add_argument("--size", required=True,
                    help="a size of a registered family (designer/registry.py), e.g. Qwen3's tiny, demo, 0.6b ... 32b "
                         "Qwen3.5's qwen3.5-tiny, qwen3.5-9b, Qwen3-MoE's qwen3-moe-tiny, qwen3-30b-a3b, "
                         "qwen3-235b-a22b; "
                         "an unknown size lists them all")
    sp.add_argument("--tokenizer", required=True, help="HF tokenizer directory (see `atelier data tokenizer`)")
    sp.add_argument("--out", required=True)
    number(sp, "--seed", type=int, bounds=SEED, default=0)
    sp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    sp = command(d, "export", designer_export, "merge a LoRA or QLoRA run's adapter into a full HF model directory")
    sp.add_argument("--merge", required=True, metavar="RUN", help="a LoRA or QLoRA run folder, or its adapter/ folder")
    sp.add_argument("--out", required=True, help="the merged model directory (config.json, safetensors, tokenizer)")
    sp.add_argument("--dtype", default="", choices=["", "bfloat16", "float16", "float32"],
                    help="the merged weights' dtype (default: the base model's)")
    sp = command(d, "generate", designer_generate, "write captions for briefs (one per line)")
    sp.add_argument("--model", required=True, help="HF model directory (base or fully fine-tuned)")
    sp.add_argument("--adapter", default="", help="PEFT adapter directory to apply")
    sp.add_argument("--briefs", required=True)
    sp.add_argument("--out", required=True, help="JSONL of {brief, caption}")
    number(sp, "--max-new-tokens", type=int, bounds=Bounds(1, meaning="tokens each caption may have"), default=64)
    number(sp, "--temperature", type=float, bounds=Bounds(0, meaning="0 is greedy decoding"), default=0.0)
    number(sp, "--top-p", type=float, bounds=Bounds(0, 1, low_open=True, meaning="nucleus sampling's mass"),
           default=1.0)
    number(sp, "--seed", type=int, bounds=SEED, default=0)
    number(sp, "--batch-size", type=int, bounds=Bounds(1, meaning="briefs decoded together"), default=16)

    i = groups.add_parser("imagegen", help="the MMDiT").add_subparsers(dest="command", required=True)
    sp = command(i, "train", imagegen_train, "train the MMDiT with rectified flow")
    train_args(sp)
    launch_args(sp)
    sp = command(i, "init", imagegen_init, "write a random-init model of a registered family (diffusers layout)")
    sp.add_argument("--size", required=True,
                    help="a size of a registered family (imagegen/registry.py), e.g. the MMDiT's tiny, demo, "
                         "sd3-medium, sd3.5-medium, sd3.5-large, FLUX.1's flux-tiny, flux-dev, flux-schnell; an "
                         "unknown size lists them all")
    sp.add_argument("--out", required=True)
    number(sp, "--seed", type=int, bounds=SEED, default=0)
    sp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    size = Bounds(0, meaning="0 keeps the size's own")
    number(sp, "--in-channels", type=int, bounds=size, default=0, help="latent channels (default: the size's)")
    number(sp, "--out-channels", type=int, bounds=size, default=0, help="output channels (default: in-channels)")
    number(sp, "--sample-size", type=int, bounds=size, default=0, help="latent side the model is built for")
    number(sp, "--joint-attention-dim", type=int, bounds=size, default=0,
           help="text encoder hidden size (e.g. 384 for MiniLM, 4096 for T5-XXL)")
    number(sp, "--pooled-projection-dim", "--pooled-dim", type=int, bounds=size, default=0,
           dest="pooled_projection_dim", help="pooled text vector size")
    sp = command(i, "export", imagegen_export, "a run's result as a kohya / diffusers LoRA, a merged pipeline or "
                 "a single-file checkpoint")
    sp.add_argument("run", help="the run folder (output.dir of a finished imagegen run)")
    sp.add_argument("--out", required=True, help="the file (.safetensors: kohya, single-file) or folder to write")
    sp.add_argument("--lora-format", choices=["diffusers", "kohya"], help="the LoRA in diffusers' or kohya's names")
    sp.add_argument("--merge", action="store_true", help="the LoRA merged into the transformer: a pipeline folder")
    sp.add_argument("--single-file", action="store_true",
                    help="the transformer (merged) in the original SD3 layout, for from_single_file / ComfyUI")
    sp = command(i, "cache", imagegen_cache, "encode image shards into latent shards (once, offline)")
    train_args(sp)
    sp.add_argument("--out", required=True)
    number(sp, "--shard-size", type=int, bounds=SHARD_SIZE, default=1000)
    sp = command(i, "sample", imagegen_sample, "render images for captions (one per line)")
    sp.add_argument("--model", required=True,
                    help="a transformer/ or ema/ directory from a run, or a diffusers SD3 pipeline directory")
    sp.add_argument("--captions", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--config", default=None, help="the run's config.toml (default: next to the model dir)")
    number(sp, "--steps", type=int, bounds=STEPS, default=28)
    number(sp, "--guidance", type=float, bounds=GUIDANCE, default=4.0)
    number(sp, "--seed", type=int, bounds=SEED, default=0)
    number(sp, "--resolution", type=int, bounds=Bounds(0, meaning="image side in pixels, 0 = the model's default"),
           default=0,
                    help="image side in pixels (default: the run's data.resolution, or the pipeline's default size)")

    dd = groups.add_parser("data", help="datasets, tokenizers, shards").add_subparsers(dest="command", required=True)
    sp = command(dd, "tokenizer", data_tokenizer, "train a byte-level BPE tokenizer with a chat template")
    sp.add_argument("--corpus", nargs="+", required=True, help=".txt files (a text a line) or designer data files or "
                    "folders in any format of docs/data-in.md (every message's text)")
    number(sp, "--vocab-size", type=int, bounds=Bounds(1, meaning="tokens, specials included"), required=True)
    sp.add_argument("--out", required=True)
    sp = command(dd, "synth", data_synth, "generate the shapes world")
    sp.add_argument("--out", required=True)
    number(sp, "--n", type=int, bounds=Bounds(2, meaning="samples with images: at least one train, one eval"),
           default=2000)
    number(sp, "--seed", type=int, bounds=SEED, default=0)
    number(sp, "--image-size", type=int, bounds=Bounds(24, meaning="image side in pixels (the shapes need 24)"),
           default=32)
    number(sp, "--n-text", type=int, bounds=Bounds(0, meaning="text-only samples"), default=0,
                    help="text-only train samples (brief + caption, no image) added to designer_train.jsonl")
    sp = command(dd, "shards", data_shards, "write WebDataset image shards")
    sp.add_argument("--from", dest="source", help="images with .txt/.caption files, an HF imagefolder or parquet "
                    "(docs/data-in.md)")
    sp.add_argument("--caption-column", help="with --from: the caption column of metadata or parquet")
    sp.add_argument("--images", help="the folder the --captions lines' image paths are relative to")
    sp.add_argument("--captions", help='JSONL of {"image", "caption"} lines')
    sp.add_argument("--out", required=True)
    number(sp, "--shard-size", type=int, bounds=SHARD_SIZE, default=1000)
    sp = command(dd, "validate", data_validate, "check shards and count bad samples")
    sp.add_argument("dir")

    sp = command(groups, "serve", serve_cmd, "zero setup: start a local Prefect server (SQLite) and serve every "
                 "deployment, in the background")
    how = sp.add_mutually_exclusive_group()
    how.add_argument("--stop", action="store_true", help="stop the serve process (and its runs), then the server")
    how.add_argument("--status", action="store_true", help="print the server's and the serve process's state")
    how.add_argument("--foreground", action="store_true", help="serve in this process (the server must answer)")
    number(sp, "--timeout", type=float, bounds=Bounds(1, meaning="seconds to wait for the server"), default=180.0)
    sp = command(groups, "deploy", deploy_cmd, "create the work pool and the `gpu` limit, then `prefect deploy --all`")
    sp.add_argument("--pool", default="atelier-gpu", help="the process work pool (created when missing)")
    number(sp, "--gpus", type=int, bounds=Bounds(1, 65536, meaning="GPUs a worker of the pool drives"), default=1,
           help="slots of the global concurrency limit `gpu` (default 1)")
    sp.add_argument("--prefect-file", default=None, help="default: ./prefect.yaml, else the one in the package")
    sp = command(groups, "run", run_cmd, "run a deployment and follow its logs; exit 0 when it completes")
    sp.add_argument("deployment", help="train-designer, train-imagegen, brief-to-image-eval, brief-to-image, "
                                       "render-briefs, improve-designer (or FLOW/DEPLOYMENT)")
    sp.add_argument("--config", default=None, help="trainers: a TOML file or a shipped name (atelier config list)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="trainers: a config key (train.lr=3e-4); other flows: a parameter (out_dir=runs/x)")
    number(sp, "--timeout", type=float, bounds=Bounds(0, meaning="seconds to follow; 0 = until the run ends"),
           default=0.0)
    sp = command(groups, "runs", runs_cmd, "recent flow runs: state, start, MFU, output folder")
    number(sp, "--limit", type=int, bounds=Bounds(1, 200, meaning="runs listed; the API pages 200"), default=20)

    c = groups.add_parser("config", help="the configs shipped in the package").add_subparsers(dest="command",
                                                                                             required=True)
    command(c, "list", config_list, "name every shipped config (designer/demo, imagegen/sd3-medium, ...)")
    sp = command(c, "show", config_show, "print a shipped config, e.g. `atelier config show designer/demo > my.toml`")
    sp.add_argument("name", help="a name from `atelier config list`, e.g. designer/demo")

    sp = command(groups, "eval", run_eval, "brief → designer → imagegen → scores")
    sp.add_argument("--designer", default="", help="the designer (model, adapter or run directory)")
    sp.add_argument("--imagegen", default="", help="the MMDiT (a run's ema/ or transformer/ directory, or the run)")
    sp.add_argument("--briefs", default="", help="briefs, one per line (.txt) or {\"brief\"} rows (.jsonl)")
    sp.add_argument("--captions", default="",
                    help="instead of --designer and --briefs: {\"brief\", \"caption\"} JSONL rows to judge (e.g. the "
                         "world's eval.jsonl); without --imagegen the images the rows name are judged")
    sp.add_argument("--out", required=True)
    number(sp, "--seed", type=int, bounds=SEED, default=0)
    number(sp, "--steps", type=int, bounds=STEPS, default=20, help="Euler steps per image (default 20)")
    number(sp, "--guidance", type=float, bounds=GUIDANCE, default=4.0,
                    help="classifier-free guidance scale (default 4.0; the shapes-world demo uses its config's "
                         "sample.guidance)")
    sp.add_argument("--clip", default="", help="a local transformers CLIP directory: CLIP scores for every image "
                                               "(the only scores briefs outside the shapes world get)")
    sp = command(groups, "render", run_render, "briefs (any text) → designer captions → images")
    sp.add_argument("--designer", required=True, help="a designer model, adapter or run directory")
    sp.add_argument("--imagegen", required=True, help="what `imagegen sample --model` takes, or a run directory")
    sp.add_argument("--briefs", required=True, help=".txt (one brief per line) or .jsonl ({\"brief\": ...})")
    sp.add_argument("--out", required=True)
    number(sp, "--seed", type=int, bounds=SEED, default=0)
    number(sp, "--steps", type=int, bounds=STEPS, default=28)
    number(sp, "--guidance", type=float, bounds=GUIDANCE, default=4.0)
    return p


# Log lines that libraries print while they are imported, about their own internals, which no Atelier user can act
# on: (logger, start of the message). Each is dropped by message, so every other warning of the logger still shows.
# Without this, `imagegen cache` on a bad SD3 pipeline prints torch's two lines about torchao's enums (diffusers
# imports torchao when it is installed) before the one error line.
_LIBRARY_NOISE = (
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile"),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects"),
)


class _DropLibraryNoise:
    """A logging filter: drops a record whose message contains ``text``."""

    def __init__(self, text: str):
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


def quiet_library_noise() -> None:
    """Drop the import-time log lines of _LIBRARY_NOISE (idempotent: one filter per logger)."""
    import logging

    for name, text in _LIBRARY_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLibraryNoise) and f.text == text for f in logger.filters):
            logger.addFilter(_DropLibraryNoise(text))


def main(argv: Sequence[str] | None = None) -> int:
    from atelier_studio.pipeline.errors import AtelierError, one_line, user_os_error

    quiet_library_noise()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_numbers(parser, args)
        return args.fn(args)
    except AtelierError as e:
        message = str(e)
    except OSError as e:  # a missing file, a file in the way, no permission, a full disk: the path is named
        message = user_os_error(e)
        if message is None:
            raise
    # one write of the whole line: under torchrun every rank prints its error to the same stderr at once, and
    # print()'s separate writes of the text and the newline let two ranks' lines run together
    sys.stderr.write(f"atelier: error: {one_line(message)}\n")
    sys.stderr.flush()
    return 2


def _exit_worker(code: int) -> None:
    """How a torchrun worker leaves once `main` returned: its run's files are written and flushed, its process group
    destroyed (flows/cli.py `_train`), so nothing is left for the interpreter's teardown but C++ static destructors
    and the collective backend's threads, and on a CPU CI machine that teardown crashed a finished two-process run
    (SIGSEGV after the summary was written: a finished run reported as failed). The worker ends here instead, with
    the run's own exit code. One process (no torchrun) keeps Python's normal exit."""
    import logging
    import os

    from atelier_studio.pipeline.distributed import DistributedError, launched_by_torchrun

    try:
        worker = launched_by_torchrun()
    except DistributedError:  # a broken torchrun environment: main() has said so already
        worker = False
    if worker:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    # a native crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) prints every thread's Python stack to stderr, so the
    # log says where it happened instead of only the launcher's "Signal 11"
    import faulthandler

    faulthandler.enable()
    _exit_worker(main())
