"""Checkpoints partitioned over the tensor-parallel group (the paper's P_a).

[Note: partitioned checkpoints]
Under tensor parallelism the input of a transformer layer (the residual stream) is the same on
every rank of the TP group ([Note: tensor parallelism]), so a checkpointed layer would keep TP
identical copies of it. With ``Activations(partition=True)`` each TP rank keeps only its
1/TP slice: after the module's forward the input (given storage of its own, store.py) is cut
into TP equal slices (the last padded), this rank's is copied out and the full storage resized
to 0; in backward, the recompute first all-gathers the slices into the restored storage
(through an alias, so torch's checkpoint sees no version change). Device memory for the
checkpoints drops by (TP - 1)/TP; the cost is one all-gather of each checkpoint per recompute,
on the TP group's ledger, while the TP ranks recompute the same module together anyway.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from zerodp.activations.store import Slot, alias, nbytes, own_inputs, shares_output
from zerodp.tensor_parallel import TensorParallel


class CheckpointPartition:
    """Keeps this TP rank's slice of each checkpointed input ([Note: partitioned checkpoints])."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.gathered_bytes = 0  # all-gathered back, ever (the slices of every rank)
        self._order: list[weakref.ref[Slot]] = []  # slots alive, for resident_bytes
        self._verified = False  # the checkpoints were checked to be replicated over TP

    def own_inputs(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Slot]:
        return own_inputs(args)

    def store(self, slot: Slot, outputs: list[torch.Tensor]) -> None:
        if not slot.tensors or shares_output(slot, outputs) or self.tp.size == 1:
            return
        if not self._verified:
            self._check_replicated(slot)
        rank, size = self.tp.rank, self.tp.size
        with torch.no_grad():
            for t in slot.tensors:
                flat = alias(t)
                width = -(-flat.numel() // size)
                mine = flat.new_zeros(width)
                start = min(rank * width, flat.numel())
                stop = min(start + width, flat.numel())
                mine[: stop - start].copy_(flat[start:stop])
                slot.away.append(mine)
                t.untyped_storage().resize_(0)
        slot.freed = True
        self._order = [r for r in self._order if r() is not None]
        self._order.append(weakref.ref(slot))

    def _check_replicated(self, slot: Slot) -> None:
        """The first forward: each checkpoint must be the same on every TP rank (a module whose
        input is itself split, a row-parallel layer, would be rebuilt from different tensors).
        One small all-gather per checkpointed module, until the first backward."""
        sums = torch.stack([t.detach().double().sum() for t in slot.tensors])
        rows = self.tp.comm.all_gather_control(sums.to(slot.tensors[0].device))
        if not all(torch.equal(rows[0], row) for row in rows):
            raise ValueError(
                "Activations(partition=True): a checkpointed module's input differs between "
                "the tensor-parallel ranks (its input is split, as a row-parallel layer's is); "
                "partition only modules whose input every TP rank holds whole (transformer "
                "layers)"
            )

    def load(self, slot: Slot) -> None:
        self._verified = True  # a backward: every module of a forward has been checked
        if not slot.freed:
            return
        with torch.no_grad():
            for t, mine in zip(slot.tensors, slot.away, strict=True):
                t.untyped_storage().resize_(nbytes(t))
                gathered = mine.new_empty(self.tp.size * mine.numel())
                self.tp.comm.all_gather(gathered, mine)
                alias(t).copy_(gathered[: t.numel()])
                self.gathered_bytes += nbytes(gathered)
        slot.away = []
        slot.freed = False

    def resident_bytes(self) -> int:
        total = 0
        for slot in (r() for r in self._order):
            if slot is not None:
                total += sum(t.untyped_storage().nbytes() for t in slot.tensors)
                total += sum(nbytes(a) for a in slot.away)
        return total

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointPartition:
        return CheckpointPartition(self.tp)  # a copied model keeps its own slots
