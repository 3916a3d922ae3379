"""Whether a checkpointed module's forward is being recomputed now (in its backward), and whether
a module is checkpointed.

A context variable, not a field of some object: the stage-3 hooks that must behave differently
in a recompute ([Note: recompute] in params/hooks.py) and the checkpoint wrapper that knows when
one runs share nothing else (and the hooks must not import the wrapper, which imports them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from torch import nn

ORIGINAL_FORWARD = "_zerodp_checkpointed_forward"  # where the wrapper keeps the module's forward

_RECOMPUTING: ContextVar[int] = ContextVar("zerodp_recomputing", default=0)


def recomputing() -> bool:
    """Whether the forward running now is a checkpointed module's recompute."""
    return _RECOMPUTING.get() > 0


@contextlib.contextmanager
def recompute_scope() -> Iterator[None]:
    token = _RECOMPUTING.set(_RECOMPUTING.get() + 1)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def is_checkpointed(module: nn.Module) -> bool:
    return ORIGINAL_FORWARD in module.__dict__
