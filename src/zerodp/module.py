"""What ``zerodp.initialize`` adds to the user's module (which it modifies in place).

The module's class is swapped for a subclass that also inherits ``ZeroModule`` (as FSDP2's
``fully_shard`` does), so ``isinstance(model, MyModel)`` still holds, ``state_dict`` keys are
unchanged, and DDP habits such as ``model.no_sync()`` work.

Reads of parameters through the model outside a forward (``parameters()``,
``named_parameters()``, ``state_dict()``, ``model.layer.weight``) first wait for the stage 1-2
parameter gather that ``step()`` left in flight ([Note: deferred parameter gather]).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

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

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        self._zero_engine.wait_params()
        return super().named_parameters(*args, **kwargs)  # type: ignore[misc]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._zero_engine.wait_params()
        return super().state_dict(*args, **kwargs)  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        # Called for submodules, parameters and buffers (not in __dict__). Inside the model's
        # own forward the per-module hooks wait bucket by bucket instead.
        engine = self.__dict__.get("_zero_engine")
        if engine is not None and not engine.param_gather.in_forward:
            engine.wait_params()
        return super().__getattr__(name)  # type: ignore[misc]

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
            zcls = type(f"Zero{cls.__name__}", (ZeroModule, cls), _waiting_container_methods(cls))
            _CLASSES[cls] = zcls
        module.__class__ = zcls
    module.__dict__["_zero_engine"] = engine


def _waiting_container_methods(cls: type) -> dict[str, Any]:
    """``model[i]`` and ``for layer in model`` on a container root (``nn.Sequential``,
    ``nn.ModuleList``) bypass ``__getattr__``: make them wait for the parameter gather too."""
    methods: dict[str, Any] = {}
    for name in ("__getitem__", "__iter__"):
        inner = getattr(cls, name, None)
        if inner is not None:
            methods[name] = _waiting(inner)
    return methods


def _waiting(method: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self.__dict__.get("_zero_engine")
        if engine is not None and not engine.param_gather.in_forward:
            engine.wait_params()
        return method(self, *args, **kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper
