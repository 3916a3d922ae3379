"""What ``zerodp.initialize`` adds to the user's module (which it modifies in place).

The module's class is swapped for a subclass that also inherits ``ZeroModule`` (as FSDP2's
``fully_shard`` does), so ``isinstance(model, MyModel)`` still holds, ``state_dict`` keys are
unchanged, and DDP habits such as ``model.no_sync()`` work. The subclass is invisible where
libraries look at the class ([Note: invisible subclass]).

Reads of parameters through the model outside a forward (``parameters()``,
``named_parameters()``, ``state_dict()``, ``model.layer.weight``) first wait for the stage 1-2
parameter gather that ``step()`` left in flight ([Note: deferred parameter gather]).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine

_CLASSES: dict[type, type] = {}


# [Note: invisible subclass]
# The subclass carries the user's class's ``__name__``, ``__qualname__`` and ``__module__``, so
# what libraries derive from the class is unchanged: Hugging Face's ``save_pretrained`` writes
# ``config.architectures = [type(model).__name__]`` and picks the loss from the class name;
# ``repr(model)`` and logs read the same. Creating the subclass must not run the user's classes'
# ``__init_subclass__`` hooks: they are written for subclasses their authors define, and can
# fail on ours (transformers' evaluates every annotation of the new class's MRO). ``type()``
# calls the hook of the first base after the new class, which is ``ZeroModule``'s below, and it
# does not chain: the subclass adds no fields the user's hooks would have to register.
# ``ZeroModule`` declares no class-level annotations, so ``typing.get_type_hints`` on the
# subclass sees exactly the user's class's.


class ZeroModule:
    """Mixin for modules managed by zerodp."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Deliberately not chained ([Note: invisible subclass])."""

    @property
    def zero_engine(self) -> ZeroEngine:
        engine: ZeroEngine = self.__dict__["_zero_engine"]
        return engine

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        self.zero_engine.wait_params()
        return super().named_parameters(*args, **kwargs)  # type: ignore[misc]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.zero_engine.wait_params()
        return super().state_dict(*args, **kwargs)  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        # Called for submodules, parameters and buffers (not in __dict__). Inside the model's
        # own forward the per-module hooks wait bucket by bucket instead.
        engine = self.__dict__.get("_zero_engine")
        if engine is not None and not engine.param_gather.in_forward:
            engine.wait_params()
        return super().__getattr__(name)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """[Note: model.zero_grad] The same as ``opt.zero_grad(set_to_none)``, plus torch's
        ``Module.zero_grad`` on the frozen parameters. torch's own would set every ``.grad`` to
        ``None``, but zerodp's gradients live in flat buffers (stages 0-1: ``.grad`` are views of
        one; stages 2-3: the reduced gradient is in the owned shard and ``.grad`` is ``None``
        between steps), so clearing ``.grad`` alone left them there: stages 2-3 accumulated
        across steps, stage 1 refused the next backward. Code that clears ``.grad`` other ways:
        stages 0-1 see it ([Note: replaced gradients] in grads/reducer.py); stages 2-3 cannot,
        and a step on gradients that no zero_grad cleared since the previous step is logged
        (once)."""
        engine = self.zero_engine
        engine.zero_grad(set_to_none)
        for _, p in engine.frozen:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.requires_grad_(False)
                p.grad.zero_()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no gradient communication, for the backward
        passes inside the block; the first backward outside it reduces the sum (as DDP)."""
        reducer = self.zero_engine.reducer
        previous = reducer.sync_enabled
        reducer.sync_enabled = False
        try:
            yield
        finally:
            reducer.sync_enabled = previous


def zero_class(cls: type) -> type:
    """The (cached) subclass of ``cls`` that also inherits ``ZeroModule``. Made before anything
    is changed by ``initialize``, so a failure here leaves the model untouched."""
    if issubclass(cls, ZeroModule):
        return cls
    zcls = _CLASSES.get(cls)
    if zcls is None:
        namespace = {
            **_waiting_container_methods(cls),
            **_generate_method(cls),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        zcls = type(cls.__name__, (ZeroModule, cls), namespace)
        _CLASSES[cls] = zcls
    return zcls


def attach(module: nn.Module, engine: ZeroEngine, zcls: type) -> None:
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


# [Note: generate]
# Hugging Face's ``generate`` runs one forward per new token until this rank's sequences are done,
# so ranks with different prompts or ``max_new_tokens`` run different numbers of forwards. At
# stage 3 every forward gathers units (collectives), so ranks must stay in step:
# ``generate(synced_gpus=True)`` keeps every rank running forwards until all are done (one small
# all-reduce of a done flag per token), which transformers turns on by itself only for DeepSpeed
# ZeRO-3 and FSDP. The subclass's ``generate`` gives stage 3 the same default when the caller
# passes no ``synced_gpus`` and more than one rank holds the model, and holds the root unit
# gathered for the call ([Note: inference] in params/hooks.py). Inside ``full_parameters`` over
# the whole model nothing is gathered in forward, so it adds nothing: generation on some ranks
# only works there. Stages 0-2 need neither: their eval forwards issue no collective. A model
# split over a tensor-parallel group ([Note: tensor parallelism]) gives the same prompt to the
# ranks of that group, which then run the same forwards: synced_gpus over the default group is
# right when DP x TP is the whole world.


def _held_by_world(engine: ZeroEngine) -> bool:
    """Whether every rank of the default group holds this model: its DP group, or its DP group
    times its tensor-parallel group (whose ranks always run the same forwards)."""
    tp = engine.norm_scope.tp
    holders = engine.comm.world_size * (tp.world_size if tp is not None else 1)
    return holders == engine.comm.default_world_size


def _generate_method(cls: type) -> dict[str, Any]:
    inner = getattr(cls, "generate", None)
    if not callable(inner):
        return {}
    # A model's own ``generate`` (not transformers') may not take the argument.
    syncable = "synced_gpus" in inspect.signature(inner).parameters

    @functools.wraps(inner)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self.__dict__.get("_zero_engine")
        sharded = engine.params if engine is not None else None
        if sharded is None or sharded.fully_pinned():
            return inner(self, *args, **kwargs)
        if syncable and engine.comm.world_size > 1 and "synced_gpus" not in kwargs:
            if not _held_by_world(engine):
                raise RuntimeError(
                    "zerodp stage 3: model.generate needs synced_gpus=True to keep ranks in step, "
                    "and transformers synchronises it over the default process group, which is "
                    "larger than the ranks holding this model (zerodp's process_group, times "
                    "its tensor-parallel group). Generate inside "
                    "`with zerodp.full_parameters(model):` (on every rank of the group) with "
                    "synced_gpus=False instead"
                )
            kwargs["synced_gpus"] = True
        with sharded.generating():
            return inner(self, *args, **kwargs)

    return {"generate": generate}
