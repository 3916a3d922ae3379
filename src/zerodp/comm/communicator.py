"""Every collective goes through here (gloo_cpu.py builds some of them from others for gloo
on CPU; the comm package is the only one that calls ``torch.distributed``).

``Communicator`` binds a process group (the data-parallel group: ``None`` means the default
group; a 1-D ``DeviceMesh`` its group, see ``groups.py``) and a ``CommLedger``. Every collective
goes through it, so the ledger sees all traffic. Asynchronous collectives return a ``Handle``:
start now, ``wait()`` when the result is needed.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerodp.comm.gloo_cpu import (
    TAGS,
    Piece,
    broadcast_per_chunk,
    copy_unless_alias,
    gloo_on_cpu,
    receives_point_to_point,
    reduce_per_chunk,
    reduce_pieces_point_to_point,
    reduce_point_to_point,
)
from zerodp.comm.groups import GroupLike, claim, members, not_a_member_message, resolve_group
from zerodp.comm.handle import Handle
from zerodp.comm.ledger import CONTROL, MODEL, CommLedger
from zerodp.comm.process_group import collect_cycles_at_exit
from zerodp.comm.watchdog import Arrival, Progress, Watch, watch_for

# [Note: watchdog] how long a rank waits in one collective before it says which rank is late.
DEFAULT_WATCHDOG_S = 300.0

log = logging.getLogger(__name__)

# torch 2.13 renamed these two (the old names now warn); the package supports torch>=2.4.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True, slots=True)
class DeviceSupport:
    backend: str
    device_types: tuple[str, ...]


class Communicator:
    """Collectives over one process group, recorded in a ledger, waited through the watchdog."""

    def __init__(
        self,
        group: GroupLike,
        ledger: CommLedger | None = None,
        watchdog_s: float | None = DEFAULT_WATCHDOG_S,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "zerodp needs an initialised torch.distributed process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment), "
                "or launch with `zerodp train` / torchrun"
            )
        # [Note: data-parallel sub-groups] in groups.py: a mesh dimension becomes its group here,
        # once; every rank below is a group rank.
        self.group = resolve_group(group)
        group = self.group
        self.ledger = ledger if ledger is not None else CommLedger()
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError(not_a_member_message())
        self.members = members(group)  # global ranks, index = group rank
        self.backend = str(dist.get_backend(group))
        # Libraries that synchronise ranks themselves (transformers' generate(synced_gpus=True))
        # use the default group: only right when it is this group.
        self.default_world_size = dist.get_world_size()
        self.is_default_group = self.world_size == self.default_world_size
        # [Note: gloo chunked collectives] in gloo_cpu.py.
        self._chunked_cpu = gloo_on_cpu(self.backend)
        self._p2p_calls = 0  # point-to-point reduce-scatters issued: their tags
        self.timeout_s = watchdog_s
        # One rank issues no collective: nothing to watch, no publishing thread.
        self.watch: Watch | None = None
        self.progress = Progress()  # the engine says what this rank is doing
        if self.world_size > 1:
            default = dist.distributed_c10d._get_default_group()
            store = dist.distributed_c10d._get_default_store()
            self.watch = watch_for(default, store, self.rank, self.members)
            self.watch.use_timeout(watchdog_s)
            self.progress = self.watch.progress
        collect_cycles_at_exit()

    # -- introspection -------------------------------------------------------------------------

    def supported_device_types(self) -> tuple[str, ...]:
        """Device types whose tensors this group's backend(s) can reduce-scatter/all-gather.
        A backend string is either ``"gloo"`` or a map such as ``"cpu:gloo,cuda:nccl"``."""
        if ":" in self.backend:
            return tuple(part.split(":")[0] for part in self.backend.split(","))
        if self.backend == "gloo":
            return ("cpu",)
        if self.backend == "nccl":
            return ("cuda",)
        return ("cpu", "cuda")  # unknown third-party backend: let it try

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Record the block's collectives in a throwaway ledger: checkpoint I/O and gathers for
        inspection are not training traffic and must not show up in ``comm_stats``."""
        saved = self.ledger
        self.ledger = CommLedger()
        try:
            yield
        finally:
            self.ledger = saved

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Say what this rank is doing (for the watchdog's messages) during the block."""
        saved = self.progress.phase
        self.progress.phase = name
        try:
            yield
        finally:
            self.progress.phase = saved

    def global_rank(self, group_rank: int) -> int:
        return self.members[group_rank]

    def claim(self, name: str) -> tuple[int, ...]:
        """Claim ``name`` for this group for the rest of the job; the global ranks of the group
        that holds it (this one's unless another group claimed it first). Call on one rank."""
        return claim(name, self.group)

    # -- launching and waiting ([Note: watchdog]) ----------------------------------------------

    def _run(
        self,
        op: str,
        launch: Callable[[], Any],
        async_op: bool,
        after: Callable[[], Any] | None = None,
    ) -> Handle:
        """Launch one collective (``launch`` returns its work or works) and wait for it unless
        ``async_op``. Only called with more than one rank."""
        watch = self.watch
        assert watch is not None
        arrival = watch.arrive(op)
        try:
            works = launch()
        except RuntimeError as e:
            raise watch.diagnose(arrival, 0.0, e, self.timeout_s) from e
        handle = Handle(works, after, self, arrival)
        if not async_op:
            handle.wait()
        return handle

    def wait_works(self, works: list[Any], arrival: Arrival) -> None:
        assert self.watch is not None  # a Handle with works exists only with more than one rank
        self.watch.wait(works, arrival, self.timeout_s)

    # -- model-data collectives ----------------------------------------------------------------

    # With one rank every collective is the identity: skip the call and record no traffic.

    def all_reduce(
        self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False
    ) -> Handle:
        if self.world_size == 1:
            return Handle(None)
        self.ledger.record("all_reduce", tensor.numel(), tensor.element_size(), MODEL)
        return self._all_reduce(tensor, op, async_op)

    def _all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool) -> Handle:
        group, reduce_op = self.group, _OPS[op]
        return self._run(
            "all_reduce",
            lambda: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True),
            async_op,
        )

    def receive_numel(self, numel: int, device: torch.device) -> int:
        """Elements of the ``received`` buffer a ``reduce_scatter`` of ``numel`` elements on
        ``device`` takes to run point to point ([Note: point-to-point reduce-scatter]); 0 where
        it does not."""
        if self.world_size == 1 or not receives_point_to_point(self.backend, device):
            return 0
        return self._others_numel(numel)

    def _others_numel(self, numel: int) -> int:
        """Elements of the other ranks' chunks of a ``numel``-element input."""
        return numel // self.world_size * (self.world_size - 1)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        received: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Sum ``input`` over ranks; rank r receives chunk r. ``output`` may alias chunk r of
        ``input`` (in-place), which gloo and NCCL both support. ``received``: a buffer of
        ``receive_numel`` elements where that is not 0; every rank passes one or none."""
        if self.world_size == 1:
            copy_unless_alias(output, input)
            return Handle(None)
        if input.numel() % self.world_size:
            raise ValueError(
                f"reduce_scatter of {input.numel()} elements over {self.world_size} ranks: "
                "the input must split into equal chunks"
            )
        if received is not None:
            needed = self._others_numel(input.numel())
            if received.numel() < needed:
                raise ValueError(f"received holds {received.numel()} elements, not {needed}")
        self.ledger.record("reduce_scatter", input.numel(), input.element_size(), MODEL)
        group = self.group
        if not self._chunked(input):
            return self._run(
                "reduce_scatter",
                lambda: _reduce_scatter(output, input, group=group, async_op=True),
                async_op,
            )
        chunks = input.chunk(self.world_size)
        if received is None:
            launch, after = reduce_per_chunk(group, self.rank, output, chunks)
            return self._run("reduce_scatter", launch, async_op, after)
        launch, add = reduce_point_to_point(
            group, self.rank, output, chunks, received, self._next_tag()
        )
        return self._run("reduce_scatter", launch, async_op, add)

    def reduce_scatter_pieces(
        self, chunks: Sequence[Sequence[Piece]], numel: int, received: torch.Tensor
    ) -> tuple[Handle, torch.Tensor]:
        """Start the reduce-scatter of an input given as pieces, ``numel`` elements per rank
        ([Note: reduce-scatter from pieces]); where ``receive_numel`` is not 0 only. Returns the
        handle and the tensor that holds this rank's sum (not averaged) once it completed."""
        assert self.world_size > 1 and self._chunked(received)
        size = received.element_size()
        self.ledger.record("reduce_scatter", numel * self.world_size, size, MODEL)
        launch, add, total = reduce_pieces_point_to_point(
            self.group, self.rank, chunks, numel, received, self._next_tag()
        )
        return self._run("reduce_scatter", launch, True, add), total

    def _next_tag(self) -> int:
        tag = self._p2p_calls % TAGS
        self._p2p_calls += 1
        return tag

    def _chunked(self, tensor: torch.Tensor) -> bool:
        return self._chunked_cpu and tensor.device.type == "cpu"

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool = False,
        own_parts: Sequence[tuple[int, int]] | None = None,
    ) -> Handle:
        """Concatenate every rank's ``input`` into ``output``; ``input`` may alias chunk r.
        ``own_parts``: the (start, stop) of this rank's chunk that need ``input``'s values (the
        caller reads the rest from ``input``); the others may be left as they were."""
        if self.world_size == 1:
            copy_unless_alias(output, input)
            return Handle(None)
        self.ledger.record("all_gather", output.numel(), output.element_size(), MODEL)
        group = self.group
        if not self._chunked(output):
            return self._run(
                "all_gather",
                lambda: _all_gather(output, input, group=group, async_op=True),
                async_op,
            )
        chunks = list(output.chunk(self.world_size))
        own = chunks[self.rank]
        if own_parts is None:
            copy_unless_alias(own, input)
        else:
            for start, stop in own_parts:
                own[start:stop].copy_(input[start:stop])
            chunks[self.rank] = input  # sent as it lies
        return self._run("all_gather", broadcast_per_chunk(group, chunks), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, category: str = MODEL) -> None:
        """Broadcast from group rank ``src``."""
        if self.world_size == 1:
            return
        self.ledger.record("broadcast", tensor.numel(), tensor.element_size(), category)
        self._broadcast(tensor, src)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        group = self.group
        self._run(
            "broadcast",
            lambda: dist.broadcast(tensor, group=group, group_src=src, async_op=True),
            False,
        )

    # -- control collectives (agreement between ranks) -----------------------------------------

    def all_reduce_control(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """A small all-reduce whose result every rank uses to take the same decision."""
        self.ledger.record("all_reduce", tensor.numel(), tensor.element_size(), CONTROL)
        if self.world_size > 1:
            self._all_reduce(tensor, op, async_op=False)

    def all_gather_control(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's small ``tensor``, stacked: ``(world_size, *tensor.shape)``."""
        handle, rows = self.all_gather_control_async(tensor)
        handle.wait()
        return rows

    def all_gather_control_async(self, tensor: torch.Tensor) -> tuple[Handle, torch.Tensor]:
        """``all_gather_control`` without waiting: the handle, and the rows it will fill."""
        self.ledger.record(
            "all_gather", self.world_size * tensor.numel(), tensor.element_size(), CONTROL
        )
        return self._gather_rows_async(tensor)

    def _gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        handle, rows = self._gather_rows_async(tensor)
        handle.wait()
        return rows

    def _gather_rows_async(self, tensor: torch.Tensor) -> tuple[Handle, torch.Tensor]:
        out = tensor.new_empty(self.world_size * tensor.numel())
        flat, group = tensor.reshape(-1), self.group
        handle = Handle(None)
        if self.world_size == 1:
            out.copy_(flat)
        else:
            handle = self._run(
                "all_gather",
                lambda: _all_gather(out, flat, group=group, async_op=True),
                True,
            )
        return handle, out.view(self.world_size, *tensor.shape)

    def all_gather_object(self, obj: object) -> list[Any]:
        """Every rank's picklable ``obj``: sizes, then the padded pickles (what torch's
        ``all_gather_object`` does, with its waits through the watchdog)."""
        self.ledger.record("all_gather_object", 1, 0, CONTROL)
        if self.world_size == 1:
            return [obj]
        data = _pickled(obj, self._object_device())
        size = torch.tensor([data.numel()], dtype=torch.int64, device=data.device)
        sizes = self._gather_rows(size).view(-1).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=data.device)
        padded[: data.numel()] = data
        rows = self._gather_rows(padded)
        return [_unpickled(rows[r, :n]) for r, n in enumerate(sizes)]

    def broadcast_object(self, obj: object, src: int = 0) -> Any:
        """Group rank ``src``'s picklable ``obj`` on every rank (others pass anything)."""
        self.ledger.record("broadcast_object", 1, 0, CONTROL)
        if self.world_size == 1:
            return obj
        device = self._object_device()
        data = _pickled(obj, device) if self.rank == src else None
        size = torch.tensor([data.numel() if data is not None else 0], device=device)
        self._broadcast(size, src)
        buf = data if data is not None else torch.empty(int(size), dtype=torch.uint8, device=device)
        self._broadcast(buf, src)
        return _unpickled(buf)

    def _object_device(self) -> torch.device:
        if "cpu" in self.supported_device_types():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        group = self.group
        self._run("barrier", lambda: dist.barrier(group=group, async_op=True), False)


def _pickled(obj: object, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _unpickled(t: torch.Tensor) -> Any:
    return pickle.loads(t.cpu().numpy().tobytes())  # our own ranks' pickles
