"""``zerodp estimate``: per-rank memory of ZeRO-DP stages 0-3 across world sizes, in theory.
``zerodp estimate --offload``: bytes per tier and step time of offload placements on a machine
(estimate_offload.py).

``zerodp estimate --params 7.5e9 --world-sizes 1,4,16,64,256,1024`` prints the 7.5B row of the
ZeRO paper's Table 1 (mixed-precision Adam, K = 12), with a stage-0 column added. Describe a GPT
(``--gpt-*``) to add activations; give ``--device-memory-gb`` to see what fits and which stage to
use. Only arithmetic runs: no process group, and this command needs torch only for ``--model``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal
from typing import Any

from zerodp.apps.cli import estimate_offload
from zerodp.apps.cli.argtypes import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from zerodp.apps.cli.estimate_model import (
    check_tensor_parallel,
    model_given,
    model_size,
    overheads_of,
    split_text,
)
from zerodp.config import ZeroConfig
from zerodp.memory import (
    GB,
    OPTIMIZER_STATE_BYTES,
    PRECISIONS,
    STAGES,
    BytesPerParam,
    MemoryEstimate,
    Overheads,
    bytes_per_param,
    estimate_memory,
    fits,
)

_COLUMN = 10


def add_parser(subparsers: Any) -> None:
    """Register the ``estimate`` subcommand on the dispatcher's subparsers."""
    p = subparsers.add_parser(
        "estimate",
        help="per-rank memory of ZeRO stages 0-3 across world sizes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group(
        "model (give exactly one of --params, --gpt-*, --model; --offload: at most one)"
    )
    model.add_argument(
        "--params", type=positive_float, metavar="N", help="parameter count, e.g. 7.5e9"
    )
    model.add_argument(
        "--gpt-layers", type=positive_int, metavar="L", help="GPT transformer blocks"
    )
    model.add_argument("--gpt-hidden", type=positive_int, metavar="H", help="GPT hidden size")
    model.add_argument("--gpt-vocab", type=positive_int, metavar="V", help="GPT vocabulary size")
    model.add_argument("--gpt-seq", type=positive_int, metavar="S", help="GPT sequence length")
    model.add_argument(
        "--gpt-heads",
        type=positive_int,
        metavar="A",
        help="GPT attention heads (default: hidden / 64)",
    )
    model.add_argument(
        "--gpt-batch",
        type=positive_int,
        metavar="B",
        help=f"micro-batch per rank (default 1; {estimate_offload.DEFAULT_BATCH} with --offload)",
    )
    model.add_argument(
        "--model", metavar="MODULE:FACTORY", help="count a model built on the meta device"
    )
    model.add_argument(
        "--model-step",
        metavar="MODULE:FUNCTION",
        help="with --model: FUNCTION(model) runs one forward at the batch you train with and "
        "returns the loss; one step of the model (built for real, on the CPU) is measured for "
        "its activations and the backward's working set",
    )
    p.add_argument(
        "--world-sizes",
        type=_world_sizes,
        metavar="N,N,...",
        help="comma-separated data-parallel degrees (default 1,4,16,64,256,1024; --offload: "
        "one, default 1)",
    )
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="default bf16")
    p.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZER_STATE_BYTES),
        default="adam",
        help="sets K: its fp32 state, +4 B master copy with bf16/fp16 (default adam)",
    )
    p.add_argument(
        "--k",
        type=non_negative_float,
        metavar="K",
        help="optimizer bytes per parameter (overrides table)",
    )
    p.add_argument(
        "--bucket-bytes",
        type=positive_int,
        default=ZeroConfig().bucket_bytes,
        metavar="BYTES",
        help="gradient bucket size in bytes (default: ZeroConfig's)",
    )
    p.add_argument(
        "--prefetch-depth",
        type=non_negative_int,
        default=1,
        metavar="D",
        help="stage-3 units gathered ahead",
    )
    p.add_argument(
        "--largest-unit-params",
        type=positive_float,
        metavar="N",
        help="parameters of the largest stage-3 gather unit (default: from --gpt-*, else 0)",
    )
    p.add_argument(
        "--device-memory-gb",
        type=positive_float,
        metavar="GB",
        help="memory per device (1e9 B); with --offload it replaces the machine's",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="with --gpt-* only; with --offload: always (else both are tried)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="T",
        help="with --gpt-*: each GPT split over T ranks (Megatron's layout, as zerodp train "
        "--tensor-parallel); the world sizes are then the data-parallel degrees",
    )
    p.add_argument(
        "--partition-activations",
        action="store_true",
        help="with --activation-checkpointing and --tensor-parallel: each rank keeps 1/T of "
        "every checkpoint (P_a)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    estimate_offload.add_arguments(p)
    p.set_defaults(func=run, estimate_parser=p)


def run(args: argparse.Namespace) -> int:
    """Compute the estimates for every world size and stage and print them."""
    parser: argparse.ArgumentParser = args.estimate_parser
    if args.offload:
        if args.tensor_parallel > 1 or args.partition_activations or args.model_step:
            parser.error(
                "--tensor-parallel, --partition-activations and --model-step: not with "
                "--offload (its cost model knows the unsplit GPT layout)"
            )
        if args.gpt_batch is None:
            args.gpt_batch = estimate_offload.DEFAULT_BATCH
        models = [] if not model_given(args) else [model_size(args, parser)]
        return estimate_offload.run(args, parser, models)
    stray = estimate_offload.given_offload_flags(args)
    if stray:
        parser.error(f"{', '.join(stray)}: needs --offload")
    if args.gpt_batch is None:
        args.gpt_batch = 1
    if args.world_sizes is None:
        args.world_sizes = [1, 4, 16, 64, 256, 1024]
    num_params, shape = model_size(args, parser)
    if args.activation_checkpointing and shape is None:
        parser.error("--activation-checkpointing needs a GPT description (--gpt-*)")
    if args.model_step is not None and args.model is None:
        parser.error("--model-step needs --model (the model its function steps)")
    check_tensor_parallel(args, shape, parser)
    per_param = bytes_per_param(args.precision, args.optimizer, k=args.k)
    try:
        overheads = overheads_of(args, shape, per_param)
    except (ImportError, AttributeError, ValueError, TypeError, RuntimeError) as exc:
        parser.error(f"--model-step {args.model_step}: {type(exc).__name__}: {exc}")
    device_bytes = None if args.device_memory_gb is None else args.device_memory_gb * GB
    rows = [
        [estimate_memory(num_params, n, stage, per_param, overheads) for stage in STAGES]
        for n in args.world_sizes
    ]
    if args.json:
        print(json.dumps(_to_json(args, num_params, per_param, overheads, device_bytes, rows)))
    else:
        print(_to_text(args, num_params, per_param, overheads, device_bytes, rows))
    return 0


def format_gb(num_bytes: float) -> str:
    """Bytes as GB (1e9) at the precision the ZeRO paper's Table 1 prints.

    From the table's own numbers: 100 GB and more is truncated to whole GB (513.5 -> "513",
    4187.5 -> "4187", 2218.75 -> "2218"); smaller values are rounded half up to 1 decimal from
    10 GB (41.25 -> "41.3", 15.625 -> "15.6") and to 2 decimals below (1.875 -> "1.88"), and
    below 1 GB to 2 significant figures (0.46875 -> "0.47"); trailing zeros are dropped
    ("7.5", "30").
    """
    # 12 significant digits wash out float noise, so 41.25 is not seen as 41.2499999.
    value = Decimal(f"{num_bytes / GB:.12g}")
    if value == 0:
        return "0"
    if value >= 100:
        rounded = value.quantize(Decimal(1), rounding=ROUND_DOWN)
    elif value >= 1:
        step = Decimal("0.1") if value >= 10 else Decimal("0.01")
        rounded = value.quantize(step, rounding=ROUND_HALF_UP)
    else:
        step = Decimal(1).scaleb(value.adjusted() - 1)
        rounded = value.quantize(step, rounding=ROUND_HALF_UP)
    return format(rounded.normalize(), "f")


def _to_text(
    args: argparse.Namespace,
    num_params: float,
    per_param: BytesPerParam,
    overheads: Overheads,
    device_bytes: float | None,
    rows: list[list[MemoryEstimate]],
) -> str:
    optimizer = "K override" if args.k is not None else args.optimizer
    lines = [
        "Per-rank model-state memory in GB (1 GB = 1e9 bytes), as in the ZeRO paper's Table 1",
        f"{num_params:,.0f} parameters{split_text(args)}; {args.precision} parameters "
        f"({per_param.param_bytes:g} B)"
        f" and gradients ({per_param.grad_bytes:g} B); {optimizer} optimizer state"
        f" K = {per_param.optimizer_bytes_per_param:g} B per parameter",
        "",
        _header(),
    ]
    for row in rows:
        lines.append(_row(row[0].world_size, [format_gb(e.model_states.total) for e in row]))
    lines.append("")
    if args.model_step is not None:
        lines.append(
            f"Activations per rank: {format_gb(overheads.activation_bytes)} GB"
            f" (measured: one step of {args.model_step})"
        )
    elif overheads.activation_bytes:
        how = "with" if args.activation_checkpointing else "without"
        part = ", partitioned (P_a)" if args.partition_activations else ""
        lines.append(
            f"Activations per rank: {format_gb(overheads.activation_bytes)} GB"
            f" ({how} activation checkpointing{part}, micro-batch {args.gpt_batch})"
        )
    else:
        lines.append(
            "Activations and margin: not counted (describe the model with --gpt-*, or "
            "--model with --model-step, to include them)"
        )
    if overheads.working_bytes:
        lines.append(
            f"Margin per rank: {format_gb(overheads.working_bytes)} GB (the backward's working "
            "set: gradients of activations and a fresh weight gradient)"
        )
    buffers = ", ".join(f"stage {e.stage} {format_gb(e.buffers)}" for e in rows[0])
    gathered = (overheads.prefetch_depth + 1) * overheads.largest_unit_bytes
    of_which = f" (of which {format_gb(gathered)} gathered stage-3 units)" if gathered else ""
    lines.append(f"Communication buffers per rank (GB): {buffers}{of_which}")
    if device_bytes is not None:
        lines += ["", *_fit_table(rows, device_bytes, args.device_memory_gb)]
    return "\n".join(lines)


def _fit_table(
    rows: list[list[MemoryEstimate]], device_bytes: float, device_gb: float
) -> list[str]:
    lines = [
        f"Peak per rank (model states + activations + buffers + margin) in GB on a {device_gb:g}"
        " GB device",
        _header() + "  recommended",
    ]
    for row in rows:
        cells = [f"{format_gb(e.peak)} {'yes' if fits(e, device_bytes) else 'no'}" for e in row]
        best = _recommended(row, device_bytes)
        lines.append(_row(row[0].world_size, cells) + f"  {_stage_name(best)}")
    return lines


def _recommended(row: list[MemoryEstimate], device_bytes: float) -> int | None:
    # recommend_stage's answer, from the estimates already computed for the table.
    return next((e.stage for e in row if fits(e, device_bytes)), None)


def _to_json(
    args: argparse.Namespace,
    num_params: float,
    per_param: BytesPerParam,
    overheads: Overheads,
    device_bytes: float | None,
    rows: list[list[MemoryEstimate]],
) -> dict[str, Any]:
    world_sizes = []
    for row in rows:
        n = row[0].world_size
        recommended = None if device_bytes is None else _recommended(row, device_bytes)
        world_sizes.append(
            {
                "world_size": n,
                "stages": [_estimate_json(e, device_bytes) for e in row],
                "recommended_stage": recommended,
            }
        )
    return {
        "num_params": num_params,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "bytes_per_param": per_param._asdict(),
        "gb": GB,
        "activation_checkpointing": args.activation_checkpointing,
        "activation_bytes": overheads.activation_bytes,
        "bucket_bytes": overheads.bucket_bytes,
        "largest_unit_bytes": overheads.largest_unit_bytes,
        "prefetch_depth": overheads.prefetch_depth,
        "device_memory_bytes": device_bytes,
        "world_sizes": world_sizes,
    }


def _estimate_json(e: MemoryEstimate, device_bytes: float | None) -> dict[str, Any]:
    return {
        "stage": e.stage,
        "parameters": e.model_states.parameters,
        "gradients": e.model_states.gradients,
        "optimizer_state": e.model_states.optimizer_state,
        "model_states": e.model_states.total,
        "activations": e.activations,
        "buffers": e.buffers,
        "total": e.total,
        "margin": e.margin,
        "peak": e.peak,
        "fits": None if device_bytes is None else fits(e, device_bytes),
    }


def _header() -> str:
    return "world size" + "".join(f"stage {s}".rjust(_COLUMN) for s in STAGES)


def _row(world_size: int, cells: Sequence[str]) -> str:
    # At least one space before each cell: a wide one (a tiny model's "0.00059 yes") must not
    # run into its neighbour.
    return f"{world_size:>10}" + "".join(" " + cell.rjust(_COLUMN - 1) for cell in cells)


def _stage_name(stage: int | None) -> str:
    return "none" if stage is None else f"stage {stage}"


def _world_sizes(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 1,4,16; got {text!r}"
        )
    return [int(part) for part in parts]
