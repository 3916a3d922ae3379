"""Mixed precision's compute copies: parameters in the compute dtype, forward inputs cast.

Trainable and frozen floating parameters are stored in the compute dtype; module buffers keep
their dtype. BatchNorm layers (whose running statistics must stay fp32 and whose kernels need
parameters of the statistics' dtype) stay entirely fp32: their input is cast to fp32 and their
output back to the compute dtype ([Note: mixed precision] in docs/design.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from zerodp.partition.segment import Segment


def batchnorm_param_ids(model: nn.Module) -> set[int]:
    """Parameters that stay fp32 under mixed precision."""
    return {id(p) for m in model.modules() if isinstance(m, _BatchNorm) for p in m.parameters()}


def _to_fp32_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return cast_floats(args, torch.float32)


def _output_caster(dtype: torch.dtype) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return cast_floats(output, dtype)

    return hook


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in (nested) forward inputs, cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


class NoCast:
    """fp32 training: nothing is cast."""

    def __init__(self) -> None:
        self.fp32_ids: set[int] = set()  # no parameter is kept fp32 apart

    def install(
        self, model: nn.Module, segments: list[Segment], frozen: list[tuple[str, nn.Parameter]]
    ) -> list[RemovableHandle]:
        return []

    def segment(self, seg: Segment) -> None:
        pass

    def parameter(self, p: nn.Parameter) -> None:
        pass

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CastInputs | None:
        return None


class ComputeCast:
    """bf16/fp16: parameters stored in the compute dtype (BatchNorm's kept fp32), floating
    forward inputs cast to it."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.fp32_ids = batchnorm_param_ids(model)

    def install(
        self, model: nn.Module, segments: list[Segment], frozen: list[tuple[str, nn.Parameter]]
    ) -> list[RemovableHandle]:
        """Cast the segments and frozen parameters (``p.data =``: the user's tensors are
        replaced, never written); returns the BatchNorm hooks."""
        for seg in segments:
            self.segment(seg)
        for _, p in frozen:
            self.parameter(p)
        hooks = []
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                hooks.append(module.register_forward_pre_hook(_to_fp32_inputs))
                hooks.append(module.register_forward_hook(_output_caster(self.dtype)))
        return hooks

    def segment(self, seg: Segment) -> None:
        """At ``initialize``, or adopted later (after its masters were taken: exact)."""
        if id(seg.params[0]) not in self.fp32_ids:
            seg.cast_(self.dtype)

    def parameter(self, p: nn.Parameter) -> None:
        """A frozen parameter (at ``initialize``, or added later)."""
        if p.is_floating_point() and id(p) not in self.fp32_ids:
            p.data = p.data.to(self.dtype)

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CastInputs | None:
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)


CastInputs = tuple[tuple[Any, ...], dict[str, Any]]
Cast = NoCast | ComputeCast


def make_cast(model: nn.Module, mixed: bool, dtype: torch.dtype) -> Cast:
    """The plan's cast policy, chosen once."""
    return ComputeCast(model, dtype) if mixed else NoCast()
