"""Stepping the user's optimizer on one bucket's pieces, from a host worker thread.

[Note: host optimizer step]
The offloaded step runs ``optimizer.step()`` once per bucket on the CPU while the caller goes
on (often into the next forward, and past an LR scheduler's ``step()``, which rewrites
``param_groups[i]["lr"]`` in place). So the worker never reads the user's ``param_groups``:
``HostStepper`` takes, on the caller's thread when the step is called, a snapshot of every
group's hyperparameters (tensor values cloned), and steps a *shadow* of the optimizer, a
shallow copy sharing its ``state`` (so the per-piece Adam moments and step counts are the
user's, where ``state_dict()`` and checkpoints find them) with one group per snapshot holding
only that bucket's pieces. An element-wise optimizer computes exactly what one step over all
pieces would (the chunked mixed-precision step relies on the same fact). The shadow has no
instance hooks: the user's ``register_step_pre_hook``/``post_hook`` callbacks of the inner
optimizer do not run once per bucket on a worker thread (``ZeroOptimizer``'s hooks run once,
on the caller's).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from zerodp.optim.pieces import OptimPiece


class HostStepper:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._groups = [_hyperparameters(g) for g in optimizer.param_groups]
        shadow = object.__new__(type(optimizer))
        # Data only (``state``, ``defaults``, flags): an LR scheduler wraps ``optimizer.step``
        # in an instance attribute, a closure over the user's optimizer and its live groups.
        data = {k: v for k, v in optimizer.__dict__.items() if not callable(v)}
        shadow.__dict__.update(data)
        shadow._optimizer_step_pre_hooks = OrderedDict()
        shadow._optimizer_step_post_hooks = OrderedDict()
        self._shadow = shadow
        if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
            # What that wrapper would have recorded: the scheduler warns on its first step
            # unless ``optimizer.step()`` ran before it (here it runs per bucket, on a worker).
            optimizer._opt_called = True  # type: ignore[attr-defined]

    def step(self, pieces: list[OptimPiece], grads: list[torch.Tensor]) -> None:
        """One step of ``pieces`` with these gradients (host tensors), on the worker thread."""
        groups: list[dict[str, Any]] = [{**g, "params": []} for g in self._groups]
        for op, grad in zip(pieces, grads, strict=True):
            op.tensor.grad = grad
            groups[op.group]["params"].append(op.tensor)
        self._shadow.param_groups = groups
        try:
            self._shadow.step()
        finally:
            for op in pieces:
                op.tensor.grad = None


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in group.items()
        if k != "params"
    }
