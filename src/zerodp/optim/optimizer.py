"""``ZeroOptimizer``: what ``zerodp.initialize`` returns in place of the user's optimizer.

It *is* a ``torch.optim.Optimizer`` (LR schedulers check that) whose ``param_groups``, ``state``
and ``defaults`` are the very objects of the user's optimizer after rebinding to pieces, so a
scheduler that writes ``param_groups[i]["lr"]`` changes what the next step uses. ``step`` runs the
engine's schedule around the user's optimizer's own ``step``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zerodp.comm import CommStats
from zerodp.config import ZeroConfig
from zerodp.memory.report import MemoryReport, measure
from zerodp.optim.loss_scaler import StepInfo
from zerodp.optim.pieces import pieces_in_state_order

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine

STATE_FORMAT = "zerodp.optimizer-shard.v1"


class ZeroOptimizer(torch.optim.Optimizer):
    """A sharded view of the user's optimizer. Use it exactly like a torch optimizer."""

    def __init__(self, engine: ZeroEngine) -> None:
        # Deliberately not calling Optimizer.__init__: it would copy the param groups, and the
        # groups must stay the inner optimizer's own dicts (see module docstring).
        inner = engine.optimizer
        self._engine = engine
        self.defaults = inner.defaults
        self.state = inner.state
        self.param_groups = inner.param_groups
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The user's optimizer, rebound to this rank's pieces."""
        return self._engine.optimizer

    @property
    def engine(self) -> ZeroEngine:
        return self._engine

    def close(self) -> None:
        """Remove zerodp's hooks from the model (waiting for any collective in flight), e.g.
        before destroying the process group when the model is not used again: the model and
        its engine reference each other, so the hooks would otherwise outlive the group."""
        self._engine.remove()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._engine.step(closure)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` that works for every precision: under fp16 it multiplies the loss
        by the current loss scale first (gradients are unscaled before clipping and the step).
        With fp16 this is the one change the training loop needs."""
        self._engine.backward(loss)

    @property
    def last_step(self) -> StepInfo | None:
        """What the last ``step()`` did: skipped or not (and why), the loss scale, the norm."""
        return self._engine.last_step

    @property
    def config(self) -> ZeroConfig:
        """The configuration ``zerodp.initialize`` was given."""
        return self._engine.config

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far (skipped ones included; a loaded checkpoint's count
        continues)."""
        return self._engine.steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because some rank had non-finite gradients (fp16; fp32 and bf16
        with ``Precision(nonfinite='skip')``: or a non-finite loss)."""
        return self._engine.skipped_steps

    @property
    def steps_without_backward(self) -> int:
        """``step()`` calls that found no gradient produced since the previous step on any rank
        (``ZeroConfig.step_without_backward``)."""
        return self._engine.steps_without_backward

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (``None`` without loss scaling)."""
        scaler = self._engine.scaler
        return scaler.scale if scaler is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient. Gradients live in persistent flat buffers (no per-step
        allocation), zeroed in place either way; ``set_to_none`` decides, as in torch, whether a
        parameter that had a gradient keeps a zero one, and so is stepped even in a step that
        does not use it ([Note: kept gradients] in optim/agreement.py)."""
        self._engine.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group`` for parameters of the model (frozen at
        ``initialize``, trainable but in no group, or registered after ``initialize``): they are
        sharded like the others and the group keeps its options. A collective: every rank must
        call it with the same parameters; see [Note: param groups added after initialize] in
        engine.py."""
        self._engine.add_param_group(param_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients to a global norm, as ``torch.nn.utils.clip_grad_norm_`` does over
        the full model, and return that total norm (the same on every rank). Call it between
        ``backward`` and ``step``. The norm is over the data-parallel group's model: with tensor
        parallelism, this TP rank's shards only ([Note: data-parallel sub-groups])."""
        return self._engine.clip_grad_norm_(max_norm, norm_type)

    def wait_params(self) -> None:
        """Wait for the parameter all-gather that ``step()`` left in flight (stages 1-2 with
        ``ZeroConfig.overlap_param_gather``) and for an offloaded step still running on the
        CPU (``ZeroConfig.offload``). Only needed before reading a parameter tensor held from
        before the step outside a forward, or ``opt.state`` directly; reads through the model,
        ``state_dict()``, checkpoints and the memory report wait by themselves. Offloaded at
        stages 1-2 with several ranks, this issues the step's all-gathers: call it on every
        rank (docs/offload.md)."""
        self._engine.wait_params()

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds by category, beside the paper's formula."""
        return measure(self._engine.holdings())

    def comm_stats(self) -> CommStats | None:
        """Collective traffic (elements, bytes, calls by kind) of the last completed step."""
        return self._engine.comm_stats()

    def nvme_io(self) -> dict[str, int]:
        """Bytes this rank read from and wrote to its NVMe files (``ZeroConfig.offload``'s
        "nvme" tiers) since ``initialize``, once the last step's writes are done: diff two
        calls for a step's traffic."""
        read, written = self._engine.nvme_io()
        return {"read_bytes": read, "written_bytes": written}

    def offload_timing(self) -> dict[str, float] | None:
        """With ``ZeroConfig.offload.optimizer`` set: the last complete step's seconds on the
        host, per stage (``unpack``, ``optimizer``, ``cast``: busy time summed over chunks, and
        their ``*_chunks`` counts), how long ``step`` blocked (``blocked``) and how long the
        next forward waited for updates to land (``landing``). A step's record is complete
        when the next step starts; None before that, or without offload ([Note: offload
        timing] in offload/timing.py)."""
        return self._engine.offload_timing()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state: the inner optimizer's ``state_dict`` (one
        entry per owned piece) plus which piece of which parameter each entry is. Waits for an
        offloaded step still running (it writes the state on its worker). On NVMe the tensors
        are copies read from the files."""
        self._engine.wait_optimizer()
        masters = self._engine.masters
        with masters.resident(write=False):
            sd = self.inner.state_dict()
            if masters.store is not None:  # the resident tensors are emptied on leaving
                sd["state"] = {k: _cloned(v) for k, v in sd["state"].items()}
        sd["zerodp"] = self._shard_meta()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        meta = state_dict.get("zerodp")
        if meta is None or meta.get("format") != STATE_FORMAT:
            raise ValueError(
                "not a zerodp optimizer shard state_dict (missing 'zerodp' metadata): load the "
                "dict returned by this rank's ZeroOptimizer.state_dict()"
            )
        mine = self._shard_meta()
        for key in ("world_size", "rank", "stage", "pieces"):
            if meta[key] != mine[key]:
                raise ValueError(
                    f"optimizer state_dict was saved with a different {key} "
                    f"({_short(meta[key])} vs {_short(mine[key])} now): a shard state_dict "
                    "loads only on the same rank, world size and stage; use zerodp's sharded "
                    "checkpoints to reshard"
                )
        inner_sd = {k: v for k, v in state_dict.items() if k != "zerodp"}
        self._engine.wait_optimizer()  # an offloaded step must not write over what is loaded
        with self._engine.masters.resident(write=True):
            self.inner.load_state_dict(inner_sd)

    def _shard_meta(self) -> dict[str, Any]:
        e = self._engine
        return {
            "format": STATE_FORMAT,
            "world_size": e.comm.world_size,
            "rank": e.comm.rank,
            "stage": e.plan.stage,
            "pieces": [
                [op.name, op.piece.param_range.start, op.piece.param_range.stop]
                for op in pieces_in_state_order(self.inner, e.pieces)
            ],
        }

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self._engine.plan.stage}, inner={self.inner!r})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def _cloned(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
