"""Stage 3 refuses ``torch.compile`` with an error that says so.

Stage 3 gathers and releases parameters in module hooks and guards released parameters with a
tensor subclass (``access.py``). Dynamo traces the hooks instead of running them, so the traced
graph reads parameters that are not gathered, and the user sees the released-parameter error
from inside dynamo, which names the wrong cause. The root's forward pre-hook therefore checks
``torch.compiler.is_compiling()``: it is True only while dynamo traces, and the call to a
dynamo-disabled function in that branch becomes a graph break that runs eagerly and raises the
real reason, for ``model.compile()`` and ``torch.compile(model)`` alike. In eager mode the
check is one function call per forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MESSAGE = (
    "zerodp stage 3 does not support torch.compile (its per-unit parameter gathers run in "
    "module hooks that dynamo would trace instead of run): use the model uncompiled at stage 3, "
    "or ZeroConfig(stage=2) (or 0/1) with torch.compile, which keeps full parameters on every "
    "rank"
)


@torch._dynamo.disable
def _refuse() -> None:
    raise RuntimeError(MESSAGE)


def refuse_compile(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a stage-3 root."""
    if torch.compiler.is_compiling():
        _refuse()


def check_not_compiled(model: nn.Module) -> None:
    """At ``initialize`` (stage 3): a model compiled in place by ``model.compile()``."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError(MESSAGE)
