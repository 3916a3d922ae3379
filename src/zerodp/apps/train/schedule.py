"""The learning-rate schedule of ``zerodp train``, and what a checkpoint keeps of it.

Linear warm-up, then cosine decay to 10% of the peak at the schedule's total: the usual GPT
schedule, as a pure function of the step. A checkpoint stores the schedule it was trained
under, so that a resumed run continues it exactly even when ``--steps`` now asks for more
steps (the rate then stays at its final 10%): the learning rate never jumps at the resume
point unless ``--new-schedule`` asks for a schedule over the new total.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Of the peak rate: ``(step + 1) / warmup`` during the warm-up, then cosine from 1 to 0.1
    at ``total`` (and 0.1 after it)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass(frozen=True, slots=True)
class Schedule:
    lr: float  # the peak rate
    warmup: int  # steps of linear warm-up
    total: int  # the step at which the cosine reaches 10%

    def lr_at(self, step: int) -> float:
        return self.lr * lr_factor(step, self.total, self.warmup)

    def describe(self) -> str:
        return (
            f"peak lr {self.lr:g}, {self.warmup} warm-up steps, cosine to 10% at step {self.total}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Schedule | None:
        """The schedule a checkpoint stored, or ``None`` (a checkpoint from before schedules
        were stored, or not ``zerodp train``'s)."""
        if not isinstance(d, dict) or set(d) != {"lr", "warmup", "total"}:
            return None
        return cls(lr=float(d["lr"]), warmup=int(d["warmup"]), total=int(d["total"]))


def resumed_schedule(
    wanted: Schedule, saved: Schedule | None, step: int, *, new: bool
) -> tuple[Schedule, str | None]:
    """The schedule to continue from ``step``, and what to tell the user about it (``None``:
    nothing changed). ``wanted``: the one the options describe; ``saved``: the checkpoint's;
    ``new``: ``--new-schedule``."""
    if saved is None or saved == wanted:
        return wanted, None
    if new:
        return wanted, (
            f"--new-schedule: from step {step} the learning rate follows {wanted.describe()} "
            f"(the checkpoint was trained with {saved.describe()}; at step {step} the rate "
            f"goes from {saved.lr_at(step):.3g} to {wanted.lr_at(step):.3g})"
        )
    return saved, (
        f"continuing the checkpoint's schedule: {saved.describe()} (these options describe "
        f"{wanted.describe()}; pass --new-schedule to follow that from step {step} instead)"
    )
