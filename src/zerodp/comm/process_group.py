"""Joining and leaving the default process group, and the exit hook that keeps its teardown
orderly."""

from __future__ import annotations

import atexit
import datetime
import gc

import torch
import torch.distributed as dist

_EXIT_HOOK: list[bool] = []

GLOO_WITH_CUDA = "cpu:gloo,cuda:gloo"
"""gloo for CPU and CUDA tensors alike: several ranks may share one GPU (NCCL refuses that),
for checks rather than speed."""


def collect_cycles_at_exit() -> None:
    """A model and its engine reference each other; left to the interpreter's final teardown,
    their buffers (which gloo has touched) were seen to be freed after the C++ process-group
    machinery and abort the process ("terminate called without an active exception"). Collecting
    cycles at exit, while everything is still alive, avoids that."""
    if not _EXIT_HOOK:
        atexit.register(gc.collect)
        _EXIT_HOOK.append(True)


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Initialise the default process group from torchrun's environment variables."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
