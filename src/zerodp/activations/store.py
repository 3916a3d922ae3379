"""Where the inputs a checkpointed module keeps wait for its backward: the interface of host
memory ([Note: checkpoint offload] in offload.py) and of slices over the tensor-parallel group
([Note: partitioned checkpoints] in partition.py), and what both use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zerodp.streams import Event


class _Own(torch.autograd.Function):
    """``x`` in storage of its own; the gradient passes straight through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


@dataclass(eq=False)
class Slot:
    """The inputs of one checkpointed forward call, and where they wait."""

    tensors: list[torch.Tensor]
    away: list[torch.Tensor] = field(default_factory=list)  # host buffers, or this rank's slices
    stored: Event | None = None  # the copy to the host
    loaded: Event | None = None  # the copy back
    freed: bool = False  # device storage resized to 0


class CheckpointStore(Protocol):
    def own_inputs(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Slot]:
        """``args`` with every tensor in storage of its own, and the slot that will hold them."""

    def store(self, slot: Slot, outputs: list[torch.Tensor]) -> None:
        """After the module's forward: move the slot's tensors away."""

    def load(self, slot: Slot) -> None:
        """In the recompute, before the tensors are read: bring them back."""

    def resident_bytes(self) -> int:
        """Device bytes the checkpoints of this store hold now (the tests' measure)."""


def own_inputs(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Slot]:
    """Every positional tensor input given storage of its own (so no other tensor, a residual
    stream or a hidden state the caller keeps, shares what is moved away), and its slot.
    Tensors passed by keyword (masks, position ids) stay: usually shared by every layer and
    small."""
    owned = tuple(_Own.apply(a) if isinstance(a, torch.Tensor) else a for a in args)
    return owned, Slot([a for a in owned if isinstance(a, torch.Tensor)])


def shares_output(slot: Slot, outputs: list[torch.Tensor]) -> bool:
    """Whether an output shares a slot tensor's storage (a module returning its input, a view
    of it, or adding to it in place): freeing it would take the caller's output away."""
    keys = {t.untyped_storage().data_ptr() for t in slot.tensors}
    return any(o.untyped_storage().data_ptr() in keys for o in outputs)


def alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements, flat, as a tensor of its own over the same storage: writing it does not
    move ``t``'s version counter, which torch's checkpoint checks when it reads its inputs back
    (``t`` is one of ``_Own``'s contiguous copies)."""
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    return flat.set_(t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
