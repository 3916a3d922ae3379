"""Helpers shared by save and load: the state to save or restore, collective verdicts,
state_dict aliases."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from torch import nn

from zerodp.checkpoint.manifest import CheckpointError
from zerodp.views import CheckpointState

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Engine(Protocol):
    def wait_params(self) -> None: ...

    def checkpoint_state(self) -> CheckpointState: ...


def state_of(model: nn.Module, opt: Any) -> CheckpointState:
    """The training state of a model returned by ``zerodp.initialize`` with its optimizer."""
    engine = model.__dict__.get("_zero_engine")
    if engine is None:
        raise TypeError(
            f"{type(model).__name__} is not managed by zerodp: pass the model returned by "
            "zerodp.initialize"
        )
    opt_engine = getattr(opt, "engine", None)
    if opt is not None and opt_engine is not engine:
        raise ValueError(
            "the optimizer is not the ZeroOptimizer that zerodp.initialize returned with this model"
        )
    managed: _Engine = engine
    # Checkpoints read and write the owned slices a deferred gather may still be sending.
    managed.wait_params()
    return managed.checkpoint_state()


def attempt(fn: Callable[[], T]) -> tuple[T | None, str]:
    """Run ``fn``; return (result, "") or (None, error message). A rank that failed must still
    take part in the next collective so that every rank can raise together."""
    try:
        return fn(), ""
    except Exception as exc:  # every error becomes a verdict; nothing is swallowed
        log.debug("checkpoint step failed", exc_info=True)
        text = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        return None, text


def raise_if_any(errors: Sequence[str], header: str) -> None:
    """Raise one ``CheckpointError`` listing every rank's problem (the same on every rank)."""
    by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(errors):
        for line in filter(None, text.split("\n")):
            ranks = by_text.setdefault(line, [])
            if rank not in ranks:
                ranks.append(rank)
    if not by_text:
        return
    lines = []
    for text, ranks in by_text.items():
        who = "every rank" if len(ranks) == len(errors) else _ranks(ranks)
        lines.append(f"{who}: {text}")
    raise CheckpointError(header + "\n  " + "\n  ".join(lines))


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def state_dict_entries(model: nn.Module) -> list[tuple[str, str, str]]:
    """(state_dict key, "param"|"buffer", canonical name) for every tensor in the plain model's
    ``state_dict``: tied weights appear under every name they have (``named_parameters`` yields
    them once, under the canonical name that checkpoints store)."""
    by_id: dict[int, tuple[str, str]] = {id(b): ("buffer", n) for n, b in model.named_buffers()}
    by_id.update({id(p): ("param", n) for n, p in model.named_parameters()})
    out = []
    for key, value in model.state_dict(keep_vars=True).items():
        hit = by_id.get(id(value))
        if hit is None:  # extra state (get_extra_state) or a tensor made up by a hook
            log.warning("state_dict entry %r is not a parameter or buffer: not checkpointed", key)
            continue
        out.append((key, hit[0], hit[1]))
    return out
