"""Detecting ranks whose stage-3 collectives diverge, before they can hang.

Collectives are matched by the order they are issued in, not by what they carry. If a unit runs
on some ranks but not others (data-dependent control flow), one rank would all-gather unit k
while another all-gathers unit k+1 or reduce-scatters: a hang or silently mixed data. So before
every unit all-gather and reduce-scatter, and once before the step's agreement all-reduce, all
ranks exchange (operation, unit, error flag) in one tiny all-gather (``CONTROL`` traffic, not
counted as model data). Any difference raises the same ``RuntimeError`` on every rank, naming
what each rank was about to do. Because every stage-3 collective is preceded by a check of the
same shape, the first divergent point always meets a check on every rank.

The check is one small blocking collective, i.e. latency, about 3 per unit per step; set
``ZeroConfig.check_unit_order=False`` to skip it once a model is known to run the same units on
every rank.
"""

from __future__ import annotations

import enum

import torch

from zerodp.comm import Communicator


class Op(enum.IntEnum):
    GATHER = 1
    REDUCE = 2
    STEP = 3


_VERBS = {Op.GATHER: "all-gathers", Op.REDUCE: "reduce-scatters", Op.STEP: "is at the step"}


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
        self.calls = 0

    def __call__(self, op: Op, index: int = -1) -> None:
        if not self.enabled:
            if self.error:
                error, self.error = self.error, ""
                raise RuntimeError(error)
            return
        flags = [int(op), index, int(bool(self.error))]
        mine = torch.tensor(flags, dtype=torch.int64, device=self.device)
        everyone = self.comm.all_gather_control(mine).tolist()
        self.calls += 1
        flagged = [r for r, (_, _, e) in enumerate(everyone) if e]
        if flagged:
            error, self.error = self.error, ""
            raise RuntimeError(
                f"zerodp stage 3: rank(s) {flagged} reported: {error or 'an error (see that rank)'}"
            )
        if any(tuple(e) != tuple(everyone[0]) for e in everyone):
            doing = "; ".join(
                f"rank {r} {self._describe(Op(o), i)}" for r, (o, i, _) in enumerate(everyone)
            )
            raise RuntimeError(
                "zerodp stage 3: ranks diverged at a parameter collective: "
                f"{doing}. Every rank must run the same units in the same order in each step "
                "(a unit that runs on some ranks only is not supported: put its parameters in "
                "an enclosing unit via ZeroConfig.unit_classes or unit_policy)"
            )

    def _describe(self, op: Op, index: int) -> str:
        if op is Op.STEP:
            return _VERBS[op]
        return f"{_VERBS[op]} '{self.labels[index]}'"
