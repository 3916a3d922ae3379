"""Gradient reduction: bucketed all-reduce / reduce-scatter overlapping backward."""

from zerodp.grads.reducer import GradReducer, ReduceMode

__all__ = ["GradReducer", "ReduceMode"]
