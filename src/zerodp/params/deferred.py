"""Stages 1-2: the all-gather of updated parameter slices, overlapped with the next forward.

[Note: deferred parameter gather]
After a stage 1-2 step every rank holds up-to-date values only in the slices it owns; one
all-gather per bucket brings the other slices. Waiting for all of them inside ``step()`` leaves
the whole gather exposed. Instead ``launch`` issues them asynchronously, in the order the next
forward needs them, and returns; a forward pre-hook on every module that registers a trainable
parameter waits for the buckets holding its parameters (and, gloo and NCCL running a group's
collectives in issue order, every bucket issued before them). So the gather overlaps the time
until the next forward and the forward itself, and each module still computes with exactly the
values a blocking gather would have given it.

Issue order. Buckets are laid out in reversed registration order (the order backward produces
gradients, see ``ZeroEngine._build_segments``), so forward, which runs roughly in registration
order, needs the *last* bucket first: buckets are issued last to first. A wrong guess costs only
overlap, never correctness, since every module waits for what it reads.

With the optimizer offloaded ([Note: offloaded step] in offload/runner.py) a bucket's owned
slice is final only once its update landed from the host, so nothing is issued at ``launch``:
each module's pre-hook issues the buckets up to its own, each after its landing. The issue
points are then the same on every rank (a bucket issued whenever it happens to land would
interleave differently with other collectives on each rank).

Everything else that reads parameters or writes the owned slices waits for the whole gather
first (``wait_all``): the next ``step`` (the optimizer writes the owned slices a gather may
still be sending), checkpoints, ``full_parameters``, and reads through the model
(``ZeroModule``: ``parameters()``, ``named_parameters()``, ``state_dict()``, attribute access).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from zerodp.comm import Communicator, Handle
from zerodp.offload.landing import Landing
from zerodp.partition.segment import Segment


class DeferredGather:
    """Per-bucket all-gathers of the owned slices of plain (unsharded) segments."""

    def __init__(self, segments: list[Segment], comm: Communicator, *, overlap: bool) -> None:
        # A copy: positions here are this gather's own, and ``add`` appends to it.
        self.segments = list(segments)
        self.comm = comm
        self.overlap = overlap
        self.order = [
            (s, b)
            for s in reversed(range(len(segments)))
            for b in reversed(range(len(segments[s].layout.buckets)))
        ]
        self._handles: list[Handle | None] = []  # by issue position; None: nothing to gather
        self._launched = False  # a generation is issued (or being issued) and not all waited
        self._issued = 0
        self._waited = 0
        self._blocking: list[tuple[int, int]] = []  # buckets of segments added after the hooks
        self._hooks: list[Any] = []
        self.in_forward = False  # inside the root module's forward
        # Offloaded step: a bucket's slice is issued once its update landed ([Note: offloaded
        # step] in offload/runner.py), by its first reader (``_issue_all``).
        self.landing: Landing | None = None

    @property
    def pending(self) -> bool:
        """Some bucket of the last launch is not waited for yet."""
        return self._launched

    @property
    def issue_order(self) -> list[tuple[int, int]]:
        """(segment index in the engine, bucket) in the order a launch issues them."""
        return [(self.segments[s].index, b) for s, b in [*self._blocking, *self.order]]

    @property
    def _gathers(self) -> bool:
        return self.comm.world_size > 1

    def launch(self) -> None:
        """All-gather every bucket's owned slice into the full buffers (after a step)."""
        self.wait_all()  # never two generations in flight
        self._handles = []
        self._issued = self._waited = 0
        self._launched = self._gathers or self.landing is not None
        if not self._launched:
            return
        # First, and waited for: no forward hook waits for these ([Note: unfreezing]).
        for h in [self._issue(s, b) for s, b in self._blocking]:
            if h is not None:
                h.wait()
        self._issue_all()
        if not self.overlap:
            self.wait_all()

    def _issue(self, s: int, b: int) -> Handle | None:
        if self.landing is not None:
            self.landing.wait(self.segments[s].index, b)  # landings are by engine index
        if not self._gathers:
            return None
        flat = self.segments[s].flat
        owned = flat.slice(b, self.comm.rank)
        return self.comm.all_gather(flat.bucket(b), owned, async_op=True)

    def _issue_next(self) -> None:
        self._handles.append(self._issue(*self.order[self._issued]))
        self._issued += 1

    def _issue_all(self) -> None:
        """Without offload every bucket is issued at once. With it, each bucket is issued by
        its first reader (``wait_through``), after its landing: at the same point of the
        program on every rank, never when it happens to have landed, which differs between
        ranks and would interleave the gathers differently with other collectives (a buffer
        broadcast), mismatching them."""
        if self.landing is None:
            while self._issued < len(self.order):
                self._issue_next()

    def add(self, segments: list[Segment]) -> None:
        """Gather these segments too (appended to the engine's list after the hooks were
        registered: unfrozen parameters), blocking, before the overlapped buckets."""
        first = len(self.segments)
        self.segments += segments
        for s in range(first, len(self.segments)):
            self._blocking += [(s, b) for b in range(len(self.segments[s].layout.buckets))]

    def wait_through(self, position: int) -> None:
        """Wait for the buckets issued at ``position`` and before (issuing them first)."""
        if not self._launched:
            return
        stop = min(position + 1, len(self.order))
        while self._issued < stop:
            self._issue_next()
        while self._waited < stop:
            handle = self._handles[self._waited]
            if handle is not None:
                handle.wait()
            self._waited += 1
        if self._waited == len(self.order):
            self._launched = False

    def wait_all(self) -> None:
        self.wait_through(len(self.order) - 1)

    # -- forward pre-hooks ---------------------------------------------------------------------

    def register_hooks(self, model: nn.Module) -> None:
        """Root hooks tracking ``in_forward`` (reads through the model inside the forward do not
        wait for everything: each module waits for its own buckets, stage 3's units for their
        landing), and, overlapping, a forward pre-hook on every module that registers a
        parameter of these segments, waiting for the last-issued bucket among its parameters'
        buckets."""
        self._hooks.append(model.register_forward_pre_hook(self._enter, prepend=True))
        self._hooks.append(model.register_forward_hook(self._exit, always_call=True))
        if not self.overlap or not (self._gathers or self.landing is not None):
            return
        position = self._positions()
        for module in model.modules():
            needed = [position[id(p)] for p in module._parameters.values() if id(p) in position]
            if needed:
                self._hooks.append(module.register_forward_pre_hook(self._hook(max(needed))))

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.in_forward = True

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.in_forward = False

    def _positions(self) -> dict[int, int]:
        """For each parameter, the last issue position among the buckets it spans."""
        where = {sb: i for i, sb in enumerate(self.order)}
        out: dict[int, int] = {}
        for s, seg in enumerate(self.segments):
            for slot, p in enumerate(seg.params):
                buckets = seg.layout.slot_buckets[slot]
                if buckets:  # an empty parameter lies in no bucket
                    out[id(p)] = max(where[(s, b)] for b in buckets)
        return out

    def _hook(self, position: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._launched and self._waited <= position:
                self.wait_through(position)

        return hook

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
