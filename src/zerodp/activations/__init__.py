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
from zerodp.activations.partition import CheckpointPartition
from zerodp.activations.scope import recomputing
from zerodp.activations.store import CheckpointStore

__all__ = [
    "CheckpointOffload",
    "CheckpointPartition",
    "CheckpointStore",
    "checkpoint_modules",
    "checkpoint_wrapper",
    "is_checkpointed",
    "offload_of",
    "recomputing",
    "uncheckpoint",
]
