"""Activation memory: checkpointing modules so their backward recomputes their forward
([Note: activation checkpointing] in checkpointing.py)."""

from zerodp.activations.checkpointing import (
    checkpoint_modules,
    checkpoint_wrapper,
    is_checkpointed,
    offload_of,
    uncheckpoint,
)
from zerodp.activations.offload import CheckpointOffload
from zerodp.activations.scope import recomputing

__all__ = [
    "CheckpointOffload",
    "checkpoint_modules",
    "checkpoint_wrapper",
    "is_checkpointed",
    "offload_of",
    "recomputing",
    "uncheckpoint",
]
