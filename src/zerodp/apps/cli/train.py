"""``zerodp train``: train a GPT preset with ZeRO data parallelism and report what it cost.

With no arguments: the ``small`` GPT (3.3M parameters, bytes as tokens) on the Python standard
library's source, ZeRO stage 2, 2 local ranks on CPU (gloo) or one rank per GPU (NCCL); about
two minutes on 2 CPU cores. The ranks are started with torch's elastic launcher; under torchrun
the same command (or ``python -m zerodp.apps.train``) runs as one rank of torchrun's world instead.

At the end: loss curve, throughput, per-rank memory by category measured against the ZeRO
paper's formula, bytes communicated per step against 2Ψ (3Ψ for stage 3), and text sampled from
the model, in OUT/report.json, OUT/report.png and on the terminal. ``--compare-stages`` trains
stages 0-3 on the same seed and data to show that loss curves coincide while memory falls.

Multi-node (run on every node; global rank 0 writes the report):
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      --rdzv-id my-run -m zerodp.apps.train --steps 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from zerodp.apps.cli import argtypes
from zerodp.apps.models.gpt import PRESETS
from zerodp.apps.progress import QUIET_HELP
from zerodp.apps.train.options import (
    CHECKPOINTED,
    DEFAULT_CPU_WORLD_SIZE,
    TrainOptions,
    under_torchrun,
)
from zerodp.config import (
    GRADIENT_TIERS,
    HOST_GRADIENTS,
    PRECISIONS,
    STAGES,
    TIERS,
    OffloadConfig,
    ZeroConfig,
)

_DEFAULTS = TrainOptions()


def add_parser(subparsers: Any) -> None:
    """Register the ``train`` subcommand on the dispatcher's subparsers."""
    p = subparsers.add_parser(
        "train",
        help="train a small GPT with ZeRO on local ranks and report memory and traffic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(p)
    p.set_defaults(func=run, train_parser=p)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``zerodp train`` (shared with ``python -m zerodp.apps.train``)."""
    d = _DEFAULTS
    zero = p.add_argument_group("ZeRO")
    zero.add_argument(
        "--stage", type=int, choices=STAGES, default=d.stages[0], help="default %(default)s"
    )
    zero.add_argument("--precision", choices=PRECISIONS, default=d.precision, help="default fp32")
    zero.add_argument(
        "--bucket-mb",
        type=argtypes.positive_float,
        default=d.bucket_mb,
        metavar="MIB",
        help="gradient bucket size in MiB (default: ZeroConfig's 32, at most 1/8 of the model)",
    )
    zero.add_argument(
        "--offload-optimizer",
        choices=TIERS,
        default=d.offload_optimizer,
        help="where the fp32 masters and optimizer state live and the step runs: cpu = host "
        "memory (stages 1-3); nvme = files under --offload-dir (default %(default)s)",
    )
    zero.add_argument(
        "--offload-params",
        choices=TIERS,
        default=d.offload_params,
        help="stage 3: where the parameter shards rest between uses (default %(default)s)",
    )
    zero.add_argument(
        "--offload-gradients",
        choices=GRADIENT_TIERS,
        default=d.offload_gradients,
        help="stage 3 with the optimizer offloaded: where the reduced gradient shards wait for "
        "the step; nvme = written as backward produces them (default %(default)s)",
    )
    zero.add_argument(
        "--offload-fraction",
        type=argtypes.fraction_or_auto,
        default=d.offload_fraction,
        metavar="F",
        help="with --offload-optimizer: the fraction of the optimizer state offloaded, in "
        "(0, 1]; the rest (the first layers) is stepped on the device; auto = what half of "
        "the free device memory cannot hold (default %(default)s)",
    )
    zero.add_argument(
        "--offload-host-gradients",
        choices=HOST_GRADIENTS,
        default=d.offload_host_gradients,
        help="with --offload-optimizer: full = a host copy of the whole fp32 gradient (the CPU "
        "step overlaps the next forward); ring = a few chunks (4 B/param less host memory); "
        "auto = full for cpu, ring for nvme (default %(default)s)",
    )
    zero.add_argument(
        "--activation-checkpointing",
        choices=tuple(CHECKPOINTED),
        default=d.activation_checkpointing,
        help="full = every transformer block keeps only its input and recomputes its forward "
        "in backward (less activation memory, about one more forward of compute; any stage); "
        "offload = as full, and those inputs wait in host memory (default %(default)s)",
    )
    zero.add_argument(
        "--tensor-parallel",
        type=argtypes.positive_int,
        default=d.tensor_parallel,
        metavar="N",
        help="split the GPT over N ranks Megatron-style (attention heads, MLP, vocabulary); "
        "ZeRO shards over the world / N data-parallel ranks (default %(default)s)",
    )
    zero.add_argument(
        "--offload-dir",
        metavar="DIR",
        default=d.offload_dir,
        help="directory on a local disk for the nvme tier's files (only with nvme)",
    )
    zero.add_argument(
        "--compare-stages",
        action="store_true",
        help="train stages 0-3 on the same seed and data and compare them",
    )
    run = p.add_argument_group("run")
    run.add_argument("--preset", choices=tuple(PRESETS), default=d.preset, help="default small")
    run.add_argument(
        "--world-size",
        type=argtypes.positive_int,
        metavar="N",
        help=f"local ranks (default {DEFAULT_CPU_WORLD_SIZE} on CPU, one per GPU with CUDA)",
    )
    run.add_argument(
        "--steps", type=argtypes.positive_int, default=d.steps, help="default %(default)s"
    )
    run.add_argument(
        "--batch",
        type=argtypes.positive_int,
        default=d.batch,
        help="sequences per rank per micro-batch (default %(default)s)",
    )
    run.add_argument(
        "--grad-accum",
        type=argtypes.positive_int,
        default=d.grad_accum,
        metavar="K",
        help="micro-batches per optimizer step (default %(default)s)",
    )
    run.add_argument(
        "--clip",
        type=argtypes.non_negative_float,
        default=d.clip,
        metavar="NORM",
        help="max global gradient norm; 0 disables clipping (default %(default)g)",
    )
    run.add_argument(
        "--lr",
        type=argtypes.positive_float,
        default=d.lr,
        help="peak AdamW learning rate; warm-up then cosine decay (default %(default)g)",
    )
    run.add_argument("--seed", type=int, default=d.seed, help="default %(default)s")
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="report directory (default runs/train-<time>)")
    out.add_argument(
        "--sample-chars",
        type=argtypes.non_negative_int,
        default=d.sample_chars,
        metavar="N",
        help="characters to sample from the trained model; 0 disables (default %(default)s)",
    )
    out.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save sharded checkpoints under DIR (step-N/ directories) at the end of the run",
    )
    ckpt.add_argument(
        "--checkpoint-every",
        type=argtypes.non_negative_int,
        default=d.checkpoint_every,
        metavar="N",
        help="also save every N steps (default: only at the end)",
    )
    ckpt.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="CHECKPOINT",
        help="continue from a checkpoint (a step-N directory, or a root: its latest); "
        "without a value, from --checkpoint-dir's latest. --steps is the total to reach; the "
        "learning rate continues the checkpoint's schedule",
    )
    ckpt.add_argument(
        "--new-schedule",
        action="store_true",
        help="with --resume: follow the schedule --steps and --lr describe from the resume "
        "point (the rate may jump there) instead of the checkpoint's",
    )


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    """Validated options; ``ValueError`` names what is wrong."""
    stages = tuple(STAGES) if args.compare_stages else (args.stage,)
    options = TrainOptions(
        stages=stages,
        compare_stages=args.compare_stages,
        precision=args.precision,
        preset=args.preset,
        world_size=args.world_size,
        steps=args.steps,
        batch=args.batch,
        grad_accum=args.grad_accum,
        clip=args.clip,
        lr=args.lr,
        bucket_mb=args.bucket_mb,
        offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params,
        offload_gradients=args.offload_gradients,
        offload_dir=args.offload_dir,
        offload_fraction=args.offload_fraction,
        offload_host_gradients=args.offload_host_gradients,
        activation_checkpointing=args.activation_checkpointing,
        tensor_parallel=args.tensor_parallel,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=_resume_path(args.resume, args.checkpoint_dir),
        new_schedule=args.new_schedule,
        seed=args.seed,
        out=args.out,
        sample_chars=args.sample_chars,
        quiet=args.quiet,
    )
    check_options(options)
    return options


def check_options(options: TrainOptions) -> None:
    """Reject, before any rank starts, options that cannot run together (``ZeroConfig`` checks
    its own fields here too, so that a bad one is a usage error, not one error per rank)."""
    if options.compare_stages:
        _check_offload_compares(options)
    for stage in options.stages:
        options.zero_config(stage, param_bytes=1)
    wants_checkpoints = options.checkpoint_dir is not None or options.resume is not None
    if wants_checkpoints and options.compare_stages:
        raise ValueError("--checkpoint-dir/--resume apply to one stage, not --compare-stages")
    if options.new_schedule and options.resume is None:
        raise ValueError("--new-schedule applies to a resumed run: add --resume")
    if options.checkpoint_every and options.checkpoint_dir is None:
        raise ValueError("--checkpoint-every needs --checkpoint-dir (where to save)")


def _check_offload_compares(options: TrainOptions) -> None:
    """``--compare-stages`` trains every stage: an offload flag that one of them cannot take is
    refused here, naming the flag and those stages (``ZeroConfig`` decides which can)."""
    offload = options.offload_config()  # its own rules first (--offload-dir), with its message
    flags = (
        ("--offload-optimizer", "optimizer"),
        ("--offload-params", "params"),
        ("--offload-gradients", "gradients"),
    )
    for flag, field in flags:
        tier = getattr(offload, field)
        if tier in ("none", "device"):
            continue
        alone = _alone(offload, field)
        takes = [s for s in STAGES if _stage_takes(s, alone)]
        refused = [s for s in options.stages if s not in takes]
        if refused:
            raise ValueError(
                f"{flag} {tier} needs stage {_join(takes, 'or')}, but --compare-stages also "
                f"trains stage{'s' if len(refused) > 1 else ''} {_join(refused, 'and')}: "
                f"drop {flag} or --compare-stages"
            )


def _alone(offload: OffloadConfig, field: str) -> OffloadConfig:
    """``offload`` with only ``field`` offloaded, as far as the tier rules allow (parameter and
    gradient offload need the optimizer's: the optimizer's own tier, else "cpu"), to ask which
    stages take that field."""
    optimizer = offload.optimizer
    if field != "optimizer" and not offload.optimizer_offloaded:
        optimizer = "cpu"
    params = offload.params if field == "params" else "none"
    gradients = offload.gradients if field == "gradients" else "device"
    path = offload.path if "nvme" in (optimizer, params, gradients) else None
    fraction = offload.optimizer_fraction if field == "optimizer" else 1.0
    return OffloadConfig(
        optimizer=optimizer,
        params=params,
        gradients=gradients,
        path=path,
        optimizer_fraction=fraction,
        host_gradients=offload.host_gradients,
    )


def _stage_takes(stage: int, offload: OffloadConfig) -> bool:
    try:
        ZeroConfig(stage=stage, offload=offload)
    except ValueError:
        return False
    return True


def _join(items: Sequence[int], last: str) -> str:
    """``[1, 2, 3], "or"`` -> ``"1, 2 or 3"``."""
    words = [str(i) for i in items]
    return f"{', '.join(words[:-1])} {last} {words[-1]}" if len(words) > 1 else "".join(words)


def _resume_path(resume: str | None, checkpoint_dir: str | None) -> str | None:
    """``--resume PATH`` -> PATH; a bare ``--resume`` -> ``--checkpoint-dir``."""
    if resume is None or resume:
        return resume
    if checkpoint_dir is None:
        raise ValueError("--resume without a path needs --checkpoint-dir (where to resume from)")
    return checkpoint_dir


def local_world_size(options: TrainOptions) -> int:
    """Ranks to start here: ``--world-size``, else 2 on CPU, else one per visible GPU."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return options.world_size or DEFAULT_CPU_WORLD_SIZE
    if options.world_size is not None and options.world_size > gpus:
        raise ValueError(
            f"--world-size {options.world_size} is more than the {gpus} visible GPUs "
            "(one rank per GPU); use several nodes with torchrun for more"
        )
    return options.world_size or gpus


def run(args: argparse.Namespace) -> int:
    """Validate, then launch the ranks here, or be one rank when torchrun started us."""
    parser: argparse.ArgumentParser = args.train_parser
    try:
        options = options_from_args(args)
        if under_torchrun():
            _check_torchrun_world(options)
            options.check_tensor_parallel(int(os.environ["WORLD_SIZE"]))
            return _run_as_rank(options)
        nproc = local_world_size(options)
        options.check_tensor_parallel(nproc)
    except ValueError as exc:
        parser.error(str(exc))
    from zerodp.apps.train.launch import launch_local
    from zerodp.apps.train.loop import resolve_out_dir

    # Resolved once here so that every rank, and the message at the end, agree on it.
    options = dataclasses.replace(options, out=str(resolve_out_dir(options.out)))
    return launch_local(options, nproc)


def _check_torchrun_world(options: TrainOptions) -> None:
    world = int(os.environ["WORLD_SIZE"])
    if options.world_size is not None and options.world_size != world:
        raise ValueError(
            f"--world-size {options.world_size} disagrees with torchrun's WORLD_SIZE={world}: "
            "under torchrun the world size comes from --nnodes x --nproc-per-node"
        )


def _run_as_rank(options: TrainOptions) -> int:
    from zerodp.apps.train.loop import rank_main

    rank_main(options)
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "python -m zerodp.apps.train") -> int:
    """``python -m zerodp.apps.train``: the same options and behaviour as ``zerodp train``."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_train_arguments(parser)
    parser.set_defaults(train_parser=parser)
    return run(parser.parse_args(argv))
