"""Detecting ranks whose stage-3 collectives diverge, before they can hang.

Collectives are matched by the order they are issued in, not by what they carry. If a unit runs
on some ranks but not others (data-dependent control flow), one rank would all-gather unit k
while another all-gathers unit k+1 or reduce-scatters: a hang or silently mixed data. So before
every unit all-gather and reduce-scatter, and once before the step's agreement all-reduce, all
ranks exchange (operation, unit, error flag) in one tiny all-gather (``CONTROL`` traffic, not
counted as model data). Any difference raises the same ``RuntimeError`` on every rank, naming
what each rank was about to do. Because every stage-3 collective is preceded by a check of the
same shape, the first divergent point always meets a check on every rank.

The check is one small blocking collective: it makes every rank wait for the slowest to reach
the same point (measured: that synchronisation, not the collective's latency, is its cost). So
where one hook is about to issue several collectives (the backward hook of a unit reduce-scatters
the unit that just finished and prefetches the next one; the end of backward reduces every unit
left), ``approve`` agrees on the whole plan, up to ``PLAN_SLOTS`` collectives per exchange, and
each collective of the plan then goes ahead without an exchange of its own: about 2 checks per
unit per step instead of 3. A plan is compared as a whole, slot by slot (a single check is a plan
of one), so a rank that plans something else still meets the others at an exchange of the same
shape and every rank raises. Each exchange also carries a *marker* column (``mark``): what the
rank started since the last exchange (a training forward, a forward without gradients,
``generate``), so ranks doing different kinds of work over the same units are told apart with
no extra exchange ([Note: inference] in hooks.py). ``ZeroConfig.check_unit_order=False`` skips
the checks once a model is known to run the same units on every rank.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import NoReturn

import torch

from zerodp.comm import STEP_PHASES, Communicator


class Op(enum.IntEnum):
    NOTHING = 0  # an unused slot of a plan
    GATHER = 1
    REDUCE = 2
    STEP = 3
    BUFFERS = 7  # the broadcast of the root's buffers before a training forward
    CHECKPOINT = 8  # save_checkpoint / load_checkpoint's first exchange
    # Markers (``OrderCheck.mark``): no collective of their own; what a rank starts, agreed on
    # in the next exchange ([Note: inference] in hooks.py).
    TRAIN = 4
    INFER = 5
    GENERATE = 6


_UNLABELLED = (Op.STEP, Op.NOTHING, Op.TRAIN, Op.INFER, Op.GENERATE, Op.BUFFERS, Op.CHECKPOINT)

PLAN_SLOTS = 4
"""Collectives agreed on per exchange (``approve``); every exchange has this shape."""


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
}

_INFERENCE_HINT = (
    " To generate or evaluate on some ranks only, or a different number of batches per rank, "
    "hold the full parameters on every rank for the block: `with zerodp.full_parameters(model):`"
    " (every rank), then run the forwards or generate on the ranks that need them inside it; "
    "model.generate on every rank needs nothing (it keeps the ranks in step). See "
    'docs/stage3.md, "Inference and generate".'
)


class OrderCheck:
    """Agreement of all ranks on the next stage-3 collective (see module docstring)."""

    def __init__(
        self, comm: Communicator, labels: list[str], enabled: bool, device: torch.device
    ) -> None:
        self.comm = comm
        self.device = device
        self.labels = labels  # what each index names: units, then persistent segments
        self.enabled = enabled and comm.world_size > 1
        self.error = ""  # a local problem every rank must learn about (raised at the next check)
        self.calls = 0  # exchanges so far
        self._approved: deque[tuple[Op, int]] = deque()  # agreed, not issued yet
        self._marker = Op.NOTHING  # sent with the next exchange
        self._positions: list[int] = []  # every rank's step position at the last exchange

    def __call__(self, op: Op, index: int = -1) -> None:
        """Agree with every rank that the next collective is ``op`` on ``index``: consumes the
        approval ``approve`` gave it, or exchanges a plan of one."""
        if not self._approved:
            self.approve([(op, index)])
            if not self._approved:  # checks disabled
                return
        expected = self._approved.popleft()
        if expected != (op, index):  # the schedule must issue exactly what it planned
            raise RuntimeError(
                f"zerodp internal error: planned {expected}, about to issue {(op, index)}"
            )

    def mark(self, marker: Op) -> None:
        """Agree on what this rank starts (a training forward, an inference forward,
        ``generate``) in the next exchange: one more column of the row every exchange sends
        anyway, so it costs nothing. ``Op.NOTHING`` drops a marker no exchange took."""
        if self.enabled:
            self._marker = marker

    def approve(self, plan: list[tuple[Op, int]]) -> None:
        """Agree with every rank on the next collectives, in order (see the module
        docstring); the matching calls then need no exchange."""
        if not self.enabled:
            if self.error:
                error, self.error = self.error, ""
                raise RuntimeError(error)
            return
        for start in range(0, len(plan), PLAN_SLOTS):
            part = plan[start : start + PLAN_SLOTS]
            self._exchange(part)
            self._approved.extend(part)

    def _exchange(self, part: list[tuple[Op, int]]) -> None:
        slots = part + [(Op.NOTHING, -1)] * (PLAN_SLOTS - len(part))
        flags = [int(bool(self.error)), int(self._marker), _position(self.comm)]
        flags += [v for op, i in slots for v in (int(op), i)]
        self._marker = Op.NOTHING
        mine = torch.tensor(flags, dtype=torch.int64, device=self.device)
        everyone = self.comm.all_gather_control(mine).tolist()
        self.calls += 1
        flagged = [r for r, row in enumerate(everyone) if row[0]]
        if flagged:
            error, self.error = self.error, ""
            raise RuntimeError(
                f"zerodp stage 3: rank(s) {flagged} reported: {error or 'an error (see that rank)'}"
            )
        self._positions = [row[2] for row in everyone]
        # Column 1 is the marker, column 2 the step position, then (op, index) per slot. Where
        # every rank starts some work and the kinds differ (one evaluates while another
        # trains), that is the story; else the collectives say best where ranks diverge, and a
        # marker differing alone comes last.
        markers = [(Op(row[1]), -1) for row in everyone]
        if Op.NOTHING not in {m for m, _ in markers} and len(set(markers)) > 1:
            self._diverged(markers)
        for col in range(3, 3 + 2 * PLAN_SLOTS, 2):
            seen = [(Op(row[col]), row[col + 1]) for row in everyone]
            if any(s != seen[0] for s in seen):
                self._diverged(seen)
        if len(set(markers)) > 1:
            self._diverged(markers)

    def _diverged(self, seen: list[tuple[Op, int]]) -> NoReturn:
        self._approved.clear()
        doing = "; ".join(f"rank {r} {self._describe(o, i)}" for r, (o, i) in enumerate(seen))
        if any(o in (Op.INFER, Op.GENERATE) for o, _ in seen):
            advice = (
                "Every rank must run the same forwards at stage 3 (each gathers parameters)."
                + _INFERENCE_HINT
            )
        else:
            advice = (
                "Every rank must run the same units in the same order in each step (a unit "
                "that runs on some ranks only is not supported: put its parameters in an "
                "enclosing unit via ZeroConfig.unit_classes or unit_policy)"
            )
        if len(set(self._positions)) > 1:  # the usual cause: say it first
            where = ", ".join(
                f"rank {r} {_describe_position(v)}" for r, v in enumerate(self._positions)
            )
            advice = (
                f"Ranks are at different steps ({where}): every rank must run the same number "
                "of optimizer steps (before save_checkpoint or load_checkpoint too). " + advice
            )
        raise RuntimeError(
            f"zerodp stage 3: ranks diverged at a parameter collective: {doing}. {advice}"
        )

    def _describe(self, op: Op, index: int) -> str:
        if op in _UNLABELLED:
            return _VERBS[op]
        return f"{_VERBS[op]} '{self.labels[index]}'"


def _position(comm: Communicator) -> int:
    """Steps completed, doubled, plus one inside a step: equal on every rank of a correct
    program at every exchange."""
    progress = comm.progress
    return 2 * progress.step + int(progress.phase in STEP_PHASES)


def _describe_position(value: int) -> str:
    step, inside = divmod(value, 2)
    return f"in step {step + 1}" if inside else f"after step {step}"
