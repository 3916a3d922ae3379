"""Narrow views of one rank's training state, for the code around the step.

Checkpoints and parameter access (``full_parameters``, state dicts) do not read the engine's
fields: the engine hands them one of these, built on demand (so never stale after parameters
were adopted), holding exactly what they read and the two actions they may take (``meet``
before a collective outside the step, ``publish`` after writing masters). The memory report
takes ``memory.report.Holdings``, a record of byte counts. See docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.optim.loss_scaler import DynamicLossScaler
from zerodp.optim.masters import Masters
from zerodp.optim.pieces import OptimPiece
from zerodp.params.manager import ShardedParams
from zerodp.params.order import Op
from zerodp.partition.segment import Segment


@dataclass(slots=True)
class StepCounters:
    """How many optimizer steps ran; a checkpoint saves them and a resume continues them."""

    steps: int = 0  # attempted, skipped ones included
    skipped_steps: int = 0
    steps_without_backward: int = 0  # step() with no gradient produced since the last step

    def saved(self) -> dict[str, int]:
        """Every counter but ``steps`` (the manifest's ``step`` field holds it)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "steps"}

    def restore(self, step: int, saved: dict[str, int]) -> None:
        """From a checkpoint; counters it lacks (an older format) restart at 0."""
        self.steps = step
        for f in fields(self):
            if f.name != "steps":
                setattr(self, f.name, int(saved.get(f.name, 0)))


@dataclass(frozen=True, slots=True)
class CheckpointState:
    """What ``save_checkpoint`` and ``load_checkpoint`` read and restore."""

    comm: Communicator
    stage: int
    precision: str
    config: dict[str, Any]  # ZeroConfig.to_dict()
    segments: Sequence[Segment]
    frozen: Sequence[tuple[str, nn.Parameter]]
    pieces: Sequence[OptimPiece]
    optimizer: torch.optim.Optimizer  # the user's, rebound to the pieces
    masters: Masters
    scaler: DynamicLossScaler | None  # fp16 only
    counters: StepCounters
    meet: Callable[[Op], None]  # stage 3: agree with ranks still in a step first
    publish: Callable[[], None]  # the masters were written: make the parameters follow


@dataclass(frozen=True, slots=True)
class ParamAccess:
    """What ``zerodp.full_parameters`` reads: the segments and masters it writes edits back to,
    and stage 3's units it pins (``None`` at stages 0-2, where parameters are always full)."""

    comm: Communicator
    segments: Sequence[Segment]
    frozen: Sequence[tuple[str, nn.Parameter]]
    masters: Masters
    sharded: ShardedParams | None
