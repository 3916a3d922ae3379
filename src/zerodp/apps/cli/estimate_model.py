"""What ``zerodp estimate`` is told about the model: its size (``--params``, ``--gpt-*``,
``--model``), and for a GPT or a measured step (``--model-step``) its activations, the
backward's working set and the largest stage-3 unit, also split over a tensor-parallel group
(``--tensor-parallel``, ``--partition-activations``)."""

from __future__ import annotations

import argparse
import os
import sys

from zerodp.memory import (
    BytesPerParam,
    GPTShape,
    Overheads,
    count_parameters,
    dtype_bytes,
    gpt_activation_bytes,
    gpt_largest_unit_params,
    gpt_param_count,
    gpt_working_bytes,
    trace_spec,
)

GPT_FLAGS = ("gpt_layers", "gpt_hidden", "gpt_vocab", "gpt_seq")


def model_given(args: argparse.Namespace) -> bool:
    gpt = any(getattr(args, flag) is not None for flag in GPT_FLAGS)
    return gpt or args.params is not None or args.model is not None


def model_size(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[float, GPTShape | None]:
    given_gpt = [flag for flag in GPT_FLAGS if getattr(args, flag) is not None]
    sources = [args.params is not None, bool(given_gpt), args.model is not None]
    if sum(sources) != 1:
        parser.error("give exactly one of --params, --gpt-layers/--gpt-hidden/..., or --model")
    if given_gpt:
        missing = [f"--{f.replace('_', '-')}" for f in GPT_FLAGS if f not in given_gpt]
        if missing:
            parser.error(f"a GPT description also needs {', '.join(missing)}")
        shape = GPTShape(
            layers=args.gpt_layers,
            hidden=args.gpt_hidden,
            vocab=args.gpt_vocab,
            seq_len=args.gpt_seq,
            micro_batch=args.gpt_batch,
            heads=args.gpt_heads or 0,
        )
        return float(gpt_param_count(shape, tensor_parallel=args.tensor_parallel)), shape
    if args.model is not None:
        # A console script does not put the working directory on sys.path; `--model mymod:f`
        # run from a project directory should still find mymod.
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            return float(count_parameters(args.model)), None
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            parser.error(f"--model {args.model}: {exc}")
    return float(args.params), None


def split_text(args: argparse.Namespace) -> str:
    t = args.tensor_parallel
    return f" per tensor-parallel rank (the model split {t} ways)" if t > 1 else ""


def check_tensor_parallel(
    args: argparse.Namespace, shape: GPTShape | None, parser: argparse.ArgumentParser
) -> None:
    t = args.tensor_parallel
    if t > 1 and shape is None:
        parser.error("--tensor-parallel needs a GPT description (--gpt-*)")
    if args.partition_activations and (t == 1 or not args.activation_checkpointing):
        parser.error(
            "--partition-activations needs --activation-checkpointing and --tensor-parallel"
        )
    if shape is not None and t > 1:
        for name, value in (
            ("hidden", shape.hidden),
            ("heads", shape.heads),
            ("vocab", shape.vocab),
        ):
            if value % t:
                parser.error(f"--tensor-parallel {t} does not divide the GPT's {name} ({value})")


def overheads_of(
    args: argparse.Namespace, shape: GPTShape | None, per_param: BytesPerParam
) -> Overheads:
    activations = working = 0.0
    unit_params = args.largest_unit_params or 0.0
    if shape is not None:
        p, t = dtype_bytes(args.precision), args.tensor_parallel
        activations = gpt_activation_bytes(
            shape,
            dtype_bytes=p,
            checkpointing=args.activation_checkpointing,
            tensor_parallel=t,
            partitioned=args.partition_activations,
        )
        working = gpt_working_bytes(shape, dtype_bytes=p, tensor_parallel=t)
        unit_params = args.largest_unit_params or gpt_largest_unit_params(shape, tensor_parallel=t)
    elif args.model_step is not None:  # measured: [Note: backward working set]
        trace = trace_spec(args.model, args.model_step)
        activations, working = trace.saved_bytes, trace.working_bytes
    return Overheads(
        working_bytes=working,
        activation_bytes=activations,
        bucket_bytes=args.bucket_bytes,
        largest_unit_bytes=unit_params * per_param.param_bytes,
        prefetch_depth=args.prefetch_depth,
    )
