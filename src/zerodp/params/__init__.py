"""Stage 3: parameters sharded at rest, gathered per unit just in time.

Files, top-down: ``manager`` (the engine's entry point and accounting), ``hooks`` (the schedule:
[Note: stage-3 schedule]), ``saved`` ([Note: backward without parameters]: which units the
backward need not gather), ``prefetch`` ([Note: prefetch]), ``unit`` (a unit's lifecycle and its
all-gathers), ``reduce`` (its reduce-scatters: [Note: stage-3 reduce chunks]), ``order``
(divergence checks), ``segment`` ([Note: sharded storage]), ``reuse`` ([Note: reused gather
memory]), ``access`` (refusing reads of
released parameters), ``policy`` ([Note: units]), ``build`` ([Note: sharded construction]),
``full`` (``full_parameters`` and ``state_dict``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zerodp.params.access import ShardedParameter
from zerodp.params.full import full_parameters
from zerodp.params.meta_writes import RecordConstructorWrites
from zerodp.params.policy import UnitPolicy

__all__ = ["ShardedParameter", "UnitPolicy", "full_parameters", "sharded_init"]


@contextmanager
def sharded_init() -> Iterator[None]:
    """Build a model without allocating it: modules created inside get parameters and buffers
    on the meta device. ``zerodp.initialize(..., ZeroConfig(stage=3))`` then materialises it
    one unit at a time, each rank keeping only its shards (see [Note: sharded construction] in
    ``zerodp/params/build.py``; seed the RNG identically on every rank first)::

        torch.manual_seed(0)
        with zerodp.sharded_init():
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters())
        model, opt = zerodp.initialize(model, opt, zerodp.ZeroConfig(stage=3))
    """
    with torch.device("meta"), RecordConstructorWrites():  # [Note: values written in a ...]
        yield
