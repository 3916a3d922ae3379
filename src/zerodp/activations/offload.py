"""Checkpoints in host memory (the paper's P_a+cpu): what a checkpointed module keeps from its
forward, its inputs, waits for its backward off the device.

[Note: checkpoint offload]
With ``Activations(offload="cpu")`` every positional tensor input of a checkpointed module is
first given storage of its own (``_Own``: a copy whose gradient passes straight through, so no
other tensor, a residual stream or a hidden state the caller keeps, shares it), and after the
module's forward that copy goes to a host buffer on the ``"d2h"`` side stream of the stream
owner ([Note: streams]); once the copy completed its device storage is resized to 0 (the
tensor object stays where torch's checkpoint keeps it). The newest ``on_device`` checkpoints
stay on the device (the backward starts with them); the forward waits for the copy of the oldest
beyond that and frees it. In backward the
recompute of a module first makes sure its inputs are back (their storage resized and filled
from the host on the ``"h2d"`` stream), then starts bringing back the checkpoint the backward
reaches next (the one before it in forward order), so each copy overlaps a module's backward.
Tensors passed by keyword (masks, position ids) stay where they are: usually shared by every
layer and small. Code path is the same on CPU and CUDA; on the CPU the "device" is host memory
too, so the tests check the mechanism (bytes moved, storages freed, parity), not a saving.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from zerodp.activations.store import Slot, alias, own_inputs, shares_output
from zerodp.streams import Streams, make_streams


class CheckpointOffload:
    """Moves checkpointed inputs to host memory and back ([Note: checkpoint offload])."""

    def __init__(self, streams: Streams, on_device: int) -> None:
        self.streams = streams
        self.on_device = on_device
        self.stored_bytes = 0  # copied to the host, ever
        self.loaded_bytes = 0  # copied back, ever
        self.host_buffers = 0  # host buffers allocated, ever
        self.peak_resident = 0  # most checkpoints on the device after a forward's store
        self._pending: list[Slot] = []  # copying out, device storage not freed yet
        self._order: list[weakref.ref[Slot]] = []  # this pass's slots, in forward order
        # Host buffers back from the device, by size: a step reuses the last one's (pinned
        # allocations are slow, and host memory stays what one pass needs).
        self._spare: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def own_inputs(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Slot]:
        return own_inputs(args)

    def store(self, slot: Slot, outputs: list[torch.Tensor]) -> None:
        """After the forward: copy the slot's tensors out, free them once copied. Not where an
        output shares their storage (a module returning its input, a view of it, or adding to
        it in place): freeing would take the caller's output away."""
        if not slot.tensors or shares_output(slot, outputs):
            return
        streams = self.streams
        slot.away = [self._host_buffer(t.numel(), t.dtype) for t in slot.tensors]
        # A forward whose backward never comes (evaluation with gradients on): its buffers come
        # back when autograd drops its graph, and with it the slot.
        weakref.finalize(slot, _recycle, self._spare, slot.away)
        d2h = streams.side("d2h")
        d2h.wait(streams.compute.submit(lambda: None))  # after the forward that wrote them

        def copy() -> None:
            with torch.no_grad():
                for h, t in zip(slot.away, slot.tensors, strict=True):
                    h.copy_(alias(t), non_blocking=True)

        slot.stored = d2h.submit(copy, uses=slot.tensors)
        self.stored_bytes += sum(t.numel() * t.element_size() for t in slot.tensors)
        self._order = [r for r in self._order if r() is not None]
        self._order.append(weakref.ref(slot))
        self._pending.append(slot)
        self._free(keep=self.on_device)
        self.peak_resident = max(self.peak_resident, len(self._pending))

    def load(self, slot: Slot) -> None:
        """In the recompute: the slot's tensors are back on the device before they are read;
        then the previous checkpoint starts coming back."""
        self._start_load(slot)
        assert slot.loaded is not None
        self.streams.compute.wait(slot.loaded)
        # Reused by a later store, whose copy the d2h stream orders after this compute point.
        _recycle(self._spare, slot.away)
        alive = [r() for r in self._order]
        if slot in alive:
            earlier = [s for s in alive[: alive.index(slot)] if s is not None and s.freed]
            if earlier:
                self._start_load(earlier[-1])

    def __reduce__(self) -> tuple[Any, ...]:
        # A copied or pickled model (an EMA copy, torch.save) gets an offload of its own, with
        # its own streams: nothing of this one's state (threads, buffers in flight) travels.
        return (_fresh, (str(self.streams.device), self.on_device))

    def _host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        spare = self._spare.get((numel, dtype))
        if spare:
            return spare.pop()
        self.host_buffers += 1
        return self.streams.host_empty(numel, dtype)

    def _start_load(self, slot: Slot) -> None:
        if slot.loaded is not None:
            return
        if slot in self._pending:  # still copying out: wait, and it never left
            self._pending.remove(slot)
            assert slot.stored is not None
            slot.stored.wait()
        if not slot.freed:
            slot.loaded = self.streams.compute.submit(lambda: None)
            return
        for t in slot.tensors:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        h2d = self.streams.side("h2d")
        h2d.wait(self.streams.compute.submit(lambda: None))

        def copy() -> None:
            with torch.no_grad():
                for h, t in zip(slot.away, slot.tensors, strict=True):
                    alias(t).copy_(h, non_blocking=True)

        # Only device tensors in ``uses`` (CUDA can mark only device memory as used by a side
        # stream); the host buffers go back to ``_spare`` only after the compute stream waited
        # for this copy.
        slot.loaded = h2d.submit(copy, uses=slot.tensors)
        slot.freed = False
        self.loaded_bytes += sum(t.numel() * t.element_size() for t in slot.tensors)

    def _free(self, keep: int) -> None:
        """Free the device storage of the oldest checkpoints (waiting for their copies) while
        more than ``keep`` are on the device. The newest ``keep`` stay: the backward starts
        with them, and the bytes moved do not depend on how fast the copies ran."""
        while len(self._pending) > keep:
            slot = self._pending[0]
            assert slot.stored is not None
            slot.stored.wait()
            for t in slot.tensors:
                t.untyped_storage().resize_(0)
            slot.freed = True
            self._pending.pop(0)

    def resident_bytes(self) -> int:
        """Device bytes of the checkpoints this offload holds now (the tests' measure)."""
        slots = [r() for r in self._order]
        return sum(t.untyped_storage().nbytes() for s in slots if s is not None for t in s.tensors)


def _fresh(device: str, on_device: int) -> CheckpointOffload:
    return CheckpointOffload(make_streams(device), on_device)


def _recycle(
    spare: dict[tuple[int, torch.dtype], list[torch.Tensor]], host: list[torch.Tensor]
) -> None:
    """Give ``host``'s buffers back to the pool (once: the list is emptied)."""
    for h in host:
        spare.setdefault((h.numel(), h.dtype), []).append(h)
    host.clear()
