"""Master parameters: what the optimizer updates, and how updates reach the model.

[Note: mixed precision]
fp32 training: the optimizer's pieces are views of the model's own flat parameter buffer, so a
step updates the model in place (then stages 1-2 all-gather the owned slices).

bf16/fp16 training (``ZeroConfig.precision``): the model's parameters and gradients are in the
compute dtype; an fp32 master copy exists only for the owned pieces (stages 1-2: a shard buffer
of ``shard_numel``; stage 0: the whole flat space), initialised from the fp32 parameters before
they are cast. At each step the optimizer steps the fp32 masters on the owned gradient upcast
(averaged, unscaled) one bucket at a time into a constant-size fp32 scratch ([Note: chunked
fp32 gradients] in optim/chunked.py), and ``publish`` casts the updated masters into the
compute-dtype buffer before the all-gather. At rest a rank holds exactly the paper's model states
(2Ψ params + 2Ψ or 2Ψ/N grads + 12Ψ or 12Ψ/N for masters, momentum, variance) plus that
scratch (one bucket's owned slice in fp32, set by ``bucket_bytes``, not by the model); no
step allocates an fp32 copy of the owned gradient.

Stage 3 (``ShardedSegment``, [Note: sharded storage]): the owned shard is all a rank holds at
rest. fp32: the masters *are* the shards. Mixed: the masters are fp32 copies of the shards, and
``publish`` casts them into the shards; units are gathered when next used, not here.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zerodp.params.segment import ShardedSegment
from zerodp.partition.segment import Segment, flat_view


class ReducedGrads(Protocol):
    """What the masters need of a reducer (``GradReducer``, or ``ShardedGrads`` in stage 3)."""

    def grad_storage(self, seg: int) -> tuple[torch.Tensor, bool]: ...


class Masters:
    """Master storage for every segment; see [Note: mixed precision]."""

    def __init__(self, segments: list[Segment], *, separate: bool, sharded: bool, rank: int):
        self.segments = segments
        self.separate = separate  # fp32 copies (mixed precision) rather than the params
        self.sharded = sharded and separate  # master buffers indexed by shard offsets
        self.rank = rank
        self.buffers: list[torch.Tensor] = [self._master(seg) for seg in segments]

    def _master(self, seg: Segment) -> torch.Tensor:
        if isinstance(seg, ShardedSegment):  # stage 3
            return seg.shard.to(torch.float32, copy=True) if self.separate else seg.shard
        if not self.separate:
            return seg.param_buffer
        if self.sharded:
            return self._gather_owned(seg, seg.param_buffer).float()
        return seg.param_buffer.detach().float().clone()

    def add(self, segments: list[Segment]) -> None:
        """Masters for segments appended to the engine's list (unfrozen parameters)."""
        self.buffers += [self._master(seg) for seg in segments]

    def _gather_owned(self, seg: Segment, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slices of ``flat`` (a full-size flat buffer), concatenated in bucket order:
        the shard-buffer layout."""
        lay = seg.layout
        parts = [flat_view(flat, lay.bucket_shard(b, self.rank)) for b in range(len(lay.buckets))]
        if not parts:
            return flat.new_zeros(0)
        return torch.cat(parts)

    def storage(self, i: int) -> tuple[torch.Tensor, bool]:
        return self.buffers[i], self.sharded or isinstance(self.segments[i], ShardedSegment)

    # -- publishing ----------------------------------------------------------------------------

    def publish(self) -> None:
        """Refresh the owned slices of the model's parameters from the masters (a cast, under
        mixed precision; nothing in fp32, where the masters are the parameters). The other
        slices arrive by all-gather ([Note: deferred parameter gather] in params/deferred.py)."""
        if not self.separate:
            return
        with torch.no_grad():
            for seg, master in zip(self.segments, self.buffers, strict=True):
                if isinstance(seg, ShardedSegment):
                    seg.shard.copy_(master)
                elif self.sharded:
                    self._scatter_owned(seg, master, seg.param_buffer)
                else:
                    seg.param_buffer.copy_(master)

    def _scatter_owned(self, seg: Segment, shard: torch.Tensor, flat: torch.Tensor) -> None:
        lay = seg.layout
        for b in range(len(lay.buckets)):
            owned = lay.bucket_shard(b, self.rank)
            src = shard.narrow(0, lay.bucket_shard_offset(b), owned.numel)
            flat_view(flat, owned).copy_(src)

    @property
    def nbytes(self) -> int:
        """Bytes of fp32 master copies (0 when the masters are the parameters themselves)."""
        return sum(b.numel() * b.element_size() for b in self.buffers) if self.separate else 0
