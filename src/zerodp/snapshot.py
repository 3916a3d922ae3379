"""Undo for ``zerodp.initialize``: it either succeeds or leaves the user's objects as they were.

[Note: initialize is all or nothing]
``initialize`` changes the model and the optimizer in many places: parameters become views of
flat buffers (``p.data = ...``), stage 3 switches parameter classes and swaps meta tensors for
real ones, hooks are registered on modules and parameters, the optimizer's groups are rebound
to pieces and its state resliced, the model's class is swapped. A failure half-way (a rank's
invalid model, a bug, a KeyboardInterrupt) must not leave a model that neither trains nor
matches what the user built. Everything ``initialize`` changes is either a *reference*
(``__class__``, ``.data``, entries of the modules' and optimizer's dicts) or memory zerodp
allocated itself, with one exception ordered last: the broadcast of rank 0's frozen parameters
and module buffers, written in place (a copy would double the frozen model, e.g. a LoRA base).
So a snapshot of references taken before the first change restores the user's objects exactly
(identity and values) from any failure before that broadcast, at no memory cost. A collective
that fails during the final broadcast (a rank died) may leave some frozen values received from
rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def _copy_dict_entries(obj: object) -> dict[str, Any]:
    """``obj.__dict__``, with every container value's *contents* copied (the containers are
    mutated in place: ``_parameters``, hook dicts, ``param_groups``)."""
    out: dict[str, Any] = {}
    for key, value in vars(obj).items():
        if isinstance(value, dict):
            out[key] = (value, dict(value))
        elif isinstance(value, list):
            out[key] = (value, list(value))
        elif isinstance(value, set):
            out[key] = (value, set(value))
        else:
            out[key] = (value, None)
    return out


def _restore_dict_entries(obj: object, saved: dict[str, Any]) -> None:
    attrs = vars(obj)
    attrs.clear()
    for key, (value, contents) in saved.items():
        if isinstance(contents, list):
            value[:] = contents
        elif contents is not None:
            value.clear()
            value.update(contents)
        attrs[key] = value


@dataclass
class _ParamState:
    param: nn.Parameter
    cls: type
    data: torch.Tensor
    requires_grad: bool
    grad: torch.Tensor | None
    attrs: dict[str, Any]
    accumulate_hooks: Any
    backward_hooks: Any

    @classmethod
    def take(cls, p: nn.Parameter) -> _ParamState:
        accumulate = getattr(p, "_post_accumulate_grad_hooks", None)
        backward = p._backward_hooks
        return cls(
            p,
            type(p),
            p.data,
            p.requires_grad,
            p.grad,
            dict(vars(p)),
            None if accumulate is None else (accumulate, dict(accumulate)),
            None if backward is None else (backward, dict(backward)),
        )

    def restore(self) -> None:
        p = self.param
        try:
            p.data = self.data
        except RuntimeError:  # a meta parameter that sharded construction swapped for a real one
            fresh = nn.Parameter(self.data, requires_grad=self.requires_grad)
            torch.utils.swap_tensors(p, fresh)
        p.__class__ = self.cls
        p.requires_grad_(self.requires_grad)
        p.grad = self.grad
        vars(p).clear()
        vars(p).update(self.attrs)
        for attr, saved in (
            ("_post_accumulate_grad_hooks", self.accumulate_hooks),
            ("_backward_hooks", self.backward_hooks),
        ):
            if saved is None:
                setattr(p, attr, None)
            else:
                hooks, contents = saved
                hooks.clear()
                hooks.update(contents)
                setattr(p, attr, hooks)


@dataclass
class InitSnapshot:
    """References to everything ``initialize`` may change ([Note: initialize is all or
    nothing])."""

    modules: list[tuple[nn.Module, type, dict[str, Any]]] = field(default_factory=list)
    params: list[_ParamState] = field(default_factory=list)
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    optimizer: tuple[torch.optim.Optimizer, type, dict[str, Any], list[Any]] | None = None

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer) -> InitSnapshot:
        snap = cls()
        for m in model.modules():
            snap.modules.append((m, type(m), _copy_dict_entries(m)))
        seen: set[int] = set()
        for m in model.modules():
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    snap.params.append(_ParamState.take(p))
            snap.buffers.extend((b, b.data) for b in m.buffers(recurse=False))
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    snap.params.append(_ParamState.take(p))
        groups = [(g, dict(g), list(g["params"])) for g in optimizer.param_groups]
        snap.optimizer = (optimizer, type(optimizer), _copy_dict_entries(optimizer), groups)
        return snap

    def restore(self) -> None:
        for m, module_cls, attrs in self.modules:
            m.__class__ = module_cls
            _restore_dict_entries(m, attrs)
        for state in self.params:
            state.restore()
        for b, data in self.buffers:
            b.data = data
        if self.optimizer is not None:
            opt, opt_cls, attrs, groups = self.optimizer
            opt.__class__ = opt_cls
            _restore_dict_entries(opt, attrs)
            for group, contents, params in groups:
                group.clear()
                group.update(contents)
                group["params"] = params
