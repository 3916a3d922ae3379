"""Activation checkpointing of chosen modules, at every stage.

[Note: activation checkpointing]
A checkpointed module keeps only its inputs from the forward; when its backward needs what the
forward computed, it runs the forward again (the *recompute*) under ``torch.utils.checkpoint``
(non-reentrant: it works with ``torch.autograd.grad``, inputs that need no gradient and keyword
arguments, and it is what PyTorch recommends). zerodp replaces the module's ``forward``
*attribute* (the instance's, never the class's) by one that checkpoints the original, so the
module object, its class, its parameters and its ``state_dict`` keys stay what they were (a
wrapper module, as torch's ``checkpoint_wrapper``, would add a name to every key), and:

- the module's own hooks (stage-3 gathers, casts, the user's) run once per forward call: the
  recompute calls the original ``forward``, not ``module.__call__``;
- modules *inside* it are called through ``__call__`` in the recompute, so their hooks do run
  again; the recompute runs inside ``recompute_scope()`` (scope.py), which the stage-3 schedule
  reads ([Note: recompute] in params/hooks.py): a unit run in a recompute is gathered if it
  must be and then held until its backward, which starts right after, so every unit is
  gathered twice per step (forward and backward), checkpointed or not;
- at stage 3 a checkpointed unit itself is gathered by its pre-backward hook, which fires when
  the gradient of its output arrives, before autograd unpacks the tensors whose unpacking runs
  the recompute: the recompute reads gathered parameters, and nothing re-gathers into a
  storage that autograd still holds (the checkpointed forward saved none of them).

``ZeroConfig.activations.checkpoint`` names module classes to checkpoint (as
``Stage3.unit_classes`` names units); ``zerodp.checkpoint_wrapper(module)`` checkpoints one
module, before or without ``zerodp.initialize``; ``uncheckpoint`` restores the original
forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerodp.activations.scope import ORIGINAL_FORWARD, is_checkpointed, recompute_scope
from zerodp.activations.store import CheckpointStore, Slot
from zerodp.params.tree import tensors_in


def checkpoint_wrapper(module: nn.Module, offload: CheckpointStore | None = None) -> nn.Module:
    """Checkpoint ``module``'s forward ([Note: activation checkpointing]); returns ``module``
    itself (its forward attribute replaced). ``offload``: where its inputs wait for the
    backward: host memory (``CheckpointOffload``, [Note: checkpoint offload]) or slices over
    the tensor-parallel group (``CheckpointPartition``, [Note: partitioned checkpoints]).
    Raises if it is checkpointed already."""
    if is_checkpointed(module):
        raise ValueError(
            f"{type(module).__name__} is checkpointed already (zerodp.checkpoint_wrapper "
            "twice, or a class named in ZeroConfig.activations.checkpoint as well)"
        )
    original = module.forward
    module.__dict__[ORIGINAL_FORWARD] = original
    wrapped = functools.partial(_checkpointed, original, offload)
    module.forward = functools.wraps(original)(wrapped)
    return module


def offload_of(module: nn.Module) -> CheckpointStore | None:
    """Where a checkpointed ``module``'s inputs wait (None: on the device, whole)."""
    if not is_checkpointed(module):
        return None
    offload = module.__dict__["forward"].args[1]
    return offload


def uncheckpoint(module: nn.Module) -> None:
    """Undo ``checkpoint_wrapper``: the module's forward is its class's again."""
    if not is_checkpointed(module):
        return
    del module.__dict__[ORIGINAL_FORWARD]
    del module.__dict__["forward"]


def checkpoint_modules(model: nn.Module, classes: tuple[str, ...]) -> list[str]:
    """The names of ``model``'s modules whose class name is in ``classes``, outermost only (a
    module inside a checkpointed one is recomputed with it); raises naming the classes present
    if some class matches nothing (a typo must not silently checkpoint nothing)."""
    names: list[str] = []
    found: set[str] = set()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind not in classes:
            continue
        found.add(kind)
        if not any(name.startswith(f"{outer}.") or outer == "" for outer in names):
            names.append(name)
    missing = [c for c in classes if c not in found]
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"ZeroConfig.activations.checkpoint names {missing}, which no module of the model "
            f"is; its module classes are {present}"
        )
    wrapped = [n for n in names if is_checkpointed(model.get_submodule(n))]
    if wrapped:
        raise ValueError(
            f"ZeroConfig.activations.checkpoint would checkpoint {wrapped[:3]} again: they are "
            "checkpointed already (zerodp.checkpoint_wrapper); do one or the other"
        )
    return names


def _checkpointed(
    original: Callable[..., Any], offload: CheckpointStore | None, *args: Any, **kwargs: Any
) -> Any:
    if not torch.is_grad_enabled():  # no backward can follow: nothing to keep or recompute
        return original(*args, **kwargs)
    slot: Slot | None = None
    if offload is not None:
        args, slot = offload.own_inputs(args)
    calls = 0

    def run(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:  # the forward
            return original(*a, **kw)
        if offload is not None and slot is not None:
            offload.load(slot)
        with recompute_scope():  # its backward's recompute
            return original(*a, **kw)

    out = checkpoint(run, *args, use_reentrant=False, **kwargs)
    if offload is not None and slot is not None:
        offload.store(slot, tensors_in(out))
    return out
