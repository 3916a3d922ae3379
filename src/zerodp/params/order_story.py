"""What the stage-3 order check agrees on (``Op``) and what it says when ranks diverge.

One message for every way of finding a divergence: the blocking exchange of order.py and the
replayed order of replay.py ([Note: verified orders]) name the same things, so a user sees the
same error whichever found it.
"""

from __future__ import annotations

import enum


class Op(enum.IntEnum):
    NOTHING = 0  # an unused slot of a plan
    GATHER = 1
    REDUCE = 2
    STEP = 3
    BUFFERS = 7  # the broadcast of the root's buffers before a training forward
    CHECKPOINT = 8  # save_checkpoint / load_checkpoint's first exchange
    SKIPS = 9  # a backward's agreement on the gathers it skips ([Note: backward without ...])
    # Markers (``OrderCheck.mark``): no collective of their own; what a rank starts, agreed on
    # in the next exchange ([Note: inference] in hooks.py).
    TRAIN = 4
    INFER = 5
    GENERATE = 6


Item = tuple[Op, int]

_UNLABELLED = (
    Op.STEP,
    Op.NOTHING,
    Op.TRAIN,
    Op.INFER,
    Op.GENERATE,
    Op.BUFFERS,
    Op.CHECKPOINT,
    Op.SKIPS,
)

_VERBS = {
    Op.NOTHING: "issues nothing more",
    Op.GATHER: "all-gathers",
    Op.REDUCE: "reduce-scatters",
    Op.STEP: "is at the step",
    Op.TRAIN: "starts a training forward",
    Op.INFER: "starts a forward without gradients (eval / no_grad)",
    Op.GENERATE: "starts model.generate",
    Op.BUFFERS: "broadcasts the module buffers",
    Op.CHECKPOINT: "saves or loads a checkpoint",
    Op.SKIPS: "starts a backward",
}

_INFERENCE_HINT = (
    " To generate or evaluate on some ranks only, or a different number of batches per rank, "
    "hold the full parameters on every rank for the block: `with zerodp.full_parameters(model):`"
    " (every rank), then run the forwards or generate on the ranks that need them inside it; "
    "model.generate on every rank needs nothing (it keeps the ranks in step). See "
    'docs/stage3.md, "Inference and generate".'
)

_REPLAY_HINT = (
    " (Found against the order of the previous step, which every rank had run alike: a model "
    "whose ranks run different units only now and then needs "
    "ZeroConfig.stage3.check_unit_order='exchange', which merges them at any step.)"
)


def divergence_message(
    seen: list[Item], positions: list[int], labels: list[str], replayed: bool = False
) -> str:
    """The error every rank raises: what each rank was about to do (``seen``, per rank), where
    each stands (``positions``: ``step_position`` values) and what to do about it."""
    doing = "; ".join(f"rank {r} {describe(o, i, labels)}" for r, (o, i) in enumerate(seen))
    if any(o in (Op.INFER, Op.GENERATE) for o, _ in seen):
        advice = (
            "Every rank must run the same forwards at stage 3 (each gathers parameters)."
            + _INFERENCE_HINT
        )
    else:
        advice = (
            "Every rank must run the same backwards and steps; units that run on some "
            "ranks only are merged, but not the same units in different orders (put "
            "their parameters in an enclosing unit via ZeroConfig.stage3.unit_classes or "
            "unit_policy)"
        )
        if replayed and len(set(positions)) == 1:
            advice += "." + _REPLAY_HINT
    if len(set(positions)) > 1:  # the usual cause: say it first
        where = ", ".join(f"rank {r} {describe_position(v)}" for r, v in enumerate(positions))
        advice = (
            f"Ranks are at different steps ({where}): every rank must run the same number "
            "of optimizer steps (before save_checkpoint or load_checkpoint too). " + advice
        )
    return f"zerodp stage 3: ranks diverged at a parameter collective: {doing}. {advice}"


def reported_message(flagged: list[int], text: str) -> str:
    """The error every rank raises when ranks ``flagged`` found a problem of their own
    (``text``: this rank's, where it is one of them)."""
    return f"zerodp stage 3: rank(s) {flagged} reported: {text or 'an error (see that rank)'}"


def describe(op: Op, index: int, labels: list[str]) -> str:
    if op in _UNLABELLED:
        return _VERBS[op]
    return f"{_VERBS[op]} '{labels[index]}'"


def describe_position(value: int) -> str:
    step, inside = divmod(value, 2)
    return f"in step {step + 1}" if inside else f"after step {step}"


def first_difference(plans: list[list[Item]]) -> list[Item]:
    """Per rank, its item at the first position where the plans differ."""
    width = max(len(p) for p in plans)
    padded = [p + [(Op.NOTHING, -1)] * (width - len(p)) for p in plans]
    for k in range(width):
        seen = [p[k] for p in padded]
        if any(s != seen[0] for s in seen):
            return seen
    return [p[0] for p in padded]
