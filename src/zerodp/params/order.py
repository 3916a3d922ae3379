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
no extra exchange ([Note: inference] in hooks.py). ``ZeroConfig.stage3.check_unit_order=False``
skips the checks once a model is known to run the same units on every rank.

[Note: merged plans]
Ranks may run different units (top-1 MoE routing, a layer dropped on one rank, a branch taken on
some ranks): every rank learns every plan at the exchange, so where plans differ they are
merged instead of refused. A second small all-gather tells, per item of the union, whether each
rank can take part: a rank that did not plan an all-gather joins it as an *extra* (into a
scratch buffer freed as soon as it completes: at most one unit more than the bound, briefly); a
rank that did not plan a reduce-scatter joins it with zeros only if it is in the same backward
(``backwards`` column) and the unit was not used there since the last backward (``touched``), so
no gradient can arrive later; else the reduce-scatter is left for later on the ranks that
planned it (they keep the gradients; the end of backward reduces what is left, in unit order).
The agreed items are issued in one order that contains every rank's plan as a subsequence
(``_merge``, the same on every rank); extras are issued before the next own collective or right
after the last (``issue_extras``). A rank that cannot go on until its items are agreed (the end
of backward, the step, a buffer broadcast, a checkpoint) exchanges again while the others run:
their exchanges pair with its repeats. Where nothing can be agreed and every rank waits (one
more backward on one rank than on another), or two ranks order the same gathers differently,
every rank raises the divergence error. Markers that differ only by a rank not starting
anything wait for the next exchange. Cost: an all-gather or reduce-scatter of each unit run
anywhere, on every rank, plus one control all-gather per differing exchange.
"""

from __future__ import annotations

import enum
import weakref
from collections import deque
from collections.abc import Callable
from typing import NoReturn, Protocol

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


class Extras(Protocol):
    """What the schedule does for collectives other ranks planned and this rank did not
    ([Note: merged plans])."""

    def can(self, op: Op, index: int) -> bool:
        """Whether this rank can issue ``op`` on ``index`` as an extra now."""
        ...

    def planned(self, op: Op, index: int) -> None:
        """It will (the state changes now: a unit reduced as an extra is reduced)."""
        ...

    def issue(self, op: Op, index: int) -> None:
        """Issue it (in the merged order)."""
        ...


class _GathersOnly:
    def can(self, op: Op, index: int) -> bool:
        return False

    def planned(self, op: Op, index: int) -> None:
        raise AssertionError("no extras without a schedule")

    def issue(self, op: Op, index: int) -> None:
        raise AssertionError("no extras without a schedule")


_HEAD = 6  # error, marker, position, blocked, backwards, plan length


class OrderCheck:
    """Agreement of all ranks on the next stage-3 collectives (see module docstring)."""

    def __init__(
        self, comm: Communicator, labels: list[str], enabled: bool, device: torch.device
    ) -> None:
        self.comm = comm
        self.device = device
        self.labels = labels  # what each index names: units, then persistent segments
        self.enabled = enabled and comm.world_size > 1
        self.error = ""  # a local problem every rank must learn about (raised at the next check)
        self.calls = 0  # exchanges so far
        self.merges = 0  # exchanges whose plans differed and were merged
        self._extras: Callable[[], Extras | None] = lambda: None
        self.backwards = 0  # backward passes begun (set by the schedule)
        # Agreed and not issued yet, in the merged order: (op, index, this rank's own?).
        self._sequence: deque[tuple[Op, int, bool]] = deque()
        self._marker = Op.NOTHING  # sent with the next exchange
        self._positions: list[int] = []  # every rank's step position at the last exchange

    @property
    def extras(self) -> Extras:
        return self._extras() or _GathersOnly()

    @extras.setter
    def extras(self, extras: Extras) -> None:
        # A weak reference: the schedule owns the check, and nothing of it may be reachable
        # through the model but by its hooks (``copy.deepcopy`` of a model must meet a
        # parameter first, [Note: safe reads] in access.py).
        self._extras = weakref.ref(extras)

    def __call__(self, op: Op, index: int = -1) -> None:
        """Agree with every rank that the next collective is ``op`` on ``index``: consumes the
        approval ``approve`` gave it, or agrees on a plan of one (exchanging until every rank
        can issue it)."""
        if not self.enabled:
            self._raise_local()
            return
        self.issue_extras()
        if not self._sequence:
            while not self.approve([(op, index)], blocked=True)[0]:
                pass
            self.issue_extras()
        expected = self._sequence.popleft()
        if expected != (op, index, True):  # the schedule must issue exactly what it planned
            raise RuntimeError(
                f"zerodp internal error: planned {expected}, about to issue {(op, index)}"
            )

    def issue_extras(self) -> None:
        """Issue the agreed extras that come before this rank's next own collective (all of
        them if none is left): called before and after every own collective."""
        while self._sequence and not self._sequence[0][2]:
            op, index, _ = self._sequence.popleft()
            self.extras.issue(op, index)

    def mark(self, marker: Op) -> None:
        """Agree on what this rank starts (a training forward, an inference forward,
        ``generate``) in the next exchange: one more column of the row every exchange sends
        anyway, so it costs nothing. ``Op.NOTHING`` drops a marker no exchange took."""
        if self.enabled:
            self._marker = marker

    def approve(self, plan: list[tuple[Op, int]], blocked: bool = False) -> list[bool]:
        """Agree with every rank on the next collectives, in order (see the module
        docstring); the matching calls then need no exchange. Returns, per item of ``plan``,
        whether it was agreed: an item is left out only where some rank cannot issue it now
        ([Note: merged plans]), then the caller issues it later (a deferred reduce-scatter) or
        calls again (``blocked``: the caller cannot go on before it is agreed)."""
        if not self.enabled:
            self._raise_local()
            return [True] * len(plan)
        if not plan:
            return []
        self.issue_extras()
        if self._sequence:
            raise RuntimeError(f"zerodp internal error: {list(self._sequence)} not issued")
        plans, head = self._exchange(plan, blocked)
        if all(p == plan for p in plans):
            if len({row[1] for row in head}) > 1:  # same plan, different kinds of work
                self._diverged([(Op(row[1]), -1) for row in head])
            self._marker = Op.NOTHING
            self._sequence.extend((op, i, True) for op, i in plan)
            return [True] * len(plan)
        if len(set(self._positions)) > 1:  # ranks at different steps: never merged
            self._diverged(_first_difference(plans))
        # Markers: the ranks are not at the same point; a marker no rank contradicts waits.
        if len({row[1] for row in head}) == 1:
            self._marker = Op.NOTHING
        union = sorted({c for p in plans for c in p})
        same_pass = len({row[4] for row in head}) == 1
        bits = [int(c in plan or self._can_extra(c, same_pass)) for c in union]
        everyone = self.comm.all_gather_control(
            torch.tensor(bits, dtype=torch.int64, device=self.device)
        ).reshape(len(head), len(union))
        self.calls += 1
        self.merges += 1
        agreed = {c for k, c in enumerate(union) if bool(everyone[:, k].all())}
        if not agreed and all(row[3] for row in head):  # nobody can go on
            self._diverged(_first_difference(plans))
        while True:
            lists = [[c for c in p if c in agreed] for p in plans]
            order = _merge(lists)
            if order is not None:
                break
            # Two ranks order the same collectives differently (a rank at the end of its
            # backward reduces in unit order, another in the order its hooks ran): leave a
            # reduce-scatter for later, never a gather (a rank needs its gathers now).
            late = next((q[0] for q in lists if q and q[0][0] is Op.REDUCE), None)
            if late is None:
                self._diverged(_first_difference(plans))
            agreed.discard(late)
        for op, i in order:
            own = (op, i) in plan
            if not own:
                self.extras.planned(op, i)
            self._sequence.append((op, i, own))
        return [c in agreed for c in plan]

    def _can_extra(self, item: tuple[Op, int], same_pass: bool) -> bool:
        op, index = item
        if op is Op.GATHER or (op is Op.REDUCE and same_pass):
            return self.extras.can(op, index)
        return False

    def _raise_local(self) -> None:
        if self.error:
            error, self.error = self.error, ""
            raise RuntimeError(error)

    def _exchange(
        self, plan: list[tuple[Op, int]], blocked: bool
    ) -> tuple[list[list[tuple[Op, int]]], list[list[int]]]:
        """Every rank's plan and head row (error, marker, position, blocked, backwards,
        length): one all-gather of ``PLAN_SLOTS`` items, and more only where a plan is
        longer (every rank learns the longest length from the first)."""
        flags = [int(bool(self.error)), int(self._marker), _position(self.comm), int(blocked)]
        flags += [self.backwards, len(plan)]
        rows: list[list[int]] = []
        sent = 0
        while True:
            part = plan[sent : sent + PLAN_SLOTS]
            part = part + [(Op.NOTHING, -1)] * (PLAN_SLOTS - len(part))
            row = (flags if sent == 0 else []) + [v for op, i in part for v in (int(op), i)]
            mine = torch.tensor(row, dtype=torch.int64, device=self.device)
            got = self.comm.all_gather_control(mine).reshape(-1, len(row)).tolist()
            self.calls += 1
            if sent == 0:
                rows = got
                self._check_head(rows)
            else:
                rows = [a + b for a, b in zip(rows, got, strict=True)]
            sent += PLAN_SLOTS
            if sent >= max(row[5] for row in rows):
                break
        plans = [[(Op(r[k]), r[k + 1]) for k in range(_HEAD, _HEAD + 2 * r[5], 2)] for r in rows]
        return plans, [r[:_HEAD] for r in rows]

    def _check_head(self, rows: list[list[int]]) -> None:
        flagged = [r for r, row in enumerate(rows) if row[0]]
        if flagged:
            error, self.error = self.error, ""
            raise RuntimeError(
                f"zerodp stage 3: rank(s) {flagged} reported: {error or 'an error (see that rank)'}"
            )
        self._positions = [row[2] for row in rows]
        # Where every rank starts some work and the kinds differ (one evaluates while another
        # trains), that is the story.
        markers = [Op(row[1]) for row in rows]
        if Op.NOTHING not in markers and len(set(markers)) > 1:
            self._diverged([(m, -1) for m in markers])

    def _diverged(self, seen: list[tuple[Op, int]]) -> NoReturn:
        self._sequence.clear()
        doing = "; ".join(f"rank {r} {self._describe(o, i)}" for r, (o, i) in enumerate(seen))
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


def _first_difference(plans: list[list[tuple[Op, int]]]) -> list[tuple[Op, int]]:
    """Per rank, its item at the first position where the plans differ."""
    width = max(len(p) for p in plans)
    padded = [p + [(Op.NOTHING, -1)] * (width - len(p)) for p in plans]
    for k in range(width):
        seen = [p[k] for p in padded]
        if any(s != seen[0] for s in seen):
            return seen
    return [p[0] for p in padded]


def _merge(plans: list[list[tuple[Op, int]]]) -> list[tuple[Op, int]] | None:
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
