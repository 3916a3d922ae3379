"""``OffloadStep``: the optimizer step on the CPU, bucket by bucket, overlapped.

[Note: offloaded step]
With ``ZeroConfig.offload.optimizer="cpu"`` the fp32 masters and the optimizer state of this
rank's slices live in host memory (``Masters(host=True)``; the user's optimizer is bound to
pieces of them), so the device holds only the parameters and gradients. The gradient
reductions, the non-finite check and gradient clipping stay on the device, unchanged: the
check and the global norm are computed from the reduced shards *before* any update (they are
cheap there, and a step that is skipped or clipped must be known before the first bucket is
stepped). Then ``step`` sends every bucket's owned region, cut into *chunks* of at most a bucket
([Note: offload chunks] in chunks.py), through a pipeline of five queues, in the order the next
forward needs the buckets (``ParamSync.update_order``):

1. ``d2h`` (a device stream): copy the chunk's reduced gradient into a host ring slot;
2. ``unpack`` (a host worker): upcast it into this chunk's part of the host fp32 gradient,
   times 1/loss scale and each clip coefficient not applied on the device yet, exactly as the
   device step fills its fp32 scratch; the ring slot is free again, and the copy of the chunk
   ``slots`` ahead into it is queued from here (so the ring bounds the pinned memory);
3. ``optimizer`` (a host worker): step the chunk's used pieces ([Note: host optimizer step]);
4. ``cast`` (a host worker): cast the updated masters into an outgoing ring slot (a worker of
   its own, so that CPU Adam, the slowest stage, steps the next chunk meanwhile);
5. ``h2d`` (a device stream): copy the slot into the chunk's region of the parameters.

The CPU implementation of the streams runs each queue on a thread, the CUDA one queues the
copies on side streams and the host work on threads: one code path ([Note: streams]).
``step`` returns once every gradient is in host memory (the device gradients are free for
``zero_grad`` and the next backward: the copies run at transfer speed, not CPU-Adam speed),
leaving per bucket the event of its update in ``Landing``. The next forward starts at once;
each bucket's first reader waits for its landing (``Landing``): so the CPU step of the later
buckets overlaps the forward of the earlier layers, and no parameter is read before its update
landed (tests/dist/test_offload.py checks both with deliberately slow copies).

Exact: each element goes through the same operations as without offload (the same upcast,
scaling and clip products, the same element-wise optimizer kernel, the same cast back), so the
parameters are bitwise those of the device step wherever the kernels are the same (on CPU) and
within the fp32 tolerance otherwise. Host memory: 12 B/param of masters and Adam state plus
4 B/param of fp32 gradient (this rank's slices), plus the rings.

With ``OffloadConfig.host_gradients="ring"`` (the default on NVMe) the fp32 gradient is a ring
of ``ring_buckets`` chunks instead: 4 B/param less. A chunk is unpacked into a slot only once
the step of the chunk ``ring_buckets`` before it is done, so ``step`` (which returns once every
gradient is unpacked, that is once the device gradients may change) returns when all but the
last ``ring_buckets`` chunks are stepped: the CPU step then overlaps only the start of the next
forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from zerodp.offload.chunks import HostChunk, host_chunks
from zerodp.offload.grad_spill import GradSpill
from zerodp.offload.home import ShardHome
from zerodp.offload.host_step import HostStepper
from zerodp.offload.landing import Landing
from zerodp.offload.ring import TransferRing
from zerodp.offload.swap import SwapStore
from zerodp.offload.timing import PipelineClock
from zerodp.optim.clip import NormScope
from zerodp.optim.masters import Masters, ReducedGrads
from zerodp.optim.pieces import OptimPiece
from zerodp.optim.runner import StepCheck
from zerodp.partition.segment import Segment
from zerodp.streams import Event


class OffloadStep:
    """See [Note: offloaded step]. ``device``: what checks and clips: a device runner
    (fp32: whole, mixed: chunked; its step is never called), or with the gradients on NVMe
    ``SpillCheck`` ([Note: gradients on NVMe])."""

    writes_params = True  # the step copies updated parameters itself, per bucket

    def __init__(
        self,
        segments: list[Segment],
        pieces: list[OptimPiece],
        masters: Masters,
        device: StepCheck,
        landing: Landing,
        order: list[tuple[int, int]],
        slots: int,
        chunk: int,
        swap: Callable[[list[HostChunk]], SwapStore] | None = None,
        home: ShardHome | None = None,
        spill: GradSpill | None = None,
        *,
        grad_ring: bool = False,
    ) -> None:
        """``grad_ring``: the host fp32 gradient is ``slots`` chunks, not the whole
        (``OffloadConfig.host_gradients``)."""
        self.segments = segments
        self.pieces = pieces
        self.masters = masters
        self.device = device
        self.streams = landing.streams
        self.landing = landing
        self.chunks = host_chunks(segments, pieces, masters.rank, order, chunk)
        offset = sum(c.numel for c in self.chunks)
        largest = max((c.numel for c in self.chunks), default=0)
        self.swap = swap(self.chunks) if swap is not None else None
        # A ring (the default on NVMe: [Note: optimizer state on NVMe]) holds 4 B/param less;
        # the chunk ``slots`` ahead is unpacked into a slot once its last step is done.
        self.grad_slots = slots if grad_ring else 0
        self._grad_slot = largest  # elements per gradient ring slot
        grad_numel = largest * slots if self.grad_slots else offset
        self.host_grad = torch.empty(grad_numel, dtype=torch.float32)
        # Gradients on NVMe ([Note: gradients on NVMe]) are read into the incoming slots.
        self.spill = spill
        self.incoming = TransferRing(self.streams, slots, largest, aligned=spill is not None)
        # Stage 3's offloaded shards take the updates instead of the device ([Note: offloaded
        # parameters] in home.py); on NVMe through these slots, written with O_DIRECT.
        self.home = home
        aligned = home is not None and home.aligned
        self.outgoing = TransferRing(self.streams, slots, largest, aligned=aligned)
        self.clock = PipelineClock()  # [Note: offload timing]
        landing.take_waited()  # a rebuilt runner's clock starts from nothing

    def host_gradient(self, k: int, chunk: HostChunk) -> torch.Tensor:
        """Where chunk ``k`` of a step's work list gets its fp32 gradient."""
        if not self.grad_slots:
            return self.host_grad.narrow(0, chunk.offset, chunk.numel)
        start = (k % self.grad_slots) * self._grad_slot
        return self.host_grad.narrow(0, start, chunk.numel)

    # -- on the device, unchanged --------------------------------------------------------------

    def nonfinite(self, grads: ReducedGrads, inv_scale: float) -> bool:
        return self.device.nonfinite(grads, inv_scale)

    def bind(self, used: list[list[bool]]) -> None:
        """Nothing: the pieces are host tensors; ``.grad`` exists only inside their step, on
        the optimizer worker (so nothing on the caller's thread may touch it)."""

    def unbind(self) -> None:
        pass

    def clip(
        self,
        grads: ReducedGrads,
        inv_scale: float,
        used: list[list[bool]],
        max_norm: float,
        norm_type: float,
        scope: NormScope,
    ) -> torch.Tensor:
        return self.device.clip(grads, inv_scale, used, max_norm, norm_type, scope)

    def pending_factors(self) -> list[torch.Tensor]:
        return []  # the host step applies the device runner's

    def reset(self) -> None:
        self.device.reset()

    @property
    def nbytes(self) -> int:
        return self.device.nbytes

    @property
    def timing(self) -> dict[str, float] | None:
        return None if self.clock.last is None else dict(self.clock.last)

    @property
    def host_nbytes(self) -> dict[str, int]:
        """Host memory besides the masters and optimizer state: gradient and rings."""
        stores = [part for part in (self.swap, self.spill) if part is not None]
        return {
            "host_gradients": self.host_grad.numel() * self.host_grad.element_size(),
            "host_buffers": self.incoming.nbytes
            + self.outgoing.nbytes
            + sum(part.host_nbytes for part in stores),
            "nvme": sum(part.nvme_nbytes for part in stores),
        }

    # -- the pipeline ----------------------------------------------------------------------------

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grads: ReducedGrads,
        inv_scale: float,
        used: list[list[bool]],
    ) -> None:
        # The last step's updates landed (raises what failed): its casts read the masters
        # this step writes.
        self.landing.wait_all()
        if self.swap is not None:  # and its writes are done
            self.swap.wait()
        if self.home is not None:  # what it read ahead is about to change
            self.home.invalidate()
        if self.spill is not None:  # every gradient on its file before the reads
            self.spill.settle()
        self.clock.add("landing", self.landing.take_waited())
        self.clock.next_step()  # the last step is complete: [Note: offload timing]
        index = [
            j for j, c in enumerate(self.chunks) if any(self._used(k, used) for k, _, _ in c.pieces)
        ]
        if not index:
            return
        run = _StepRun(self, grads, HostStepper(optimizer), inv_scale, used, index)
        unpacked = run.start()
        start = time.perf_counter()
        unpacked.wait()  # the device gradients are free once all are in host memory
        self.clock.add("blocked", time.perf_counter() - start)

    def _used(self, k: int, used: list[list[bool]]) -> bool:
        op = self.pieces[k]
        return used[op.seg][op.slot]


