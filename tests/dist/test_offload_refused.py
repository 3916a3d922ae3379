"""When the NVMe tier finds its disk full at ``initialize`` (``OffloadDiskFull``), for the
optimizer's files or the parameters' (stage 3), ``zerodp.initialize`` raises before anything of
the user's is changed: the model's class, parameters (identity, storage, values, hooks),
buffers, module hooks and the optimizer are exactly as they were, and no file is left under
``offload.path``.

Their configuration rules are in tests/unit/test_offload_config.py.
"""

from __future__ import annotations

import errno
import importlib
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerodp
import zerodp.offload.swapfile as swapfile
from zerodp import OffloadConfig, ZeroConfig
from zerodp.offload.swapfile import OffloadDiskFull

TIMEOUT = 120.0


class Net(nn.Module):
    """Trainable and frozen parameters, and buffers (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.BatchNorm1d(13)
        self.fc2 = nn.Linear(13, 5)
        self.fc2.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(torch.tanh(self.fc1(x))))


def _hooks(obj: object) -> dict[str, tuple[Any, ...]]:
    """Every hook registry of a module or optimizer (``_forward_pre_hooks``, ``_forward_hooks``,
    ``_backward_hooks``, ``_state_dict_hooks``, ``_load_state_dict_pre_hooks``, ...)."""
    return {
        name: tuple(registry.keys())
        for name, registry in vars(obj).items()
        if name.endswith("hooks") and isinstance(registry, dict)
    }


class Same:
    """An object compared by identity in a snapshot (a parameter, a buffer)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and self.obj is other.obj


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What initialize would change: objects by identity (``Same``), tensors' values (clones)."""
    return {
        "class": type(model),
        "modules": {name: (type(m), _hooks(m)) for name, m in model.named_modules()},
        "params": {
            name: (
                Same(p),
                type(p),
                p.data_ptr(),
                p.requires_grad,
                p.grad is None,
                getattr(p, "_post_accumulate_grad_hooks", None),
                p._backward_hooks,
                p.detach().clone(),
            )
            for name, p in model.named_parameters()
        },
        "buffers": {n: (Same(b), b.data_ptr(), b.clone()) for n, b in model.named_buffers()},
        "optimizer": (
            type(opt),
            _hooks(opt),
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            [[Same(p) for p in g["params"]] for g in opt.param_groups],
            {id(p): dict(state) for p, state in opt.state.items()},
        ),
        "global hooks": _global_hooks(),
    }


def _global_hooks() -> dict[str, tuple[Any, ...]]:
    """torch's process-wide hooks: every module's forward / backward / registration hooks, and
    every optimizer's step hooks."""
    found = {}
    for mod in map(importlib.import_module, ("torch.nn.modules.module", "torch.optim.optimizer")):
        for name, registry in vars(mod).items():
            if name.startswith("_global") and name.endswith("hooks") and isinstance(registry, dict):
                found[f"{mod.__name__}.{name}"] = tuple(registry.keys())
    return found


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):  # a value saved as a clone
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The entries that differ: ``"params fc1.weight"``, ``"modules norm"``, ``"optimizer"``."""
    out = []
    for key, value in before.items():
        if isinstance(value, dict):
            out += [f"{key} {k}" for k in value if not _same(value[k], after[key].get(k))]
        elif not _same(value, after[key]):
            out.append(key)
    return out


def _all_hooks_empty(model: nn.Module) -> bool:
    modules = all(not keys for m in model.modules() for keys in _hooks(m).values())
    params = all(
        getattr(p, "_post_accumulate_grad_hooks", None) is None and p._backward_hooks is None
        for p in model.parameters()
    )
    return modules and params


def case_refused_untouched(stage: int, offload: OffloadConfig) -> dict[str, Any]:
    """``initialize`` with ``offload``: its error, what it changed, and (as a check that the
    snapshot sees changes) what a normal ``initialize`` of the same objects then changes."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(
        [
            {"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
            {"params": [model.fc1.bias, model.norm.weight, model.norm.bias], "lr": 3e-3},
        ],
        lr=1e-3,
    )
    hooks_empty_before = _all_hooks_empty(model)
    before = _snapshot(model, opt)
    error: str | None = None
    try:
        zerodp.initialize(model, opt, ZeroConfig(stage=stage, bucket_bytes=256, offload=offload))
    except OffloadDiskFull as exc:
        error = str(exc)
    changed = _changes(before, _snapshot(model, opt))
    hooks_empty_after = _all_hooks_empty(model)
    model, _ = zerodp.initialize(model, opt, ZeroConfig(stage=stage, bucket_bytes=256))
    with zerodp.full_parameters(model):  # stage 3: parameters are readable only gathered
        changed_by_initialize = _changes(before, _snapshot(model, opt))
    return {
        "error": error,
        "changed": changed,
        "hooks_empty": (hooks_empty_before, hooks_empty_after, _all_hooks_empty(model)),
        "changed_by_initialize": changed_by_initialize,
    }


def case_disk_full(stage: int, offload: OffloadConfig) -> dict[str, Any]:
    """The NVMe tier's directory is full (``posix_fallocate`` fails with ENOSPC; 12345 bytes
    are reported free)."""

    def full(fd: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    swapfile._reserve = full  # type: ignore[assignment]
    usage = shutil._ntuple_diskusage(10**6, 10**6 - 12345, 12345)  # type: ignore[attr-defined]
    swapfile.shutil.disk_usage = lambda path: usage  # type: ignore[assignment]
    return case_refused_untouched(stage, offload)


@pytest.mark.parametrize(
    ("stage", "tiers", "first_file"),
    [
        (1, ("nvme", "none"), "rank0-masters"),
        (3, ("nvme", "none"), "rank0-masters"),
        (3, ("cpu", "nvme"), "rank0-params"),
        (3, ("nvme", "nvme"), "rank0-params"),  # the parameters' file is made first
    ],
)
def test_a_full_disk_at_initialize_is_named_and_touches_nothing(
    world: Any, tmp_path: Path, stage: int, tiers: tuple[str, str], first_file: str
) -> None:
    nvme_dir = tmp_path / "nvme"
    offload = OffloadConfig(optimizer=tiers[0], params=tiers[1], path=str(nvme_dir))
    (result,) = world(1).run(case_disk_full, stage, offload, timeout=TIMEOUT)
    pattern = (
        re.escape(f"offload to NVMe: {str(nvme_dir)!r} has no room for {first_file} (")
        + r"(\d+)"
        + re.escape(
            " bytes; 12345 free): free space there or set ZeroConfig.offload.path to a larger "
            "disk (nothing was written; the last checkpoint is unaffected)"
        )
    )
    match = re.fullmatch(pattern, result["error"])
    assert match is not None, result["error"]
    assert int(match.group(1)) > 0 and int(match.group(1)) % 4096 == 0
    assert result["changed"] == []
    assert result["hooks_empty"] == (True, True, False)
    assert list(nvme_dir.iterdir()) == []  # the file was unlinked when it was created
