"""The optimizer steps of one stage in ``zerodp train``: gradient accumulation, clipping, the
curves each rank records, and rank 0's progress bar (and its notes of each checkpoint saved)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from zerodp import ZeroModule, ZeroOptimizer
from zerodp.apps.data.corpus import BatchSampler, train_val_split
from zerodp.apps.models.gpt import GPT
from zerodp.apps.progress import bar as progress_bar
from zerodp.apps.train.checkpoints import maybe_save
from zerodp.apps.train.options import FAIL_AT_ENV, TrainOptions, parse_fail_at
from zerodp.apps.train.schedule import Schedule
from zerodp.apps.train.world import RankContext
from zerodp.memory import MemoryMeter, SavedForBackward
from zerodp.tensor_parallel import layout_of


@dataclass(slots=True)
class Curves:
    """What this rank records step by step."""

    first_step: int
    tokens_per_step: int
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    volumes: list[int] = field(default_factory=list)
    # Measured by the device's meter ([Note: memory meters] in zerodp/memory/meter.py): the
    # peak over the steps, and the activations the last step's forward left for its backward.
    peak_memory: int | None = None
    activations: int | None = None
    # A model split over a tensor-parallel group: the last step's TP traffic (its own ledger).
    tp_comm: dict[str, Any] | None = None


def run_steps(
    options: TrainOptions,
    stage: int,
    ctx: RankContext,
    data: torch.Tensor,
    model: nn.Module,
    opt: ZeroOptimizer,
    first_step: int,
    schedule: Schedule,
    meter: MemoryMeter,
) -> Curves:
    train, _ = train_val_split(data)
    seq_len = cast(GPT, model).config.seq_len
    sampler = BatchSampler(train, options.batch, seq_len, options.seed, ctx.dp_rank, ctx.dp_size)
    tokens = ctx.dp_size * options.batch * options.grad_accum * seq_len
    curves = Curves(first_step=first_step, tokens_per_step=tokens)
    fail_at = parse_fail_at(os.environ.get(FAIL_AT_ENV))
    meter.reset_peak()  # the steps' own peak (where only a lifetime peak exists: that)
    layout = layout_of(model)
    tp_ledger = layout.tp.ledger if layout is not None else None
    if tp_ledger is not None:
        tp_ledger.end_step()  # from here on, one window per step
    with _progress(options, stage, ctx, first_step) as bar:
        for step in range(first_step, options.steps):
            if fail_at == (ctx.rank, step):
                raise RuntimeError(
                    f"injected failure on rank {ctx.rank} at step {step} ({FAIL_AT_ENV})"
                )
            start = time.perf_counter()
            lr = schedule.lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr
            last = step == options.steps - 1
            loss, norm = train_step(
                options, step, ctx, model, opt, sampler, curves if last else None
            )
            curves.times.append(time.perf_counter() - start)
            curves.losses.append(loss)
            curves.lrs.append(lr)
            if norm is not None:
                curves.norms.append(norm)
            stats = opt.comm_stats()
            curves.volumes.append(stats.volume if stats is not None else 0)
            if tp_ledger is not None:
                curves.tp_comm = tp_ledger.end_step().to_dict()
            saved = maybe_save(options, schedule, model, opt, step + 1)
            if saved is not None and bar is not None:
                bar.write(f"checkpoint after step {step + 1}: {saved}", file=sys.stderr)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{loss:.3f}", tok_s=f"{tokens / curves.times[-1]:,.0f}", refresh=False
                )
                bar.update(1)
    curves.peak_memory = meter.peak()
    return curves


def train_step(
    options: TrainOptions,
    step: int,
    ctx: RankContext,
    model: nn.Module,
    opt: ZeroOptimizer,
    sampler: BatchSampler,
    measure: Curves | None = None,
) -> tuple[float, float | None]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, grad norm).
    ``measure``: record there the bytes the last forward saves for its backward."""
    total = torch.zeros((), device=ctx.device)
    for micro in range(options.grad_accum):
        x, y = sampler.batch_at(step * options.grad_accum + micro)
        last = micro == options.grad_accum - 1
        # Only the last backward of the step communicates; the others accumulate locally.
        sync = contextlib.nullcontext() if last else cast(ZeroModule, model).no_sync()
        saved = SavedForBackward(model.parameters()) if measure and last else None
        with sync:
            with saved or contextlib.nullcontext():
                _, loss = model(x.to(ctx.device), y.to(ctx.device))
            if saved is not None and measure is not None:
                measure.activations = saved.alive_bytes()  # stage 3's gathered ones are freed
                saved.release()
            assert loss is not None
            # ZeroOptimizer.backward multiplies by the loss scale under fp16 (required there).
            opt.backward(loss / options.grad_accum)
        total += loss.detach()
    norm = float(opt.clip_grad_norm_(options.clip)) if options.clip > 0 else None
    opt.step()
    opt.zero_grad()
    return float(total) / options.grad_accum, norm


@contextlib.contextmanager
def _progress(options: TrainOptions, stage: int, ctx: RankContext, first_step: int) -> Any:
    """A bar (step, loss, tokens/s, ETA) on rank 0 (drawn unless ``--quiet`` or standard error
    is not a terminal; its ``write`` prints either way); ``None`` elsewhere."""
    if ctx.rank != 0:
        yield None
        return
    bar = progress_bar(
        quiet=options.quiet,
        total=options.steps,
        initial=first_step,
        desc=f"stage {stage}",
        unit="step",
    )
    try:
        yield bar
    finally:
        bar.close()
