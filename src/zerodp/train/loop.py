"""The per-rank side of ``zerodp train``: one process of the data-parallel world.

``rank_main`` is the entry point of every rank, whoever started it: ``zerodp train`` (through
torch's elastic launcher) or ``torchrun ... -m zerodp.train``. It joins the process group from
torchrun's environment variables, trains the GPT preset on the embedded corpus for each requested
ZeRO stage, gathers losses, memory reports and traffic on rank 0, and there writes the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

import zerodp
from zerodp.comm.communicator import Communicator, destroy, init_from_env
from zerodp.comm.elastic import record
from zerodp.data.corpus import BatchSampler, decode, encode, load_corpus, train_val_split
from zerodp.memory.estimator import dtype_bytes
from zerodp.models.gpt import GPT, Block, generate, get_config, num_parameters
from zerodp.module import ZeroModule
from zerodp.optim.optimizer import ZeroOptimizer
from zerodp.plan import DTYPES
from zerodp.train.options import FAIL_AT_ENV, ErrorNote, TrainOptions, parse_fail_at
from zerodp.train.report import RunResult, build_report, format_summary, write_report

SAMPLE_PROMPT = "def "
"""The corpus is Python source: a function definition is a prompt whose continuation shows at
a glance whether the model learned anything."""

_PG_TIMEOUT_S = 600.0  # a hung collective becomes an error after this, not a silent hang


@dataclass(frozen=True, slots=True)
class RankContext:
    """Where this process sits in the world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str


@record
def rank_main(options: TrainOptions, error_dir: str | None = None) -> str | None:
    """Train as one rank; rank 0 returns the report directory, the others ``None``.

    ``@record`` writes this rank's exception and traceback to the error file the elastic agent
    (torchrun's, or ``zerodp train``'s) reads, so it can show *this* error instead of a bare
    exit code. ``error_dir``: where the local launcher collects timed error notes as well.
    """
    with _noting_errors(error_dir):
        return _rank_main(options)


def _rank_main(options: TrainOptions) -> str | None:
    ctx = _join_world()
    out_dir = None
    if ctx.rank == 0:
        out_dir = resolve_out_dir(options.out)
        out_dir.mkdir(parents=True, exist_ok=True)  # an unwritable --out fails now, not at the end
    data = load_corpus()
    results = [_train_stage(options, stage, ctx, data) for stage in options.stages]
    if out_dir is not None:
        _write_and_print(options, ctx, results, out_dir)
    destroy()
    return None if out_dir is None else str(out_dir)


@contextlib.contextmanager
def _noting_errors(error_dir: str | None) -> Iterator[None]:
    """Leave an ``ErrorNote`` in ``error_dir`` if the body raises (see
    ``launch.format_failures`` for why the launcher needs the time)."""
    try:
        yield
    except BaseException as exc:
        if error_dir is not None:
            rank = int(os.environ.get("RANK", "-1"))
            note = ErrorNote(
                rank=rank,
                time_ns=time.time_ns(),
                summary=f"{type(exc).__name__}: {exc}",
                traceback="".join(traceback.format_exception(exc)),
            )
            # Best effort: failing to write the note must not hide the error itself.
            with contextlib.suppress(OSError):
                path = Path(error_dir) / f"rank-{rank}.json"
                path.write_text(json.dumps(dataclasses.asdict(note)), encoding="utf-8")
        raise


def resolve_out_dir(out: str | None, now: datetime.datetime | None = None) -> Path:
    """``--out``, or ``runs/train-<timestamp>`` (UTC, to the second) when not given."""
    if out is not None:
        return Path(out)
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"train-{stamp}"


# -- set-up -----------------------------------------------------------------------------------


def _join_world() -> RankContext:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        _limit_threads(local_world)
    init_from_env(timeout_s=_PG_TIMEOUT_S)
    world = Communicator(None)
    return RankContext(
        rank=world.rank,
        world_size=world.world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        device=device,
        backend=world.backend,
    )


