"""The per-rank side of ``zerodp train``: one process of the data-parallel world.

``rank_main`` is the entry point of every rank, whoever started it: ``zerodp train`` (through
torch's elastic launcher) or ``torchrun ... -m zerodp.apps.train``. It joins the process group from
torchrun's environment variables, trains the GPT preset on the embedded corpus for each requested
ZeRO stage, gathers losses, memory reports and traffic on rank 0, and there writes the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import os
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

import zerodp
from zerodp import ZeroOptimizer
from zerodp.apps.data.corpus import decode, encode, load_corpus
from zerodp.apps.models.gpt import GPT, generate, get_config, num_parameters
from zerodp.apps.models.gpt_tp import tensor_parallel_gpt
from zerodp.apps.train.checkpoints import resume
from zerodp.apps.train.options import ErrorNote, TrainOptions
from zerodp.apps.train.report import build_report, write_report
from zerodp.apps.train.result import RunResult
from zerodp.apps.train.schedule import lr_factor
from zerodp.apps.train.steps import Curves, run_steps
from zerodp.apps.train.summary import format_summary
from zerodp.apps.train.theory import activations_theory, working_theory
from zerodp.apps.train.world import RankContext, environment, join_world
from zerodp.comm import destroy, receives_point_to_point
from zerodp.comm.launch import record
from zerodp.memory import dtype_bytes, meter_for
from zerodp.tensor_parallel import TensorParallel

# Re-exported: callers and tests import these from here, the rank's entry module.
__all__ = [
    "SAMPLE_PROMPT",
    "RankContext",
    "environment",
    "lr_factor",
    "rank_main",
    "resolve_out_dir",
]

SAMPLE_PROMPT = "def "
"""The corpus is Python source: a function definition is a prompt whose continuation shows at
a glance whether the model learned anything."""


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
    ctx = join_world(options.tensor_parallel)
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


# -- one stage --------------------------------------------------------------------------------


def _train_stage(
    options: TrainOptions, stage: int, ctx: RankContext, data: torch.Tensor
) -> RunResult:
    meter = meter_for(ctx.device)  # [Note: memory meters]
    baseline = meter.current()  # the runtime (CPU: torch, Python, the data), before the model
    torch.manual_seed(options.seed)  # same initial weights and data for every stage compared
    gpt = GPT(get_config(options.preset)).to(ctx.device)
    model_params = num_parameters(gpt)
    group = None
    if ctx.mesh is not None:  # every rank split the same full model: [Note: tensor parallelism]
        gpt = tensor_parallel_gpt(gpt, TensorParallel(ctx.mesh["tp"]))
        group = ctx.mesh["dp"]
    inner = torch.optim.AdamW(gpt.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.1)
    param_bytes = num_parameters(gpt) * dtype_bytes(options.precision)
    config = options.zero_config(stage, param_bytes)
    model, opt = zerodp.initialize(gpt, inner, config, process_group=group)
    first_step, schedule = resume(options, model, opt, tell=ctx.rank == 0)
    curves = run_steps(options, stage, ctx, data, model, opt, first_step, schedule, meter)
    process = {
        "source": meter.source,
        "baseline": baseline,
        "peak": curves.peak_memory,
        "activations": curves.activations,
    }
    result = _gather_result(stage, ctx, opt, curves, process)
    result.model_params = model_params
    cfg = gpt.config
    result.activations_theory = activations_theory(
        cfg, options.batch, result.element_size, opt.config.activations, ctx.tensor_parallel
    )
    result.working_theory = working_theory(
        cfg, options.batch, result.element_size, ctx.tensor_parallel
    )
    result.sample_prompt = SAMPLE_PROMPT
    result.sample_text = _sample(model, options, ctx)
    del model, opt, inner, gpt
    gc.collect()  # free this stage's buffers before the next stage allocates its own
    return result


def _gather_result(
    stage: int, ctx: RankContext, opt: ZeroOptimizer, curves: Curves, process: dict[str, Any]
) -> RunResult:
    """Every rank's losses, memory report and measured memory (``process``), on every rank
    (rank 0 uses them)."""
    memory = opt.memory_report()
    gathered: list[tuple[list[float], dict]] = [([], {})] * ctx.world_size
    mine = {**memory.to_dict(), "process": process, "global_rank": ctx.rank}
    torch.distributed.all_gather_object(gathered, (curves.losses, mine))
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
        element_size=dtype_bytes(opt.config.precision.compute),
        reduce_element_size=dtype_bytes(opt.config.precision.reduce),
        bucket_bytes=opt.config.bucket_bytes,
        receive_fraction=_receive_fraction(ctx),
        config=opt.config.to_dict(),
        memory=[g[1] for g in gathered],
        comm=stats.to_dict() if stats is not None else None,
        comm_volumes=curves.volumes,
        tp_comm=curves.tp_comm,
        skipped_steps=opt.skipped_steps,
        loss_scale=opt.loss_scale,
    )


def _receive_fraction(ctx: RankContext) -> float:
    """Each staging bucket's reduce-scatter receive buffer, as a fraction of the bucket."""
    dp = ctx.world_size // ctx.tensor_parallel
    return (dp - 1) / dp if receives_point_to_point(ctx.backend, ctx.device) else 0.0


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


def _write_and_print(
    options: TrainOptions, ctx: RankContext, results: list[RunResult], out_dir: Path
) -> None:
    env = environment(ctx, get_config(options.preset).seq_len, options.precision)
    report = build_report(options.to_dict(), env, results)
    json_path, png_path = write_report(report, out_dir)
    print(format_summary(report))
    print(f"\nReport: {json_path} and {png_path}", flush=True)
