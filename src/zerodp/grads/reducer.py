"""Bucketed gradient reduction that overlaps backward.

Over the ~400-line budget (470) since it also notices gradients replaced or cleared by the user
(``model.zero_grad()``, ``p.grad = None``), counts the gradients a step saw (step without
backward) and reopens a round after a step without ``zero_grad``; the next step of the engine
restructure (one bucket object, issue 14) moves the bucket geometry and these checks out.

A post-accumulate-grad hook on every trainable parameter counts down its buckets; a bucket is
launched (asynchronously) when all its parameters have their gradient **and** every bucket
before it in the launch order was launched. The fixed launch order is what keeps ranks'
collectives matched when a parameter is unused on some ranks: a bucket that never completes is
launched, in order, by a callback at the end of backward (or by ``finish`` when a rank ran no
backward at all).

[Note: launch order] The first launch order is the layout's (reversed registration order, a
guess at the order backward produces gradients). During the first synchronised backward the
reducer records the order in which buckets actually complete; ``adopt_recorded_order`` (called
by the first ``finish``, on every rank at the same point) makes rank 0's record the launch order
of every rank from then on, as DDP rebuilds its buckets after the first iteration. Which
parameters share a bucket (and so which slice each rank owns) does not change: the optimizer
state is already laid out.

Three modes, one per way of holding gradients:

``ALL_REDUCE`` (stage 0)
    Gradients live in a full flat buffer (``param.grad`` are views into it, so autograd
    accumulates in place); each bucket is all-reduced and divided by N: DDP exactly.
``SCATTER_IN_PLACE`` (stage 1)
    The same full buffer; each bucket is reduce-scattered in place into this rank's slice and
    divided by N, and the other slices are zeroed (they were consumed). The owned slice then
    mixes reduced and local values, so a step reduces exactly once: accumulation goes through
    ``no_sync`` (a second synchronised backward before ``zero_grad`` raises).
``SCATTER_STAGED`` (stage 2)
    No full gradient buffer. At launch the bucket's gradients are copied into one of a fixed
    pool of staging buffers (then ``param.grad`` is freed), reduce-scattered into the owned
    gradient shard, divided by N and accumulated there.

[Note: replaced gradients] Stages 0-1 bind every ``param.grad`` to its view of the gradient
buffer. Code that clears gradients behind the optimizer's back (``p.grad = None`` in a loop, a
submodule's ``zero_grad()``) replaces that binding, and torch's meaning is: this parameter has
no gradient (``None``), or exactly the assigned tensor. The first backward hook of every
backward, and ``finish``, compare each ``.grad`` with its view (an attribute read per
parameter): a replaced one gets its view zeroed (``None``) or set to the assigned tensor and
bound again, its used bit follows, and ``on_replaced`` tells the engine ([Note: kept
gradients]). If every gradient was replaced before a backward, nothing reduced is left in the
buffer: that backward starts a new reduction round, as after ``zero_grad`` (stage 1 would
otherwise refuse it). A tensor assigned after the last backward is the gradient the step uses,
unreduced, as in torch. Stages 2-3 cannot see such code: between steps ``.grad`` is ``None``
there anyway (the reduced gradient lives in the owned shard); the root module's ``zero_grad``
goes to the engine ([Note: model.zero_grad] in ``module.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerodp.comm import Communicator
from zerodp.grads.inflight import InFlight
from zerodp.grads.staging import reduce_scatter_into, staging_pool, zero_range, zeros_like_shard
from zerodp.partition.buffers import FlatBuffer, OwnedStorage, ShardBuffer, flat_view
from zerodp.partition.layout import Range
from zerodp.partition.segment import Segment
from zerodp.plan import ReduceMode


@dataclass(frozen=True, slots=True)
class _Bucket:
    seg: int  # segment index
    index: int  # bucket index within the segment's layout
    flat: Range  # the bucket in the segment's flat space
    owned: Range  # this rank's slice of it (flat space)
    shard_offset: int  # where the owned slice starts in the shard buffer
    slots: tuple[int, ...]


class GradReducer:
    """Owns gradient storage and its reduction for all segments of one engine."""

    def __init__(
        self,
        segments: list[Segment],
        comm: Communicator,
        mode: ReduceMode,
        reduce_dtype: torch.dtype | None = None,
        staging_buffers: int = 2,
    ) -> None:
        self.segments = segments
        self.comm = comm
        self.mode = mode
        self.world = comm.world_size
        self.sync_enabled = True
        staged = mode is ReduceMode.SCATTER_STAGED
        # Reducing in another dtype than the gradients are stored in goes through staging too.
        self._convert = [reduce_dtype is not None and s.dtype != reduce_dtype for s in segments]
        # [Note: gradient storage] full buffers (stages 0-1) or owned shards (stage 2).
        self.grad_buffers: list[torch.Tensor | None] = [
            None if staged else torch.zeros_like(s.param_buffer) for s in segments
        ]
        self.shard_grads: list[torch.Tensor | None] = [
            zeros_like_shard(s) if staged else None for s in segments
        ]
        self._storages = self._typed_storages()  # the buffers above, typed, for the optimizer
        self.buckets = self._global_buckets()
        self._slot_buckets = [
            [[self._seg_bucket_ids[i][b] for b in buckets] for buckets in seg.layout.slot_buckets]
            for i, seg in enumerate(segments)
        ]
        staged_numels = [b.flat.numel for b in self.buckets] if staged or any(self._convert) else []
        self._inflight = InFlight(
            staging_pool(
                staged_numels,
                comm,
                segments,
                reduce_dtype,
                staging_buffers,
                scatter=self.mode is not ReduceMode.ALL_REDUCE,
            )
        )
        self.used: list[list[bool]] = [[False] * len(s.params) for s in segments]
        self.order = list(range(len(self.buckets)))  # launch order ([Note: launch order])
        self._recorded: list[int] | None = []  # completion order seen; None once adopted
        self._has_data = [False] * len(self.buckets)
        self._rounds = 0  # reduction rounds launched since the last finish()
        self._averaged = False  # finish() ran and zero_grad() has not
        self._hooks: list[Any] = []
        self.grads_seen = 0  # gradients produced (hook calls), ever: "did a backward run"
        self.on_replaced: Callable[[list[list[bool]]], None] | None = None
        self._views: list[list[torch.Tensor]] = []  # stages 0-1: what each .grad is bound to
        self._reset_backward()
        if not staged:
            self.bind_grad_views()

    # -- setup ---------------------------------------------------------------------------------

    def _global_buckets(self) -> list[_Bucket]:
        rank = self.comm.rank
        out: list[_Bucket] = []
        self._seg_bucket_ids: list[list[int]] = []
        for i, seg in enumerate(self.segments):
            lay = seg.layout
            ids = []
            for b in lay.buckets:
                ids.append(len(out))
                out.append(_Bucket(i, b.index, b.flat, b.shard(rank), b.shard_offset, b.slots))
            self._seg_bucket_ids.append(ids)
        return out

    def register_hooks(self) -> None:
        for i, seg in enumerate(self.segments):
            for s, p in enumerate(seg.params):
                hook = self._make_hook(i, s)
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def bind_grad_views(self) -> None:
        """Point every ``param.grad`` at its view of the full gradient buffer (stages 0-1)."""
        self._views = []
        for i, seg in enumerate(self.segments):
            buf = self.grad_buffers[i]
            assert buf is not None
            views = [self._grad_view(buf, seg, s) for s in range(len(seg.params))]
            for p, view in zip(seg.params, views, strict=True):
                p.grad = view
            self._views.append(views)

    def take_replaced_grads(self, *, new_round: bool) -> None:
        """Adopt the ``.grad`` bindings that user code replaced ([Note: replaced gradients]);
        ``new_round``: a backward starts (not ``finish``)."""
        if self.mode is ReduceMode.SCATTER_STAGED:
            return
        replaced = [
            [_replaced(p.grad, v) for p, v in zip(seg.params, views, strict=True)]
            for seg, views in zip(self.segments, self._views, strict=True)
        ]
        if not any(any(r) for r in replaced):
            return
        self._inflight.wait_all()  # never write a buffer a collective is still writing
        with torch.no_grad():
            for i, seg in enumerate(self.segments):
                for s, p in enumerate(seg.params):
                    if not replaced[i][s]:
                        continue
                    view, grad = self._views[i][s], p.grad
                    if grad is None:
                        view.zero_()
                    else:
                        view.copy_(grad)
                    self.used[i][s] = grad is not None
                    p.grad = view
        if new_round and all(all(r) for r in replaced):  # nothing reduced is left
            self._rounds = 0
            self._averaged = False
        if self.on_replaced is not None:
            self.on_replaced(replaced)

    @staticmethod
    def _grad_view(buf: torch.Tensor, seg: Segment, s: int) -> torch.Tensor:
        slot = seg.layout.slots[s]
        return flat_view(buf, slot.flat).view(slot.spec.shape)

    # -- backward ------------------------------------------------------------------------------

    def _reset_backward(self) -> None:
        self._pending = [len(b.slots) for b in self.buckets]
        # Stage 2: buckets of each parameter not copied to staging yet; its .grad is freed at 0.
        staged = self.mode is ReduceMode.SCATTER_STAGED
        self._unstaged = [[len(b) for b in seg] for seg in self._slot_buckets] if staged else []
        self._next = 0
        self._callback_queued = False

    def _make_hook(self, seg: int, slot: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(seg, slot, param)

        return hook

    def _on_grad_ready(self, seg: int, slot: int, param: torch.Tensor) -> None:
        first_of_backward = not self._callback_queued
        self.grads_seen += 1
        if first_of_backward:
            self.take_replaced_grads(new_round=True)
            if self._averaged:
                self._reopen()
        in_place = self.mode is ReduceMode.SCATTER_IN_PLACE
        if first_of_backward and in_place and self.sync_enabled and self._rounds:
            raise RuntimeError(
                "zerodp stage 1 reduces a step's gradients exactly once, but a second "
                "synchronised backward ran before optimizer.zero_grad(): accumulate micro-batches "
                "inside model.no_sync() (all but the last) and call optimizer.zero_grad() after "
                "each step"
            )
        if first_of_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True
        self.used[seg][slot] = True
        if self.mode is not ReduceMode.SCATTER_STAGED:
            self._adopt_grad(seg, slot, param)
        if not self.sync_enabled:
            return
        for gb in self._slot_buckets[seg][slot]:
            self._pending[gb] -= 1
            if self._pending[gb] == 0 and self._recorded is not None:
                self._recorded.append(gb)
        order = self.order
        while self._next < len(order) and self._pending[order[self._next]] == 0:
            self._launch(order[self._next], first=self._next == 0)
            self._next += 1

    def _reopen(self) -> None:
        """[Note: accumulating across steps] A backward after ``finish`` (a step, a clip) with no
        ``zero_grad`` in between adds to the reduced gradients, as torch accumulates into
        ``.grad``. Stages 0 and 2 hold the average, equal on every rank (stage 2: the owned
        shard), so reducing the sum again gives the old average plus the new one: the next
        round starts afresh (also a round of ``no_sync`` backwards only, which ``finish``
        reduces). Stage 1's buffer holds the average only in the owned slices, which a second
        reduce-scatter would mix with local values: it raises instead."""
        if self.mode is ReduceMode.SCATTER_IN_PLACE:
            raise RuntimeError(
                "zerodp stage 1 reduces a step's gradients exactly once, but a backward ran "
                "after opt.step() (or clip_grad_norm_) without optimizer.zero_grad(): stage 1 "
                "cannot accumulate gradients across steps; call optimizer.zero_grad() after "
                "each step (stages 0, 2 and 3 accumulate across steps as torch does)"
            )
        self._averaged = False
        self._rounds = 0

    def _adopt_grad(self, seg: int, slot: int, param: torch.Tensor) -> None:
        """If something replaced ``param.grad`` (``model.zero_grad()`` setting it to None, a
        user assignment), copy the value into the buffer and restore the view."""
        buf = self.grad_buffers[seg]
        assert buf is not None
        view = self._grad_view(buf, self.segments[seg], slot)
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            param.grad = view

    def _on_backward_end(self) -> None:
        if self.sync_enabled:
            self._launch_remaining()
            if self.mode is ReduceMode.ALL_REDUCE:
                # Stage 0 reduces in the gradient buffer itself, which the next backward
                # accumulates into (synchronised micro-batches without no_sync): wait here, as
                # DDP does at the end of every backward, so that a collective is never still
                # summing the buffer and each round is averaged before the next adds to it.
                self._inflight.wait_all()
        self._reset_backward()

    def _launch_remaining(self) -> None:
        while self._next < len(self.order):
            self._launch(self.order[self._next], first=self._next == 0)
            self._next += 1

    def adopt_recorded_order(self) -> None:
        """Launch buckets from now on in the order they completed in the first backward on rank
        0 (buckets that never completed keep their relative order, last). Call on every rank,
        once, at the same point (a broadcast)."""
        if self._recorded is None:
            return
        seen = list(dict.fromkeys(self._recorded))
        mine = seen + [gb for gb in range(len(self.buckets)) if gb not in set(seen)]
        if self.world > 1:
            mine = list(self.comm.broadcast_object(mine, src=0))
        self.order = mine
        self._recorded = None

    # -- launching -----------------------------------------------------------------------------

    def _launch(self, gb: int, *, first: bool) -> None:
        if first:
            self._rounds += 1
        bucket = self.buckets[gb]
        if self.mode is ReduceMode.ALL_REDUCE:
            self._launch_all_reduce(gb, bucket)
        elif self.mode is ReduceMode.SCATTER_IN_PLACE:
            self._launch_in_place(gb, bucket)
        else:
            self._launch_staged(gb, bucket)

    def _launch_all_reduce(self, gb: int, bucket: _Bucket) -> None:
        buf = self.grad_buffers[bucket.seg]
        assert buf is not None
        view = flat_view(buf, bucket.flat)
        if not self._convert[bucket.seg]:
            handle = self.comm.all_reduce(view, async_op=True)

            def average() -> None:
                view.div_(self.world)

            self._inflight.push(handle, average)
            return
        staging = self._inflight.acquire(bucket.flat.numel).data
        staging.copy_(view)
        handle = self.comm.all_reduce(staging, async_op=True)

        def average_and_store() -> None:
            staging.div_(self.world)
            view.copy_(staging)

        self._inflight.push(handle, average_and_store, staging)

    def _launch_in_place(self, gb: int, bucket: _Bucket) -> None:
        buf = self.grad_buffers[bucket.seg]
        assert buf is not None
        view = flat_view(buf, bucket.flat)
        lo = bucket.owned.start - bucket.flat.start
        hi = bucket.owned.stop - bucket.flat.start
        staging: torch.Tensor | None = None
        if self._convert[bucket.seg]:
            staged = self._inflight.acquire(bucket.flat.numel)
            staging = staged.data.copy_(view)
            handle = self.comm.reduce_scatter(
                staging[lo:hi], staging, received=staged.received, async_op=True
            )
        else:
            handle = self.comm.reduce_scatter(view[lo:hi], view, async_op=True)

        def consume_others() -> None:
            if staging is not None:
                view[lo:hi].copy_(staging[lo:hi].div_(self.world))
            else:
                view[lo:hi].div_(self.world)
            view[:lo].zero_()
            view[hi:].zero_()

        self._inflight.push(handle, consume_others, staging)

    def _launch_staged(self, gb: int, bucket: _Bucket) -> None:
        staged = self._inflight.acquire(bucket.flat.numel)
        self._fill_staging(bucket, staged.data)
        shard = self.shard_grads[bucket.seg]
        assert shard is not None
        target = shard.narrow(0, bucket.shard_offset, bucket.owned.numel)
        handle, average = reduce_scatter_into(
            self.comm,
            staged,
            target,
            accumulate=self._has_data[gb],
            convert=self._convert[bucket.seg],
        )
        self._has_data[gb] = True
        self._inflight.push(handle, average, staged.data)

    def _fill_staging(self, bucket: _Bucket, staging: torch.Tensor) -> None:
        """Copy the bucket's part of each parameter's gradient, zero the rest, free grads whose
        last bucket this is."""
        seg = self.segments[bucket.seg]
        cursor = bucket.flat.start
        for s in bucket.slots:
            slot = seg.layout.slots[s]
            part = slot.flat.intersect(bucket.flat)
            assert part is not None
            zero_range(staging, cursor - bucket.flat.start, part.start - bucket.flat.start)
            dst = staging.narrow(0, part.start - bucket.flat.start, part.numel)
            grad = seg.params[s].grad
            if grad is None:
                dst.zero_()
            else:
                dst.copy_(grad.reshape(-1).narrow(0, part.start - slot.flat.start, part.numel))
            self._unstaged[bucket.seg][s] -= 1
            if self._unstaged[bucket.seg][s] == 0:  # buckets may launch in any order
                seg.params[s].grad = None
            cursor = part.stop
        zero_range(staging, cursor - bucket.flat.start, bucket.flat.numel)

    # -- completion ----------------------------------------------------------------------------

    def finish(self) -> None:
        """Make the step's gradients final: launch what no backward launched, wait for every
        collective, and average. Idempotent until ``zero_grad``."""
        self.take_replaced_grads(new_round=False)  # replaced after the last backward
        if self._averaged:
            return
        if self._rounds == 0:
            self._launch_remaining()
            self._reset_backward()
        self._inflight.wait_all()
        self._averaged = True
        self.adopt_recorded_order()  # once ([Note: launch order])

    def zero_grad(self) -> None:
        self._inflight.wait_all()  # never zero a buffer a collective is still writing
        for buf in self.grad_buffers:
            if buf is not None:
                buf.zero_()
        if self.mode is ReduceMode.SCATTER_STAGED:
            for seg in self.segments:
                for p in seg.params:
                    p.grad = None
            self._has_data = [False] * len(self.buckets)
            for shard in self.shard_grads:
                assert shard is not None
                shard.zero_()
        else:
            self.bind_grad_views()
        self.used = [[False] * len(s.params) for s in self.segments]
        self._rounds = 0
        self._averaged = False
        self._reset_backward()

    # -- views for the optimizer ---------------------------------------------------------------

    def grad_storage(self, seg: int) -> OwnedStorage:
        """Segment ``seg``'s reduced gradients: stage 2's shard, or the full buffer whose
        averaged slices this rank steps (stage 1) or all of which it steps (stage 0)."""
        return self._storages[seg]

    def _typed_storages(self) -> list[OwnedStorage]:
        rank = self.comm.rank
        owner = None if self.mode is ReduceMode.ALL_REDUCE else rank
        out: list[OwnedStorage] = []
        for seg, buf, shard in zip(self.segments, self.grad_buffers, self.shard_grads, strict=True):
            if shard is not None:
                out.append(ShardBuffer(shard, seg.layout, rank))
            else:
                assert buf is not None
                out.append(FlatBuffer(buf, seg.layout, owner))
        return out

    def buffer_bytes(self) -> int:
        return self._inflight.staging_bytes

    def gradient_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.grad_buffers if t is not None) + sum(
            t.numel() * t.element_size() for t in self.shard_grads if t is not None
        )


def _replaced(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    """``grad`` is not (an alias of) ``view``: user code replaced the binding."""
    return grad is None or (grad is not view and grad.data_ptr() != view.data_ptr())
