"""``zerodp bench``: zerodp against its peers on one model, data and seed, in one invocation.

Configurations (``--configs``, default all): ``ddp`` (DistributedDataParallel, the reference),
``plain`` (no wrapper; world size 1 only, "not available" otherwise), ``zero0``-``zero3``
(zerodp), ``zero2-offload`` / ``zero3-offload`` (zerodp with the optimizer offloaded to the
CPU), ``zero3-infinity`` (parameters and optimizer state on NVMe, in ``--offload-dir``: its
traffic per step is printed beside the disk's bandwidth, measured in the same run), ``zro``
(torch ZeroRedundancyOptimizer over DDP), ``fsdp2`` / ``fsdp2-noreshard``
(``fully_shard`` per transformer block then the root, reshard_after_forward True / False),
``deepspeed1``-``deepspeed3`` (only where ``import deepspeed`` works: an optional extra, "not
installed" otherwise).

Each configuration runs in its own launch of torch's elastic launcher (gloo on CPU, NCCL with
CUDA), so the peak RSS per rank is its own. Printed: step time (median, min, ratio to DDP,
phases, the torch optimizer's own update within step), bytes held per rank by category (zerodp
from memory_report, peers counted from their tensors), peak RSS and where it goes,
communication per step (zerodp measured, with its calls and bytes per collective; peers
theory), and the largest relative difference of the final parameters to DDP's; with
``--profile-steps``, each configuration's top operators under torch.profiler. ``--json`` writes
it all.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from zerodp.apps.bench.systems import BACKENDS, KNOWN, PRECISIONS, parse_configs

# argparse converters shared with `zerodp estimate` (same messages, exit status 2).
from zerodp.apps.cli.argtypes import non_negative_int, positive_float, positive_int
from zerodp.apps.models.gpt import PRESETS
from zerodp.apps.progress import QUIET_HELP


def add_parser(subparsers: Any) -> None:
    """Register the ``bench`` subcommand on the dispatcher's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="zerodp stages vs DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed: time, memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset", choices=tuple(PRESETS), default="bench25m", help="model size (default bench25m)"
    )
    p.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="local ranks (default 2 on CPU, one per GPU)",
    )
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="default fp32")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps (default 10)")
    p.add_argument(
        "--warmup", type=non_negative_int, default=2, help="untimed steps first (default 2)"
    )
    p.add_argument(
        "--configs",
        type=_configs,
        default=list(KNOWN),
        metavar="A,B,...",
        help=f"'all' (default) or some of {','.join(KNOWN)}",
    )
    p.add_argument("--bucket-mb", type=positive_float, default=25.0, help="bucket MiB (default 25)")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per rank (default 4)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="launch every configuration R times (default 1)",
    )
    p.add_argument(
        "--threads", type=non_negative_int, default=0, help="per rank (0: cores / ranks)"
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="checkpoint every transformer block in every system (non-reentrant "
        "torch.utils.checkpoint via zerodp.checkpoint_wrapper)",
    )
    p.add_argument(
        "--fused-adamw",
        action="store_true",
        help="AdamW(fused=True) for every system (zerodp uses it anyway when left unset)",
    )
    p.add_argument(
        "--profile-steps",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="then N more steps under torch.profiler: top operators per config (default 0)",
    )
    p.add_argument(
        "--offload-dir",
        metavar="DIR",
        help="zero3-infinity's files (default: the temporary directory); its disk is measured",
    )
    p.add_argument("--ring-buckets", type=positive_int, default=2, help="offload rings (default 2)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto: NCCL with CUDA, gloo on CPU; gloo: gloo with CUDA too, so that several ranks "
        "can share one GPU (for checks, not for speed; default auto)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="PATH", help="write the full report here")
    p.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zerodp.apps.bench import BenchOptions, format_report, run_bench

    options = BenchOptions(
        configs=tuple(args.configs),
        preset=args.preset,
        world_size=args.world_size or _default_world_size(),
        precision=args.precision,
        steps=args.steps,
        warmup=args.warmup,
        batch=args.batch,
        bucket_mb=args.bucket_mb,
        rounds=args.rounds,
        threads=args.threads,
        seed=args.seed,
        fused_adamw=args.fused_adamw,
        activation_checkpointing=args.activation_checkpointing,
        profile_steps=args.profile_steps,
        ring_buckets=args.ring_buckets,
        backend=args.backend,
        **({"offload_dir": os.path.abspath(args.offload_dir)} if args.offload_dir else {}),
    )
    report = run_bench(options, quiet=args.quiet)
    print(format_report(report), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}", flush=True)
    failed = [n for n, c in report["configs"].items() if c["status"] == "failed"]
    unequal = [
        n
        for n, c in report["configs"].items()
        if c.get("parity_vs_ddp") and not c["parity_vs_ddp"]["passed"]
    ]
    return 1 if failed or unequal else 0


def _default_world_size() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _configs(text: str) -> list[str]:
    try:
        return parse_configs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
