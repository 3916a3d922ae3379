"""Dynamic loss scaling for fp16 (and the record of every step's outcome).

The schedule is the well-known one (DeepSpeed's and Megatron's defaults): start at 2**16; on a
step whose gradients are not finite the step is skipped and, once ``hysteresis`` such steps have
happened since the start or the last growth (DeepSpeed's ``consecutive_hysteresis=False``), the
scale is multiplied by ``backoff_factor`` (and again at each later one until it grows); after
``growth_interval`` consecutive finite steps it is multiplied by ``growth_factor``. A non-finite
step at ``min_scale`` raises: training cannot make progress. Whether a step is finite is decided
by the engine from an all-reduced flag, so every rank updates its scaler identically.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from zerodp.config import LossScaling

log = logging.getLogger("zerodp")


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What happened at one ``optimizer.step()``; ``ZeroOptimizer.last_step`` returns it (a
    step that raised leaves the previous one)."""

    step: int  # optimizer steps attempted so far, this one included
    skipped: bool
    reason: str | None  # why it was skipped
    loss_scale: float | None  # the scale the step's gradients were computed with (fp16)
    grad_norm: float | None  # total norm, when clip_grad_norm_ computed it this step
    without_backward: bool = False  # no rank produced a gradient since the previous step


class DynamicLossScaler:
    """Loss scale state machine; ``update`` is called once per step with the global verdict."""

    def __init__(
        self,
        initial_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        min_scale: float,
        dynamic: bool = True,
    ) -> None:
        self.scale = float(initial_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.dynamic = dynamic
        self._hysteresis_left = hysteresis
        self._good_steps = 0

    @classmethod
    def from_policy(cls, policy: LossScaling) -> DynamicLossScaler:
        """The scaler ``policy`` asks for: fixed at ``policy.fixed`` when set, else dynamic."""
        return cls(
            initial_scale=policy.fixed if policy.fixed is not None else policy.initial,
            growth_factor=policy.growth_factor,
            backoff_factor=policy.backoff_factor,
            growth_interval=policy.growth_interval,
            hysteresis=policy.hysteresis,
            min_scale=policy.min_scale,
            dynamic=policy.fixed is None,
        )

    def update(self, finite: bool) -> None:
        if not self.dynamic:
            return
        if finite:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
                self._hysteresis_left = self.hysteresis
            return
        self._good_steps = 0
        if self._hysteresis_left > 1:
            self._hysteresis_left -= 1
            return
        if self.scale <= self.min_scale:
            raise RuntimeError(
                f"fp16 loss scale reached its minimum ({self.min_scale:g}) and gradients are "
                "still not finite: the model diverged or overflows even unscaled; lower the "
                "learning rate, use precision='bf16', or lower "
                "ZeroConfig.precision.loss_scaling.min_scale"
            )
        self.scale = max(self.scale * self.backoff_factor, self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self._hysteresis_left,
            "good_steps": self._good_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._good_steps = int(state["good_steps"])