def _limit_threads(local_world_size: int) -> None:
    """Share the cores between the ranks of this node. Ranks each using every core (torch's
    default) oversubscribe the CPU and run several times slower. An explicit OMP_NUM_THREADS
    (torchrun sets 1) is left alone."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, local_world_size)))


# -- one stage --------------------------------------------------------------------------------


def _train_stage(
    options: TrainOptions, stage: int, ctx: RankContext, data: torch.Tensor
) -> RunResult:
    torch.manual_seed(options.seed)  # same initial weights and data for every stage compared
    gpt = GPT(get_config(options.preset)).to(ctx.device)
    largest_unit = _largest_unit_params(gpt)
    inner = torch.optim.AdamW(gpt.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.1)
    param_bytes = num_parameters(gpt) * dtype_bytes(options.precision)
    config = zerodp.ZeroConfig(
        stage=stage,
        precision=options.precision,
        bucket_bytes=options.bucket_bytes_for(param_bytes),
    )
    try:
        model, opt = zerodp.initialize(gpt, inner, config)
    except NotImplementedError as exc:
        # Every rank raises the same error before any collective, so all skip together.
        if options.compare_stages:
            return RunResult.skipped(stage, str(exc))
        raise
    _check_precision(model, options.precision)
    first_step = _resume(options, model, opt)
    curves = _run_steps(options, stage, ctx, data, model, opt, first_step)
    result = _gather_result(stage, ctx, opt, curves)
    result.largest_unit_bytes = largest_unit * result.element_size
    result.sample_prompt = SAMPLE_PROMPT
    result.sample_text = _sample(model, options, ctx)
    del model, opt, inner, gpt
    gc.collect()  # free this stage's buffers before the next stage allocates its own
    return result


def _check_precision(model: nn.Module, precision: str) -> None:
    expected = DTYPES[precision]
    found = {p.dtype for p in model.parameters() if p.requires_grad}
    if found != {expected}:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in found))
        raise NotImplementedError(
            f"--precision {precision} is not available yet in this version of zerodp: "
            f"zerodp.initialize left the parameters in {names}; use --precision fp32"
        )


def _largest_unit_params(model: GPT) -> int:
    """Stage 3 gathers one transformer block at a time, and the rest of the model as one root
    unit; the larger bounds the gathered parameter buffer."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    block = max((num_parameters(b) for b in blocks), default=0)
    return max(block, num_parameters(model) - sum(num_parameters(b) for b in blocks))


# -- checkpoints ------------------------------------------------------------------------------


def _resume(options: TrainOptions, model: nn.Module, opt: ZeroOptimizer) -> int:
    """Load ``--resume`` (on every rank) and return the step to continue from; 0 without it.

    The data and the learning rate are pure functions of the step number, so the step restored
    with the checkpoint is all the loop needs to continue exactly where the saved run was.
    """
    if options.resume is None:
        return 0
    from zerodp.checkpoint import load_checkpoint

    extra = load_checkpoint(options.resume, model, opt)
    saved_seed = extra.get("seed") if isinstance(extra, dict) else None
    if saved_seed is not None and saved_seed != options.seed:
        raise ValueError(
            f"the checkpoint {options.resume} was trained with --seed {saved_seed}: resume with "
            "the same seed, or the data stream would not continue where it stopped"
        )
    step = opt.engine.steps
    if step >= options.steps:
        raise ValueError(
            f"the checkpoint {options.resume} is at step {step}, not before --steps "
            f"{options.steps}: --steps is the total to reach, so raise it to train further"
        )
    return step


def _maybe_save(options: TrainOptions, model: nn.Module, opt: ZeroOptimizer, done: int) -> None:
    """Save after ``done`` steps when ``--checkpoint-every`` says so, and after the last."""
    if options.checkpoint_dir is None:
        return
    every = options.checkpoint_every
    if done == options.steps or (every and done % every == 0):
        from zerodp.checkpoint import save_checkpoint

        save_checkpoint(options.checkpoint_dir, model, opt, extra={"seed": options.seed})


# -- the steps --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Curves:
    """What this rank records step by step."""

    first_step: int
    tokens_per_step: int
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    volumes: list[int] = field(default_factory=list)


