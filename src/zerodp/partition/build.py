"""Flat segments from a model's trainable parameters, as every stage lays them out.

[Note: segment grouping] Parameters are grouped by (dtype, device, kept in fp32, optimizer state
kept on the device) in reversed registration order, DDP's approximation of the order backward
produces gradients; one segment per group. The last key only splits anything under partial
offload ([Note: partial offload] in offload/partial.py). Buckets and alignment are sized for
the dtype the segment is stored in (the compute
dtype under mixed precision, except parameters kept in fp32 such as BatchNorm's).
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp.partition.layout import ParamSpec, build_layout
from zerodp.partition.segment import Segment
from zerodp.plan import Plan


def build_segments(
    named: list[tuple[str, nn.Parameter]],
    plan: Plan,
    world_size: int,
    fp32_ids: set[int],
    first: int = 0,
    kept: frozenset[int] = frozenset(),
) -> list[Segment]:
    """Segments ``first``, ``first + 1``, ... holding ``named`` (see the note); ``kept``: ids
    of the parameters whose optimizer state stays on the device under partial offload."""
    Kind = tuple[torch.dtype, torch.device, bool, bool]
    by_kind: dict[Kind, list[tuple[str, nn.Parameter]]] = {}
    for name, p in reversed(named):
        key = (p.dtype, p.device, id(p) in fp32_ids, id(p) in kept)
        by_kind.setdefault(key, []).append((name, p))
    segments = []
    for i, ((dtype, _, keep_fp32, _), items) in enumerate(by_kind.items()):
        if plan.mixed and not keep_fp32:
            dtype = plan.compute_dtype
        specs = [ParamSpec(n, tuple(p.shape)) for n, p in items]
        layout = build_layout(specs, world_size, plan.bucket_numel(dtype), plan.align(dtype))
        params, names = [p for _, p in items], [n for n, _ in items]
        segments.append(Segment.build(first + i, layout, params, names))
    return segments
