"""The engine's hooks around the root module's forward: buffer broadcasts, the compute-dtype
cast of the inputs, and the phase the watchdog names (forward, backward, between steps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from zerodp.comm import BETWEEN_STEPS, Communicator
from zerodp.optim.compute_dtype import Cast, CastInputs
from zerodp.params.order import Op


class ForwardHooks:
    def __init__(
        self,
        comm: Communicator,
        broadcast_buffers: bool,  # ZeroConfig.broadcast_buffers
        check: Callable[[Op], None],  # the parameter sync's agreement before a collective
        cast: Cast,
    ) -> None:
        self.comm = comm
        self.broadcast_buffers = broadcast_buffers
        self.check = check
        self.cast = cast

    def install(self, model: nn.Module) -> list[RemovableHandle]:
        return [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward),
        ]

    def install_first(self, model: nn.Module) -> RemovableHandle:
        """Before every other root pre-hook: stage 3 gathers (a collective) in its own."""
        return model.register_forward_pre_hook(self._enter_forward, prepend=True)

    def _before_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> CastInputs | None:
        if self._broadcasts_buffers(module):
            self.check(Op.BUFFERS)
            with torch.no_grad():
                for b in module.buffers():
                    self.comm.broadcast(b)
        return self.cast.inputs(args, kwargs)

    def _enter_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        training = module.training and torch.is_grad_enabled()
        self.comm.progress.enter("forward" if training else "evaluation forward")

    def _after_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """For the watchdog's messages: the phase is "backward" once autograd reaches the
        output, and the loss computation between forward and backward counts as the forward."""
        if not torch.is_grad_enabled():
            self.comm.progress.enter(BETWEEN_STEPS)
            return
        leaf = next((t for t in tree_leaves(output) if _needs_grad(t)), None)
        if leaf is not None:
            progress = self.comm.progress
            leaf.register_hook(lambda grad: progress.enter("backward"))

    def _broadcasts_buffers(self, module: nn.Module) -> bool:
        """[Note: buffers] Rank 0's buffers are broadcast only before a *training* forward
        (module in train mode, grad enabled); DDP likewise syncs them only after forwards run
        with grad enabled. Every rank runs those (the backward that follows is a collective
        anyway), so the broadcast is never one that some ranks skip. Eval and ``no_grad``
        forwards issue no collective at stages 0-2: ranks may run different numbers of them
        (uneven evaluation, ``generate`` of different lengths), and each rank computes with its
        own buffers, which the last training forward made equal (running statistics updated in
        that forward from each rank's own batch differ, as under DDP)."""
        return (
            self.broadcast_buffers
            and self.comm.world_size > 1
            and module.training
            and torch.is_grad_enabled()
            and next(module.buffers(), None) is not None
        )


def _needs_grad(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad
