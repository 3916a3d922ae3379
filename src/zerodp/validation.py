"""Checks that every rank agrees on before any state changes.

A rank that found a problem must not raise alone while the others block in a collective, so
each rank computes its local error first, then all ranks exchange it with their fingerprint
(config, parameter names/shapes/dtypes, buffers, optimizer groups) in one ``all_gather_object``,
and every rank raises the same ``ValueError`` if anything is off.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.config import ZeroConfig


def fingerprint(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig
) -> dict[str, Any]:
    return {
        "config": config.to_dict(),
        "parameters": [
            (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()
        ],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        "optimizer": (type(optimizer).__name__, [len(g["params"]) for g in optimizer.param_groups]),
    }


def check_devices(
    named: list[tuple[str, nn.Parameter]], comm: Communicator, allow_meta: bool = False
) -> str:
    """``allow_meta``: stage 3 materialises a meta-device model itself, unit by unit."""
    supported = comm.supported_device_types()
    for name, p in named:
        if p.device.type == "meta" and allow_meta:
            continue
        if p.device.type == "meta":
            return (
                f"parameter '{name}' is on the meta device (not materialised): call "
                "model.to_empty(device=...) and initialise it before zerodp.initialize"
            )
        if p.device.type not in supported:
            return (
                f"parameter '{name}' is on {p.device} but the process group's backend "
                f"'{comm.backend}' serves only {', '.join(supported)} tensors: move the model "
                f"to {supported[0]} before zerodp.initialize, or pass a process group of a "
                "matching backend (gloo for cpu, nccl for cuda)"
            )
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        return (
            f"the model's parameters are on several devices {sorted(map(str, devices))}: "
            "zerodp data parallelism needs the whole model on this rank's one device"
        )
    return ""


def agree(comm: Communicator, local: dict[str, Any], error: str) -> None:
    """Raise the same ValueError on every rank if any rank has an error or a different
    fingerprint from rank 0's."""
    everyone = comm.all_gather_object((local, error))
    problems = [f"rank {r}: {err}" for r, (_, err) in enumerate(everyone) if err]
    reference = everyone[0][0]
    for r, (theirs, _) in enumerate(everyone[1:], start=1):
        for key in reference:
            if theirs.get(key) != reference.get(key):
                diff = _first_difference(reference[key], theirs.get(key))
                problems.append(f"rank {r} differs from rank 0 in {key}: {diff}")
    if problems:
        raise ValueError(
            "zerodp.initialize: ranks disagree or the input is invalid; nothing was changed:\n  "
            + "\n  ".join(problems)
        )


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            x, y = a.get(k), b.get(k)
            if x != y and isinstance(x, dict) and isinstance(y, dict):  # a nested config policy
                return f"{k}.{_first_difference(x, y)}"
            if x != y:
                return f"{k}={x!r} on rank 0 vs {y!r}"
    if isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b, strict=False):
            if x != y:
                return f"{x!r} on rank 0 vs {y!r}"
        if len(a) != len(b):
            return f"{len(a)} entries on rank 0 vs {len(b)}"
    return f"{a!r} on rank 0 vs {b!r}"
