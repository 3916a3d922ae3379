"""Finding and replacing tensors in module inputs and outputs: tensors, tuples (named tuples
included), lists, dicts (``OrderedDict`` and subclasses such as Hugging Face ``ModelOutput``
included) and dataclasses, nested to any depth."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, depth first."""
    out: list[torch.Tensor] = []
    _collect(value, out)
    return out


def _collect(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _collect(getattr(value, f.name), out)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor ``t`` replaced by ``fn(t)``, in the order of ``tensors_in``.
    Containers are rebuilt only where something changed."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [map_tensors(v, fn) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if isinstance(value, list):
            return items
        if hasattr(value, "_fields"):  # named tuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        mapped = {k: map_tensors(v, fn) for k, v in value.items()}
        if all(mapped[k] is value[k] for k in value):
            return value
        out = value.copy()
        out.update(mapped)
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            old = getattr(value, f.name)
            new = map_tensors(old, fn)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    return value
