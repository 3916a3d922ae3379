"""Pure partitioning math (no tensors, no processes): see [Note: flat buffers] in layout.py."""

from zerodp.partition.layout import (
    Bucket,
    FlatLayout,
    ParamSpec,
    Piece,
    Range,
    Slot,
    build_layout,
)

__all__ = ["Bucket", "FlatLayout", "ParamSpec", "Piece", "Range", "Slot", "build_layout"]
