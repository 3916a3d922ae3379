"""A segment's tensors on one rank: the flat parameter buffer and the parameters viewing into it.

See [Note: flat buffers] in ``layout.py`` for the layout. ``Segment`` owns the storage; the
gradient path (``zerodp.grads``) and the optimizer (``zerodp.optim``) take views of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerodp.partition.buffers import FlatBuffer, OwnedStorage, flat_view
from zerodp.partition.layout import FlatLayout

__all__ = ["Segment", "flat_view"]


@dataclass
class Segment:
    """Trainable parameters of one dtype and device, stored contiguously (``param_buffer``, 1D
    of ``layout.padded_numel`` elements); each ``nn.Parameter``'s ``.data`` is a view into it."""

    index: int
    layout: FlatLayout
    params: list[nn.Parameter]  # by slot index
    names: list[str]  # by slot index; a tied parameter keeps its first name
    dtype: torch.dtype
    device: torch.device
    param_buffer: torch.Tensor  # 1D, padded_numel

    @classmethod
    def build(
        cls, index: int, layout: FlatLayout, params: list[nn.Parameter], names: list[str]
    ) -> Segment:
        """Move ``params`` into one new flat buffer. The old per-parameter storage is released
        as soon as nothing else references it."""
        first = params[0]
        buf = torch.zeros(layout.padded_numel, dtype=first.dtype, device=first.device)
        seg = cls(index, layout, params, names, first.dtype, first.device, buf)
        with torch.no_grad():
            for slot, p in zip(layout.slots, params, strict=True):
                view = seg.param_view(slot.index)
                view.copy_(p.detach())
                p.data = view
        return seg

    def cast_(self, dtype: torch.dtype) -> None:
        """Re-store the parameters in ``dtype`` (mixed precision's compute copy)."""
        if dtype == self.dtype:
            return
        self.param_buffer = self.param_buffer.to(dtype)
        self.dtype = dtype
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            p.data = self.param_view(slot.index)

    def param_view(self, slot: int) -> torch.Tensor:
        s = self.layout.slots[slot]
        return flat_view(self.param_buffer, s.flat).view(s.spec.shape)

    @property
    def flat(self) -> FlatBuffer:
        """The parameter buffer, typed (every rank's slices)."""
        return FlatBuffer(self.param_buffer, self.layout, None)

    def param_storage(self, owner: int | None) -> OwnedStorage:
        """Where this rank holds the parameter values ``owner`` steps ([Note: flat and shard
        buffers]): the flat buffer here; stage 3's shard (``ShardedSegment``)."""
        return FlatBuffer(self.param_buffer, self.layout, owner)

    @property
    def numel(self) -> int:
        return self.layout.param_numel