def _run_steps(
    options: TrainOptions,
    stage: int,
    ctx: RankContext,
    data: torch.Tensor,
    model: nn.Module,
    opt: ZeroOptimizer,
    first_step: int,
) -> _Curves:
    train, _ = train_val_split(data)
    seq_len = cast(GPT, model).config.seq_len
    sampler = BatchSampler(train, options.batch, seq_len, options.seed, ctx.rank, ctx.world_size)
    tokens = ctx.world_size * options.batch * options.grad_accum * seq_len
    curves = _Curves(first_step=first_step, tokens_per_step=tokens)
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
            loss, norm = _train_step(options, step, ctx, model, opt, sampler)
            curves.times.append(time.perf_counter() - start)
            curves.losses.append(loss)
            curves.lrs.append(lr)
            if norm is not None:
                curves.norms.append(norm)
            stats = opt.comm_stats()
            curves.volumes.append(stats.volume if stats is not None else 0)
            _maybe_save(options, model, opt, step + 1)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{loss:.3f}", tok_s=f"{tokens / curves.times[-1]:,.0f}", refresh=False
                )
                bar.update(1)
    return curves


def _train_step(
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
            _backward(opt, loss / options.grad_accum)
        total += loss.detach()
    norm = float(opt.clip_grad_norm_(options.clip)) if options.clip > 0 else None
    opt.step()
    opt.zero_grad()
    return float(total) / options.grad_accum, norm


def _backward(opt: ZeroOptimizer, loss: torch.Tensor) -> None:
    # ZeroOptimizer.backward multiplies by the loss scale under fp16 (where it is required);
    # a version without it only knows plain backward.
    backward = getattr(opt, "backward", None)
    if backward is None:
        loss.backward()
    else:
        backward(loss)


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


def _gather_result(stage: int, ctx: RankContext, opt: ZeroOptimizer, curves: _Curves) -> RunResult:
    """Every rank's losses and memory report, on every rank (rank 0 uses them)."""
    memory = opt.memory_report()
    gathered = opt.engine.comm.all_gather_object((curves.losses, memory.to_dict()))
    per_rank_losses = [g[0] for g in gathered]
    mean_losses = [sum(step) / len(step) for step in zip(*per_rank_losses, strict=True)]
    stats = opt.comm_stats()
    return RunResult(
        stage=stage,
        first_step=curves.first_step,
        losses=mean_losses,
        grad_norms=curves.norms,
        lrs=curves.lrs,
        step_times=curves.times,
        tokens_per_step=curves.tokens_per_step,
        num_params=memory.num_params,
        element_size=dtype_bytes(opt.engine.config.precision),
        reduce_element_size=dtype_bytes(opt.engine.config.reduce_dtype),
        bucket_bytes=opt.engine.config.bucket_bytes,
        memory=[g[1] for g in gathered],
        comm=stats.to_dict() if stats is not None else None,
        comm_volumes=curves.volumes,
        skipped_steps=int(getattr(opt, "skipped_steps", 0)),
        loss_scale=getattr(opt, "loss_scale", None),
    )


def _sample(model: nn.Module, options: TrainOptions, ctx: RankContext) -> str:
    """Text generated after ``SAMPLE_PROMPT``. Every rank generates (identically: same weights
    and seed) rather than rank 0 alone, because with sharded parameters (stage 3) a forward pass
    is itself collective."""
    if options.sample_chars <= 0:
        return ""
    prompt = encode(SAMPLE_PROMPT).to(ctx.device)[None]
    generator = torch.Generator(device=ctx.device).manual_seed(options.seed)
    out = generate(
        cast(GPT, model),
        prompt,
        max_new_tokens=options.sample_chars,
        temperature=0.8,
        top_k=40,
        generator=generator,
    )
    tokens = out[0, prompt.shape[1] :].tolist()
    # Presets with a vocabulary beyond bytes (gpt120m) can sample ids no byte decodes to.
    return decode([t if t < 256 else ord("?") for t in tokens])


# -- report -----------------------------------------------------------------------------------


def _write_and_print(
    options: TrainOptions, ctx: RankContext, results: list[RunResult], out_dir: Path
) -> None:
    env = environment(ctx, get_config(options.preset).seq_len)
    report = build_report(options.to_dict(), env, results)
    json_path, png_path = write_report(report, out_dir)
    print(format_summary(report))
    print(f"\nReport: {json_path} and {png_path}", flush=True)


def environment(ctx: RankContext, seq_len: int) -> dict[str, Any]:
    return {
        "world_size": ctx.world_size,
        "nodes": max(1, ctx.world_size // max(1, ctx.local_world_size)),
        "backend": ctx.backend,
        "device": ctx.device.type,
        "seq_len": seq_len,
        "torch": torch.__version__,
        "zerodp": zerodp.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "threads_per_rank": torch.get_num_threads(),
    }
