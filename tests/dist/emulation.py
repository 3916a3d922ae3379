"""The mixed-precision ZeRO protocol written out for one process: the reference that the
bf16/fp16 tests compare zerodp with (tests/dist/test_precision.py explains the tolerances).

fp32 masters; each rank's micro-batch runs forward/backward on a compute-dtype copy; gradients
are summed over ranks in fp32 (``reduce_dtype``), averaged and stored in the compute dtype, cast
to fp32 and unscaled; AdamW steps the masters in fp32; the compute copy is the cast of the
masters.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import zerodp
from zerodp.optim.pieces import select_fused

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LR = 1e-2


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


class Emulation:
    """The mixed-precision ZeRO protocol in one process, for ``world`` ranks."""

    def __init__(self, model: nn.Module, precision: str, stage: int, world: int, scale: float):
        self.master = copy.deepcopy(model).float()
        self.compute = copy.deepcopy(model)
        for p in self.compute.parameters():  # buffers keep their dtype, as in zerodp
            p.data = p.data.to(DTYPES[precision])
        self.compute.register_forward_pre_hook(cast_inputs(DTYPES[precision]))
        self.opt = adamw(self.master.parameters())
        select_fused(self.opt)  # the same kernel choice zerodp makes (bitwise comparisons)
        self.dtype = DTYPES[precision]
        self.stage, self.world, self.scale = stage, world, scale

    def step(self, loss_fn, poison: set[int] = frozenset()) -> bool:
        """One step; ``poison`` ranks produce infinite losses. Returns whether it stepped."""
        with torch.no_grad():
            for c, m in zip(self.compute.parameters(), self.master.parameters(), strict=True):
                c.copy_(m.to(self.dtype))
        sums = [torch.zeros_like(p) for p in self.master.parameters()]
        for r in range(self.world):
            self.compute.zero_grad()
            loss = loss_fn(self.compute, r)
            if r in poison:
                loss = loss * float("inf")
            (loss * self.scale).backward()
            for s, p in zip(sums, self.compute.parameters(), strict=True):
                s.add_(p.grad.float())
        finite = all(bool(torch.isfinite(s).all()) for s in sums)
        for s, m in zip(sums, self.master.parameters(), strict=True):
            m.grad = (s / self.world).to(self.dtype).float() / self.scale
        if finite:
            self.opt.step()
        self.opt.zero_grad()
        return finite


def cast_inputs(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return tuple(a.to(dtype) if a.is_floating_point() else a for a in args)

    return hook


def masters_error(opt: zerodp.ZeroOptimizer, emu: Emulation) -> float:
    """Max relative L2 error between this rank's fp32 master pieces and the emulation's."""
    ref = dict(emu.master.named_parameters())
    worst = 0.0
    for op in opt.engine.pieces:
        r = op.piece.param_range
        want = ref[op.name].detach().reshape(-1)[r.start : r.stop]
        err = (op.tensor.detach() - want).norm().item() / max(want.norm().item(), 1e-30)
        worst = max(worst, err)
    return worst
