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
        shadow.__dict__.update(optimizer.__dict__)  # shares ``state`` and ``defaults``
        shadow._optimizer_step_pre_hooks = OrderedDict()
        shadow._optimizer_step_post_hooks = OrderedDict()
        self._shadow = shadow

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
