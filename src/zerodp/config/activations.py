"""``Activations``: what zerodp does to the activations a forward keeps for its backward.

A nested policy of ``ZeroConfig`` ([Note: nested policies] in nesting.py); the mechanism is
``zerodp/activations`` ([Note: activation checkpointing] in activations/checkpointing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zerodp.config.checks import (
    check_choice,
    check_class_names,
    check_positive_int,
    field_path,
)
from zerodp.config.nesting import Policy

OFFLOAD = ("none", "cpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class Activations(Policy):
    """Activation checkpointing, at every stage."""

    PATH: ClassVar[str] = "ZeroConfig.activations"

    checkpoint: tuple[str, ...] = ()
    """Class names of the modules to checkpoint (``("Block",)``, ``("LlamaDecoderLayer",)``):
    each keeps only its inputs from the forward and runs its forward again in its backward
    (non-reentrant ``torch.utils.checkpoint``). Every name must match a module of the model;
    a module inside a checkpointed one is recomputed with it. At stage 3 every unit is still
    gathered twice per step. The same as ``zerodp.checkpoint_wrapper`` on each module."""

    offload: str = "none"
    """``"cpu"``: the inputs the checkpointed modules keep wait for their backward in host
    memory (the paper's P_a+cpu), copied out after each module's forward and back one module
    ahead in backward, overlapped on side streams ([Note: checkpoint offload] in
    activations/offload.py). Needs ``checkpoint``."""

    on_device: int = 2
    """With ``offload="cpu"``: at most this many checkpoints on the device at once (the
    forward waits for the oldest copy beyond it)."""

    partition: bool = False
    """Each rank of the model's tensor-parallel group keeps 1/TP of every checkpointed input
    and all-gathers it before the recompute (the paper's P_a, [Note: partitioned checkpoints]
    in activations/partition.py). Needs ``checkpoint`` and a model split with
    ``zerodp.tensor_parallel.parallelize``."""

    def __post_init__(self) -> None:
        check_class_names(self, "checkpoint")
        check_choice(self, "offload", OFFLOAD)
        check_positive_int(self, "on_device")
        if not isinstance(self.partition, bool):
            raise ValueError(f"{field_path(self, 'partition')} must be a bool")
        if self.partition and not self.checkpoint:
            raise ValueError(
                f"{field_path(self, 'partition')}=True partitions the inputs of checkpointed "
                f"modules: name their classes in {field_path(self, 'checkpoint')}"
            )
        if self.partition and self.offload != "none":
            raise ValueError(
                f"{field_path(self, 'partition')}=True with {field_path(self, 'offload')}="
                f"{self.offload!r} (slices in host memory) is not built: choose one"
            )
        if self.offload != "none" and not self.checkpoint:
            raise ValueError(
                f"{field_path(self, 'offload')}={self.offload!r} moves the inputs of "
                f"checkpointed modules: name their classes in {field_path(self, 'checkpoint')}"
            )
