"""Refusing to read a stage-3 parameter whose unit is released.

[Note: safe reads]
At rest a sharded parameter's ``.data`` is a placeholder ([Note: released placeholders] in
``segment.py``). Without a guard, code that reads a parameter outside its unit's forward
(``model.head.weight`` in a loss, when ``head`` is its own unit) would compute on NaN or crash
far from the cause. Each unit parameter's class is therefore switched to a subclass of
``ShardedParameter`` whose ``__torch_function__`` raises a ``RuntimeError`` naming the parameter,
its unit and ``zerodp.full_parameters`` when a torch function that reads values is applied to it
while released. The placeholder must never *escape* as a plain tensor, whose reads no check can
see: so the ways to get a plain tensor of the parameter's values are refused too, the ``.data``
getter, ``detach()`` and the other view properties (``.T``, ``.mT``, ``.H``, ``.mH``, ``.real``,
``.imag``), as are ``copy.deepcopy`` and pickling (``torch.save``), which read ``.data``
without a torch function. Metadata stays readable (shape, dtype, device, ``requires_grad``,
``.grad``, ``is_leaf``, hooks, ``data_ptr``, ``untyped_storage``: the placeholder's, one
element) and ``.data`` can still be *set*: zerodp's own code, optimizers and Hugging Face code
read those. zerodp's internals that need a released parameter's placeholder use
``torch._C.DisableTorchFunctionSubclass()``. ``repr``/``str`` do not raise (debuggers and
error messages format tensors): a released parameter shows its name, shape, dtype and how to
read it, never values. The cost is one Python call per torch function that takes a parameter
(a few microseconds), which is why only stage-3 parameters get it. The subclass is made per
engine so that it can reach that engine's unit states without a global (``UnitLookup``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

# Torch functions that do not read parameter values.
_METADATA = frozenset(
    {
        "__get__",
        "__set__",
        "__hash__",
        "size",
        "numel",
        "nelement",
        "dim",
        "ndimension",
        "stride",
        "storage_offset",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "get_device",
        "data_ptr",
        "untyped_storage",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
    }
)


# Attribute getters (torch function ``__get__``) that return the values as another tensor.
_VALUE_GETTERS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})


def _reads_values(func: Callable[..., Any]) -> str | None:
    """How a call of ``func`` on a parameter is named in an error, or None if it reads only
    metadata (see [Note: safe reads])."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        return f".{attr}" if attr in _VALUE_GETTERS else None
    if name in _METADATA:
        return None
    return name or repr(func)


class UnitLookup(Protocol):
    def released(self, param: torch.Tensor) -> tuple[str, str] | None:
        """(parameter name, unit label) if ``param`` is released now, else None."""

    def read(self, param: torch.Tensor) -> tuple[str, str] | None:
        """``released``, after gathering ``param``'s unit if the reading rule allows a gather
        on demand (an attached unit read while the root is gathered)."""


class ShardedParameter(nn.Parameter):
    """An ``nn.Parameter`` sharded by zerodp stage 3. It is the full parameter while its unit is
    gathered; reading it at any other time raises (see the module docstring)."""

    _lookup: ClassVar[UnitLookup]

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        what = _reads_values(func)
        if what is not None:
            for value in (*args, *kwargs.values()):
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, ShardedParameter):
                        _refuse_if_released(type(t)._lookup, t, what)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    # Copying or pickling reads ``.data`` (allowed, for state_dict) without a torch function:
    # refuse them here, or a copy would silently hold the placeholder.
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        _refuse_if_released(type(self)._lookup, self, "copy.deepcopy")
        return super().__deepcopy__(memo)

    def __reduce_ex__(self, proto: Any) -> Any:
        _refuse_if_released(type(self)._lookup, self, "pickling")
        return super().__reduce_ex__(proto)

    # nn.Parameter and torch.Tensor declare incompatible __repr__ signatures; match Parameter's.
    def __repr__(self) -> str:  # type: ignore[override]
        where = type(self)._lookup.released(self)
        if where is not None:
            name, unit = where
            return (
                f"ShardedParameter('{name}', shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"released: unit '{unit}' is not gathered; read it inside "
                "`with zerodp.full_parameters(model):`)"
            )
        # Exactly a plain Parameter's repr (the subclass would print as
        # "Parameter(ShardedParameter(...))").
        with torch._C.DisableTorchFunctionSubclass():
            return repr(nn.Parameter(self.detach(), requires_grad=self.requires_grad))


def _refuse_if_released(lookup: UnitLookup, param: torch.Tensor, what: str) -> None:
    where = lookup.read(param)
    if where is None:
        return
    name, unit = where
    raise RuntimeError(
        f"zerodp stage 3: parameter '{name}' was read ({what}) while its unit '{unit}' is "
        "released (each rank holds only a shard). Read parameters only inside the forward of "
        "their unit's module, in the loss only if they belong to the root unit (or a unit "
        "attached to it), or inside "
        "`with zerodp.full_parameters(model):`; to keep a parameter available, make it part "
        "of an enclosing unit (ZeroConfig.stage3.unit_classes / unit_policy) or persistent "
        "(ZeroConfig.stage3.persist_numel)"
    )


def guard_parameters(params: list[nn.Parameter], lookup: UnitLookup) -> type[ShardedParameter]:
    """Switch ``params`` to a ``ShardedParameter`` subclass bound to ``lookup``."""
    cls = type("ShardedParameter", (ShardedParameter,), {"_lookup": lookup})
    for p in params:
        p.__class__ = cls
    return cls
