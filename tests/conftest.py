"""Shared pytest configuration for the zerodp test suite."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Multi-rank tests import their harness as a top-level module (`from harness import ...`, see
# tests/dist/harness.py).  Put tests/dist on sys.path here, before any test module is collected,
# so that works from every test directory and in the worker processes (which copy sys.path).
_DIST_DIR = Path(__file__).resolve().parent / "dist"
if str(_DIST_DIR) not in sys.path:
    sys.path.insert(0, str(_DIST_DIR))

from harness import WorldPool, close_shared_pools, shared_pool  # noqa: E402


@pytest.fixture(scope="session")
def world() -> Iterator[Callable[..., WorldPool]]:
    """Factory for persistent multi-rank worlds: ``world(2).run(fn, *args)``.

    One pool per world size is shared by the whole session; a pool broken by a failing test
    restarts on its next ``run``.  All pools are shut down when the session ends.
    """
    yield shared_pool
    close_shared_pools()


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    """Tiny models on a busy 2-core machine run far slower with torch's default thread pool."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
