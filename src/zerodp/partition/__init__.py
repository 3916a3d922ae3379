"""Pure partitioning math (no tensors, no processes): see [Note: flat buffers] in layout.py."""

from zerodp.partition.layout import FlatLayout, ParamSpec, Piece, Range, Slot, build_layout

__all__ = ["FlatLayout", "ParamSpec", "Piece", "Range", "Slot", "build_layout"]
