"""Checkpoints in ``zerodp train``: resuming from ``--resume`` and saving every
``--checkpoint-every`` steps and after the last into ``--checkpoint-dir``."""

from __future__ import annotations

import sys
from pathlib import Path

from torch import nn

from zerodp import ZeroOptimizer
from zerodp.apps.train.options import TrainOptions
from zerodp.apps.train.schedule import Schedule, resumed_schedule


def resume(
    options: TrainOptions, model: nn.Module, opt: ZeroOptimizer, *, tell: bool
) -> tuple[int, Schedule]:
    """Load ``--resume`` (on every rank): the step to continue from (0 without it) and the
    learning-rate schedule to follow. ``tell``: print what changed (rank 0).

    The data and the learning rate are pure functions of the step number, so the step restored
    with the checkpoint and its schedule are all the loop needs to continue exactly where the
    saved run was ([Note] in schedule.py).
    """
    wanted = options.schedule()
    if options.resume is None:
        return 0, wanted
    from zerodp.checkpoint import load_checkpoint

    extra = load_checkpoint(options.resume, model, opt)
    saved_seed = extra.get("seed") if isinstance(extra, dict) else None
    if saved_seed is not None and saved_seed != options.seed:
        raise ValueError(
            f"the checkpoint {options.resume} was trained with --seed {saved_seed}: resume with "
            "the same seed, or the data stream would not continue where it stopped"
        )
    step = opt.steps
    if step >= options.steps:
        raise ValueError(
            f"the checkpoint {options.resume} is at step {step}, not before --steps "
            f"{options.steps}: --steps is the total to reach, so raise it to train further"
        )
    saved = Schedule.from_dict(extra.get("schedule") if isinstance(extra, dict) else None)
    schedule, note = resumed_schedule(wanted, saved, step, new=options.new_schedule)
    if tell:
        print(f"zerodp train: resuming {options.resume} at step {step}", file=sys.stderr)
        if note is not None:
            print(f"zerodp train: {note}", file=sys.stderr, flush=True)
    return step, schedule


def maybe_save(
    options: TrainOptions, schedule: Schedule, model: nn.Module, opt: ZeroOptimizer, done: int
) -> Path | None:
    """Save after ``done`` steps when ``--checkpoint-every`` says so, and after the last; the
    new checkpoint's directory, or ``None``. The seed and the schedule go with it."""
    if options.checkpoint_dir is None:
        return None
    every = options.checkpoint_every
    if done != options.steps and not (every and done % every == 0):
        return None
    from zerodp.checkpoint import save_checkpoint

    extra = {"seed": options.seed, "schedule": schedule.to_dict()}
    return save_checkpoint(options.checkpoint_dir, model, opt, extra=extra)
