"""``Activations``: what zerodp does to the activations a forward keeps for its backward.

A nested policy of ``ZeroConfig`` ([Note: nested policies] in nesting.py); the mechanism is
``zerodp/activations`` ([Note: activation checkpointing] in activations/checkpointing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zerodp.config.checks import field_path
from zerodp.config.nesting import Policy


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

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint, list):  # from JSON
            object.__setattr__(self, "checkpoint", tuple(self.checkpoint))
        if not isinstance(self.checkpoint, tuple) or not all(
            isinstance(c, str) and c for c in self.checkpoint
        ):
            raise ValueError(
                f"{field_path(self, 'checkpoint')} must be a tuple of module class names; "
                f"got {self.checkpoint!r}"
            )
