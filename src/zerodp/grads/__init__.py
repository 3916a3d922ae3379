"""Gradient synchronisation: bucketed all-reduce / reduce-scatter overlapping backward."""

from zerodp.grads.reducer import GradReducer
from zerodp.grads.sync import GradSync

__all__ = ["GradReducer", "GradSync"]
