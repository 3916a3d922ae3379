"""The tensor-parallel group: the ranks that split each layer of one model replica.

[Note: tensor parallelism]
In a DP x TP mesh every data-parallel replica of the model is split over a tensor-parallel
group, Megatron-style: each TP rank holds a slice of every split layer and the ranks meet in an
all-reduce twice per transformer layer in forward and twice in backward. zerodp shards optimizer
state, gradients and parameters over the *data-parallel* group only (``zerodp.initialize(...,
process_group=mesh["dp"])``); the TP slices are ordinary parameters to it. The TP collectives
run through a ``Communicator`` of their own: its ledger counts the TP traffic apart from ZeRO's
(``TensorParallel.ledger``), and a late TP rank is named by the watchdog instead of hanging.

Why not ``torch.distributed.tensor.parallel``: it turns the parameters into DTensors, and
zerodp's flat buffers, stage-3 gathers and checkpoints work on plain tensors; the few autograd
functions Megatron's layout needs (regions.py) keep every parameter a plain local tensor.
"""

from __future__ import annotations

from typing import Any

from zerodp.comm import CommLedger, Communicator, GroupLike
from zerodp.comm.communicator import DEFAULT_WATCHDOG_S


class TensorParallel:
    """One tensor-parallel group (``mesh["tp"]`` of a DP x TP mesh, or a ``ProcessGroup``).

    Shared, never copied: a deep copy of a model split over it (an EMA copy) uses the same group.
    """

    def __init__(self, group: GroupLike, watchdog_s: float | None = DEFAULT_WATCHDOG_S) -> None:
        self.comm = Communicator(group, CommLedger(), watchdog_s)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.world_size

    @property
    def ledger(self) -> CommLedger:
        """The TP traffic (activations all-reduced, logits and partitioned checkpoints
        gathered), apart from ZeRO's data-parallel ledger."""
        return self.comm.ledger

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorParallel:
        return self

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"
