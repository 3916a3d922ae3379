"""Checkpoints in ``zerodp train``: resuming from ``--resume`` and saving every
``--checkpoint-every`` steps and after the last into ``--checkpoint-dir``."""

from __future__ import annotations

from torch import nn

from zerodp import ZeroOptimizer
from zerodp.apps.train.options import TrainOptions


def resume(options: TrainOptions, model: nn.Module, opt: ZeroOptimizer) -> int:
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
    step = opt.steps
    if step >= options.steps:
        raise ValueError(
            f"the checkpoint {options.resume} is at step {step}, not before --steps "
            f"{options.steps}: --steps is the total to reach, so raise it to train further"
        )
    return step


def maybe_save(options: TrainOptions, model: nn.Module, opt: ZeroOptimizer, done: int) -> None:
    """Save after ``done`` steps when ``--checkpoint-every`` says so, and after the last."""
    if options.checkpoint_dir is None:
        return
    every = options.checkpoint_every
    if done == options.steps or (every and done % every == 0):
        from zerodp.checkpoint import save_checkpoint

        save_checkpoint(options.checkpoint_dir, model, opt, extra={"seed": options.seed})
