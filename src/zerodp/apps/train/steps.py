"""The optimizer steps of one stage in ``zerodp train``: the learning-rate schedule, gradient
accumulation, clipping, the curves each rank records, and rank 0's progress bar."""

from __future__ import annotations

import contextlib
import math
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
from zerodp.apps.train.checkpoints import maybe_save
from zerodp.apps.train.options import FAIL_AT_ENV, TrainOptions, parse_fail_at
from zerodp.apps.train.world import RankContext


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


def run_steps(
    options: TrainOptions,
    stage: int,
    ctx: RankContext,
    data: torch.Tensor,
    model: nn.Module,
    opt: ZeroOptimizer,
    first_step: int,
) -> Curves:
    train, _ = train_val_split(data)
    seq_len = cast(GPT, model).config.seq_len
    sampler = BatchSampler(train, options.batch, seq_len, options.seed, ctx.rank, ctx.world_size)
    tokens = ctx.world_size * options.batch * options.grad_accum * seq_len
    curves = Curves(first_step=first_step, tokens_per_step=tokens)
    fail_at = parse_fail_at(os.environ.get(FAIL_AT_ENV))
    with _progress(options, stage, ctx, first_step) as bar:
        for step in range(first_step, options.steps):
            if fail_at == (ctx.rank, step):
                raise RuntimeError(
                    f"injected failure on rank {ctx.rank} at step {step} ({FAIL_AT_ENV})"
                )
            start = time.perf_counter()
            lr = options.lr * lr_factor(step, options.steps, options.warmup_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            loss, norm = train_step(options, step, ctx, model, opt, sampler)
            curves.times.append(time.perf_counter() - start)
            curves.losses.append(loss)
            curves.lrs.append(lr)
            if norm is not None:
                curves.norms.append(norm)
            stats = opt.comm_stats()
            curves.volumes.append(stats.volume if stats is not None else 0)
            maybe_save(options, model, opt, step + 1)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{loss:.3f}", tok_s=f"{tokens / curves.times[-1]:,.0f}", refresh=False
                )
                bar.update(1)
    return curves


def train_step(
    options: TrainOptions,
    step: int,
    ctx: RankContext,
    model: nn.Module,
    opt: ZeroOptimizer,
    sampler: BatchSampler,
) -> tuple[float, float | None]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, grad norm)."""
    total = torch.zeros((), device=ctx.device)
    for micro in range(options.grad_accum):
        x, y = sampler.batch_at(step * options.grad_accum + micro)
        last = micro == options.grad_accum - 1
        # Only the last backward of the step communicates; the others accumulate locally.
        sync = contextlib.nullcontext() if last else cast(ZeroModule, model).no_sync()
        with sync:
            _, loss = model(x.to(ctx.device), y.to(ctx.device))
            assert loss is not None
            # ZeroOptimizer.backward multiplies by the loss scale under fp16 (required there).
            opt.backward(loss / options.grad_accum)
        total += loss.detach()
    norm = float(opt.clip_grad_norm_(options.clip)) if options.clip > 0 else None
    opt.step()
    opt.zero_grad()
    return float(total) / options.grad_accum, norm


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% at ``total``: the usual
    GPT schedule, as a pure function of the step (so a resumed run continues it exactly)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@contextlib.contextmanager
def _progress(options: TrainOptions, stage: int, ctx: RankContext, first_step: int) -> Any:
    """A tqdm bar (step, loss, tokens/s, ETA) on rank 0; ``None`` elsewhere."""
    if ctx.rank != 0:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(
        total=options.steps,
        initial=first_step,
        desc=f"stage {stage}",
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    try:
        yield bar
    finally:
        bar.close()
