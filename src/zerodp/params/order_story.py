"""What the stage-3 order check agrees on (``Op``) and what it says when ranks diverge.

One message for every way of finding a divergence: the blocking exchange of order.py and the
replayed order of replay.py ([Note: verified orders]) name the same things, so a user sees the
same error whichever found it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable


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


def replayed_divergence(
    plans: list[list[Item]],
    markers: list[Op],
    lefts: list[int],
    flagged: list[int],
    predicted: Callable[[int], tuple[int, tuple[Item, ...]] | None],
    where: tuple[list[int], list[str]],
    own: tuple[int, str],
) -> str:
    """The error of a divergence found against the replayed order ([Note: verified orders] in
    replay.py), from every rank's row: its plan, marker, where it left a block it promised
    (``lefts``, -1: it did not) and whether it reported an error (``flagged``). Told where the
    first rank left: the others were about to issue the ``predicted`` entry there. ``where``:
    the ranks' step positions and the labels; ``own``: this rank and its error text, if any."""
    positions, labels = where
    rank, error = own
    plans, markers = list(plans), list(markers)
    left = [p for p in lefts if p >= 0]
    if left:
        at = min(left)
        entry = predicted(at)
        assert entry is not None
        for r, p in enumerate(lefts):
            if p != at:
                markers[r], plans[r] = Op(entry[0]), list(entry[1])
    if flagged:  # this rank's own text only where its row carried it
        message = reported_message(flagged, error if rank in flagged else "")
    elif len(set(markers)) > 1 and (
        Op.NOTHING not in markers or all(p == plans[0] for p in plans)
    ):  # as a blocking exchange tells it: what each rank started
        seen = [
            (m, -1) if m is not Op.NOTHING else p[0] for m, p in zip(markers, plans, strict=True)
        ]
        message = divergence_message(seen, positions, labels)
    else:
        message = divergence_message(first_difference(plans), positions, labels, replayed=True)
    if error and rank not in flagged:
        message += f" (This rank also found: {error})"
    return message


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


def merge_plans(plans: list[list[tuple[Op, int]]]) -> list[tuple[Op, int]] | None:
    """One order containing every plan as a subsequence (the same on every rank: ranks take
    their heads in rank order), or None where two plans order two items differently."""
    left = [list(p) for p in plans]
    out: list[tuple[Op, int]] = []
    while any(left):
        for p in left:
            if p and all(not q or q[0] == p[0] or p[0] not in q for q in left):
                head = p[0]
                out.append(head)
                for q in left:
                    if q and q[0] == head:
                        q.pop(0)
                break
        else:
            return None
    return out
