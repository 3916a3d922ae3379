"""``zerodp consolidate CKPT OUT.safetensors``: a sharded checkpoint to one plain state dict.

CKPT is a checkpoint directory (``.../step-00001000``) or a checkpoint root (its ``latest`` is
used). The output loads into the plain model with
``model.load_state_dict(safetensors.torch.load_file(OUT))``. Runs offline: no process group, one
tensor in memory at a time.
"""

from __future__ import annotations

import argparse
import resource
import sys
from typing import Any

from zerodp.apps.progress import QUIET_HELP, bar


def add_parser(subparsers: Any) -> None:
    """Register the ``consolidate`` subcommand on the dispatcher's subparsers."""
    p = subparsers.add_parser(
        "consolidate",
        help="merge a sharded checkpoint into one safetensors state dict",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or checkpoint root")
    p.add_argument("output", metavar="OUT", help="output .safetensors file")
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="dtype of floating-point tensors in the output (default fp32: the master values)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the SHA-256 checks of manifest.json and the shard files (salvage)",
    )
    p.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zerodp.checkpoint import CheckpointError, consolidate_checkpoint

    error: Exception | None = None
    with bar(quiet=args.quiet, desc="consolidate", unit="B", unit_scale=True) as shown:

        def advance(done: int, total: int) -> None:
            shown.total = total
            shown.update(done - shown.n)

        try:
            result = consolidate_checkpoint(
                args.checkpoint,
                args.output,
                dtype=args.dtype,
                verify=not args.no_verify,
                progress=advance,
            )
        except (CheckpointError, OSError) as exc:
            error = exc
    if error is not None:
        print(f"zerodp consolidate: error: {error}", file=sys.stderr)
        return 1
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(
        f"wrote {result.path}: {result.tensors} tensors, {result.bytes / 2**20:.1f} MiB "
        f"({args.dtype}) from {result.checkpoint} (step {result.step}); "
        f"sha256 {result.sha256[:16]}...; peak RSS {peak_mib:.0f} MiB"
    )
    return 0