class _StepRun:
    """One step's pass through the pipeline. Each list entry is written by the one task that
    produces it before any task that reads it runs (the queues run in order)."""

    def __init__(
        self,
        runner: OffloadStep,
        grads: ReducedGrads,
        stepper: HostStepper,
        inv_scale: float,
        used: list[list[bool]],
        index: list[int],
    ) -> None:
        self.r = runner
        self.index = index  # of each chunk of this step in ``runner.chunks``
        work = [runner.chunks[j] for j in index]
        self.grads = grads
        self.stepper = stepper
        self.inv_scale = inv_scale
        self.used = used
        self.work = work
        # What the device runner has not applied to the reduced gradients (clip coefficients
        # of the chunked mixed-precision path), taken to the host once.
        self.factors = [f.detach().to("cpu") for f in runner.device.pending_factors()]
        streams = runner.streams
        self.d2h, self.h2d = streams.side("offload-d2h"), streams.side("offload-h2d")
        self.unpacker = streams.host("offload-unpack")
        self.optimizer = streams.host("offload-optimizer")
        self.caster = streams.host("offload-cast")
        self.fetched: list[Event | None] = [None] * len(work)
        self.copied: list[Event | None] = [None] * len(work)
        self.updated: list[Event | None] = [None] * len(work)  # stepped
        self.casted: list[Event | None] = [None] * len(work)  # landed: result is the copy
        self.swapped: list[Event | None] = [None] * len(work)  # NVMe: read into its slot
        if runner.swap is not None:  # worker threads start on first use: only on NVMe
            self.reader = streams.host("offload-read")
            self.writer = streams.host("offload-write")
        if runner.spill is not None:
            self.grad_reader = streams.host("offload-grad-read")

    def start(self) -> Event:
        """Queue every chunk; the event of the last unpack (all gradients on the host)."""
        ready = self.r.streams.compute.submit(lambda: None)  # gradients final, params free
        self.d2h.wait(ready)
        self.h2d.wait(ready)
        for k in range(min(self.r.incoming.slots, len(self.work))):
            self.fetched[k] = self._fetch(k)
        if self.r.swap is not None:
            for k in range(min(self.r.swap.slots, len(self.work))):
                self.swapped[k] = self.reader.submit(partial(self._read, k, None))
        unpacked: Event | None = None
        for k, chunk in enumerate(self.work):
            unpacked = self.unpacker.submit(partial(self._unpack, k))
            self.updated[k] = self.optimizer.submit(partial(self._update, k, unpacked))
            casted = self.caster.submit(partial(self._cast, k))
            self.casted[k] = casted
            self.r.landing.expect(chunk.seg, chunk.bucket, casted)
        assert unpacked is not None
        return unpacked

    def _fetch(self, k: int) -> Event:
        c = self.work[k]
        spill = self.r.spill
        if spill is not None:  # from the file: at the chunk's place in its region
            read = partial(spill.read, c.seg, c.bucket, c.start, c.numel, self.r.incoming.raw(k))
            return self.grad_reader.submit(read)
        src = c.of(self.grads.grad_storage(c.seg))
        slot = self.r.incoming.view(k, c.numel, src.dtype)
        return self.d2h.submit(partial(slot.copy_, src, non_blocking=True), uses=[src])

    def _unpack(self, k: int) -> None:
        fetched = self.fetched[k]
        assert fetched is not None
        fetched.wait()
        c = self.work[k]
        dst = self.r.host_gradient(k, c)
        if self.r.grad_slots and k >= self.r.grad_slots:  # a ring: its last step is done
            previous = self.updated[k - self.r.grad_slots]
            assert previous is not None
            previous.wait()
        with self.r.clock.working("unpack"):  # after the waits: [Note: offload timing]
            src = self.r.incoming.view(k, c.numel, self.grads.grad_storage(c.seg).data.dtype)
            dst.copy_(src)
            if self.inv_scale != 1.0:  # the same products, in the same order, as on the device
                dst.mul_(self.inv_scale)
            for f in self.factors:
                dst.mul_(f)
            ahead = k + self.r.incoming.slots
            if ahead < len(self.work):  # this slot is free again
                self.fetched[ahead] = self._fetch(ahead)

    def _update(self, k: int, unpacked: Event) -> None:
        """The optimizer worker: step chunk ``k``'s used pieces."""
        unpacked.wait()
        c = self.work[k]
        swap = self.r.swap
        if swap is not None:
            if k >= swap.slots:  # the cast that queued this slot's read has run
                before = self.casted[k - swap.slots]
                assert before is not None
                before.wait()
            swapped = self.swapped[k]
            assert swapped is not None
            swapped.wait()
            swap.bind(self.index[k], k)
        mine = [(i, off, n) for i, off, n in c.pieces if self.r._used(i, self.used)]
        grad = self.r.host_gradient(k, c)
        pieces = [self.r.pieces[i] for i, _, _ in mine]
        with self.r.clock.working("optimizer"):
            self.stepper.step(pieces, [grad.narrow(0, off, n) for _, off, n in mine])

    def _cast(self, k: int) -> Event | None:
        """The cast worker: chunk ``k``'s updated masters into the parameters (so the CPU's
        next Adam chunk runs meanwhile); on NVMe, then written back. The event of the copy."""
        stepped = self.updated[k]
        assert stepped is not None
        stepped.wait()
        c = self.work[k]
        swap = self.r.swap
        slots = self.r.outgoing.slots
        if k >= slots:  # the copy that last used this slot
            previous = self.copied[k - slots]
            if previous is not None:
                previous.wait()
        if swap is not None:
            masters = swap.masters_of(self.index[k], k)
        else:
            masters = c.of(self.r.masters.storage(c.seg))
        with self.r.clock.working("cast"):
            copied = self._land(k, c, masters)
        self.copied[k] = copied
        if swap is not None:
            written = self.writer.submit(partial(swap.write, self.index[k], k))
            swap.writes.append(written)
            ahead = k + swap.slots
            if ahead < len(self.work):  # into this slot, once written back
                self.swapped[ahead] = self.reader.submit(partial(self._read, ahead, written))
        return copied

    def _land(self, k: int, c: HostChunk, masters: torch.Tensor) -> Event | None:
        """The updated masters into the parameters: through an outgoing slot to the device,
        or into the shard's home (offloaded parameters). The event of that copy or write."""
        home = self.r.home
        if home is not None and home.holds(c.seg):  # persistent segments stay on the device
            return home.land(c, masters, self.r.outgoing.raw(k))
        dst = c.of(self.r.segments[c.seg].param_storage(self.r.masters.owner))
        slot = self.r.outgoing.view(k, c.numel, dst.dtype)
        slot.copy_(masters)  # the cast to the params'
        return self.h2d.submit(partial(dst.copy_, slot, non_blocking=True), uses=[dst])

    def _read(self, k: int, after: Event | None) -> None:
        """NVMe: chunk ``k``'s masters and state into its slot ([Note: optimizer state on
        NVMe] in swap.py), once ``after`` (the write that last used the slot) is done."""
        if after is not None:
            after.wait()
        assert self.r.swap is not None
        self.r.swap.read(self.index[k], k)
