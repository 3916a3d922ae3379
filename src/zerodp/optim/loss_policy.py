"""``LossPolicy``: what the loss and the step's finiteness mean under each precision, chosen
once from the plan, so that the engine's backward and step have no precision branch.

- ``ScaledLoss`` (fp16): the loss is multiplied by the dynamic loss scale; a step with
  non-finite gradients is skipped and the scale lowered (``optim/loss_scaler.py``);
  ``loss.backward()`` instead of ``opt.backward(loss)`` is refused.
- ``CheckedLoss`` (fp32, bf16): the loss is only checked (``Precision.nonfinite``: "raise",
  "skip" or "ignore"; [Note: step agreement] in optim/agreement.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from zerodp.config import LossScaling, Precision
from zerodp.optim import misuse
from zerodp.optim.agreement import StepFlags
from zerodp.optim.loss_scaler import DynamicLossScaler
from zerodp.plan import Plan


class LossPolicy(Protocol):
    @property
    def scaler(self) -> DynamicLossScaler | None:
        """fp16's scaler (checkpoints save its state); None otherwise."""

    @property
    def scale(self) -> float | None:
        """The loss scale of this step (None: not scaled)."""

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What ``opt.backward(loss)`` back-propagates."""

    def check_backward(self, backward: bool, through_opt: bool) -> None:
        """Gradients were produced (``backward``); ``through_opt``: by ``opt.backward``."""

    def nonfinite_loss(self) -> bool:
        """This rank's losses since the last step held a NaN/inf (a flag to agree on)."""

    def skips(self, flags: StepFlags) -> bool:
        """Whether the agreed flags make this step a skipped one."""

    def refuse(self, skip: bool, flags: StepFlags, step: int) -> None:
        """Raise if the policy refuses a skipped step (``nonfinite='raise'``)."""

    def after_step(self, skipped: bool) -> None: ...

    def reset(self) -> None: ...


class ScaledLoss:
    """fp16 (see the module docstring)."""

    def __init__(self, policy: LossScaling) -> None:
        self.scaler = DynamicLossScaler.from_policy(policy)

    @property
    def scale(self) -> float | None:
        return self.scaler.scale

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def check_backward(self, backward: bool, through_opt: bool) -> None:
        if backward and not through_opt:
            raise RuntimeError(
                "precision='fp16' scales the loss: call opt.backward(loss) instead of "
                "loss.backward() (the only change fp16 needs in the training loop)"
            )

    def nonfinite_loss(self) -> bool:
        return False  # the scaled gradients say it

    def skips(self, flags: StepFlags) -> bool:
        return flags.nonfinite_grads

    def refuse(self, skip: bool, flags: StepFlags, step: int) -> None:
        pass  # the scaler skips and lowers the scale

    def after_step(self, skipped: bool) -> None:
        self.scaler.update(finite=not skipped)

    def reset(self) -> None:
        pass


class CheckedLoss:
    """fp32 and bf16 (see the module docstring)."""

    scaler = None
    scale = None

    def __init__(self, plan: Plan, precision: Precision) -> None:
        self._check = plan.check_finite
        self._raise = precision.nonfinite == "raise"
        self._losses = misuse.LossCheck()

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self._check:
            self._losses.add(loss)
        return loss

    def check_backward(self, backward: bool, through_opt: bool) -> None:
        pass

    def nonfinite_loss(self) -> bool:
        return self._losses.nonfinite()

    def skips(self, flags: StepFlags) -> bool:
        return flags.nonfinite_grads or flags.nonfinite_loss

    def refuse(self, skip: bool, flags: StepFlags, step: int) -> None:
        if skip and self._raise:
            raise misuse.nonfinite_error(step, misuse.nonfinite_what(flags, loss_scaling=False))

    def after_step(self, skipped: bool) -> None:
        pass

    def reset(self) -> None:
        self._losses.reset()


def make_loss_policy(plan: Plan, precision: Precision) -> LossPolicy:
    return ScaledLoss(precision.loss_scaling) if plan.loss_scaling else CheckedLoss(plan, precision)
