"""What ``zerodp.initialize`` adds to the user's module (which it modifies in place).

The module's class is swapped for a subclass that also inherits ``ZeroModule`` (as FSDP2's
``fully_shard`` does), so ``isinstance(model, MyModel)`` still holds, ``state_dict`` keys are
unchanged, and DDP habits such as ``model.no_sync()`` work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine

_CLASSES: dict[type, type] = {}


class ZeroModule:
    """Mixin for modules managed by zerodp."""

    _zero_engine: ZeroEngine

    @property
    def zero_engine(self) -> ZeroEngine:
        return self._zero_engine

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no gradient communication, for the backward
        passes inside the block; the first backward outside it reduces the sum (as DDP)."""
        reducer = self._zero_engine.reducer
        previous = reducer.sync_enabled
        reducer.sync_enabled = False
        try:
            yield
        finally:
            reducer.sync_enabled = previous


def attach(module: nn.Module, engine: ZeroEngine) -> None:
    cls = type(module)
    if not isinstance(module, ZeroModule):
        zcls = _CLASSES.get(cls)
        if zcls is None:
            zcls = type(f"Zero{cls.__name__}", (ZeroModule, cls), {})
            _CLASSES[cls] = zcls
        module.__class__ = zcls
    module.__dict__["_zero_engine"] = engine
