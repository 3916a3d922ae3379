"""The flat ``ZeroConfig`` names of zerodp 0.1, accepted for one more release.

[Note: flat names]
Release 0.1 had one flat ``ZeroConfig`` (``reduce_dtype``, ``loss_scale``, ``prefetch_depth``,
...). Those names still work, each with one ``DeprecationWarning`` that gives the new spelling:
as constructor arguments and ``from_dict`` / ``from_json`` keys (moved by ``nest_flat_names``
to where the nested config holds them, so they give exactly the nested config), and as
attributes to read (``read_flat_name``). ``precision="bf16"`` is no flat name but the
shorthand of ``Precision`` ([Note: nested policies]) and stays: combined with flat precision
names (``precision="fp16", loss_scale=8.0``, the 0.1 way) it becomes the same ``Precision``.
A flat name given together with the policy object (or dict) that holds it is ambiguous and
refused. Configs saved by 0.1 (checkpoint manifests) are moved the same way, without warnings:
nobody can act on them (``nest_saved_config``). Next release: delete this module and its
three callers (``ZeroConfig.__init__``'s wrapper, ``__getattr__``, ``Manifest.from_json``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from zerodp.config.nesting import Policy, from_mapping, policy_fields

C = TypeVar("C", bound=type[Policy])

REMOVED = "is deprecated and will be removed in the next release"

FLAT_NAMES: dict[str, tuple[str, ...]] = {
    "reduce_dtype": ("precision", "reduce"),
    "nonfinite": ("precision", "nonfinite"),
    "loss_scale": ("precision", "loss_scaling", "fixed"),
    "initial_scale": ("precision", "loss_scaling", "initial"),
    "growth_factor": ("precision", "loss_scaling", "growth_factor"),
    "backoff_factor": ("precision", "loss_scaling", "backoff_factor"),
    "growth_interval": ("precision", "loss_scaling", "growth_interval"),
    "hysteresis": ("precision", "loss_scaling", "hysteresis"),
    "min_loss_scale": ("precision", "loss_scaling", "min_scale"),
    "unit_classes": ("stage3", "unit_classes"),
    "unit_min_numel": ("stage3", "unit_min_numel"),
    "leaf_unit_min_numel": ("stage3", "leaf_unit_min_numel"),
    "prefetch_depth": ("stage3", "prefetch_depth"),
    "persist_numel": ("stage3", "persist_numel"),
    "check_unit_order": ("stage3", "check_unit_order"),
}
"""Each flat name of 0.1 and the path of fields that holds it now."""


def accepts_flat_names(cls: C) -> C:
    """Class decorator: the dataclass ``__init__`` of ``cls`` (the root) also takes the flat
    names, each with a ``DeprecationWarning``."""
    init: Callable[..., None] = cls.__init__

    @functools.wraps(init)
    def __init__(self: Policy, **kwargs: Any) -> None:
        nested, moved = nest_flat_names(cls, kwargs, spelling="call", stacklevel=3)
        for name in moved:  # the policies the flat names went into, still as dicts
            nested[name] = from_mapping(policy_fields(cls)[name], nested[name])
        init(self, **nested)

    cls.__init__ = __init__  # type: ignore[method-assign,assignment]
    return cls


def nest_saved_config(root: type[Policy], values: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict as saved by 0.1 (flat) or later, in the nested form; not validated (it
    is a record of the run that saved it) and without warnings."""
    nested, _ = nest_flat_names(root, values, spelling=None)
    return nested


def nest_flat_names(
    root: type[Policy], values: Mapping[str, Any], spelling: str | None, stacklevel: int = 3
) -> tuple[dict[str, Any], set[str]]:
    """``values`` with every flat name moved into a dict under the policy field that holds it,
    and the names of those fields. ``spelling``: "call" or "dict", how the warning spells the
    names; ``None``: no warning. ``stacklevel``: the frame warned, as ``warnings.warn`` counts
    from here (3: the caller's caller)."""
    out = {k: v for k, v in values.items() if k not in FLAT_NAMES}
    moved: set[str] = set()
    for name in (k for k in values if k in FLAT_NAMES):
        path = FLAT_NAMES[name]
        if path[0] not in moved:  # first check for a conflict: an error, not a warning then
            out[path[0]] = _start(root, name, out, spelling or "call")
            moved.add(path[0])
        if spelling is not None:
            old, new = _old(root, name, spelling), _spell(root, path, spelling)
            warnings.warn(f"{old} {REMOVED}; use {new}", DeprecationWarning, stacklevel=stacklevel)
        _put(out[path[0]], path[1:], values[name])
    return out, moved


def read_flat_name(config: Policy, name: str) -> Any:
    """``config.<flat name>``, from where the nested config holds it (``__getattr__``)."""
    path = FLAT_NAMES.get(name)
    if path is None:
        raise AttributeError(f"{type(config).__name__!r} object has no attribute {name!r}")
    root = type(config).PATH
    warnings.warn(
        f"{root}.{name} {REMOVED}; read {root}.{'.'.join(path)}", DeprecationWarning, stacklevel=3
    )
    value: Any = config
    for part in path:
        value = getattr(value, part)
    return value


def _start(
    root: type[Policy], name: str, values: Mapping[str, Any], spelling: str
) -> dict[str, Any]:
    """The dict that collects the flat names of the policy holding ``name``: empty, or the
    policy's shorthand if ``values`` gives one; anything else given for the policy conflicts."""
    field = FLAT_NAMES[name][0]
    cls = policy_fields(root)[field]
    if field not in values:
        return {}
    given = values[field]
    if cls.SHORTHAND is not None and isinstance(given, str):
        return {cls.SHORTHAND: given}
    raise ValueError(
        f"{root.PATH} got both {name} (deprecated) and {field}, which holds it: give only "
        f"{field}, with the value of {name} in it: {_spell(root, FLAT_NAMES[name], spelling)}"
    )


def _put(target: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def _old(root: type[Policy], name: str, spelling: str) -> str:
    return f'{root.PATH} key "{name}"' if spelling == "dict" else f"{root.__name__}({name}=...)"


def _spell(root: type[Policy], path: tuple[str, ...], spelling: str) -> str:
    """``ZeroConfig(precision=Precision(reduce=...))`` ("call") or ``{"precision": {"reduce":
    ...}}`` ("dict": a key of from_dict / from_json)."""
    if spelling == "dict":
        inner = "..."
        for part in reversed(path):
            inner = f'{{"{part}": {inner}}}'
        return inner
    head, *rest = path
    inner = _spell(policy_fields(root)[head], tuple(rest), "call") if rest else "..."
    return f"{root.__name__}({head}={inner})"
