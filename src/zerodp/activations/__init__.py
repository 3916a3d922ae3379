"""Activation memory: checkpointing modules so their backward recomputes their forward
([Note: activation checkpointing] in checkpointing.py)."""

from zerodp.activations.checkpointing import (
    checkpoint_modules,
    checkpoint_wrapper,
    is_checkpointed,
    uncheckpoint,
)
from zerodp.activations.scope import recomputing

__all__ = [
    "checkpoint_modules",
    "checkpoint_wrapper",
    "is_checkpointed",
    "recomputing",
    "uncheckpoint",
]
