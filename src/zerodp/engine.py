"""The one place where components are wired together.

``ZeroEngine`` builds the flat segments, the gradient reducer and the optimizer's pieces from a
resolved ``Plan``, and runs the step's schedule:

1. backward: hooks launch bucketed reductions as gradients become ready (``grads.reducer``);
2. ``step``: wait for them, agree across ranks on which parameters got a gradient (one small
   all-reduce), step the user's optimizer on the owned pieces, all-gather the updated slices
   (stages 1-2).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerodp.comm import CommLedger, CommStats, Communicator
from zerodp.config import ZeroConfig
from zerodp.grads.reducer import GradReducer
from zerodp.optim.clip import clip_grad_norm
from zerodp.optim.pieces import (
    OptimPiece,
    check_optimizer,
    group_of_params,
    make_pieces,
    rebind_optimizer,
)
from zerodp.partition.layout import ParamSpec, build_layout
from zerodp.partition.segment import Segment, flat_view
from zerodp.plan import Plan, resolve
from zerodp.validation import agree, check_devices, fingerprint

log = logging.getLogger(__name__)


class ZeroEngine:
    """Sharded data-parallel training state of one rank."""

    config: ZeroConfig
    plan: Plan
    comm: Communicator
    segments: list[Segment]
    frozen: list[tuple[str, nn.Parameter]]
    reducer: GradReducer
    pieces: list[OptimPiece]
    optimizer: torch.optim.Optimizer  # the user's, rebound to pieces
    steps: int

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig,
        process_group: Any = None,
    ) -> None:
        self.config = config
        self.plan = resolve(config)
        self.comm = Communicator(process_group, CommLedger())
        self.model = model
        named = _unique_named_parameters(model)
        trainable = [(n, p) for n, p in named if p.requires_grad]
        self.frozen = [(n, p) for n, p in named if not p.requires_grad]
        error = check_devices(named, self.comm) or check_optimizer(optimizer, (p for _, p in named))
        agree(self.comm, fingerprint(model, optimizer, config), error)

        self.segments = self._build_segments(trainable)
        self._broadcast_from_rank0()
        self.reducer = GradReducer(self.segments, self.comm, self.plan.reduce_mode)
        self.reducer.register_hooks()
        self.pieces = self._build_pieces(optimizer)
        rebind_optimizer(optimizer, self.pieces, self.segments)
        self.optimizer = optimizer
        self._hooks = [model.register_forward_pre_hook(self._before_forward)]
        self.steps = 0
        self.init_comm = self.comm.ledger.end_step()
        self.comm.ledger.steps.clear()

    # -- construction --------------------------------------------------------------------------

    def _build_segments(self, trainable: list[tuple[str, nn.Parameter]]) -> list[Segment]:
        # DDP's order: reversed registration order approximates the order gradients are ready.
        ordered = list(reversed(trainable))
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
        for name, p in ordered:
            by_kind.setdefault((p.dtype, p.device), []).append((name, p))
        segments = []
        for i, ((dtype, _), items) in enumerate(by_kind.items()):
            specs = [ParamSpec(n, tuple(p.shape)) for n, p in items]
            layout = build_layout(
                specs,
                self.comm.world_size,
                self.plan.bucket_numel(dtype),
                self.plan.align(dtype),
            )
            segments.append(Segment.build(i, layout, [p for _, p in items], [n for n, _ in items]))
        return segments

    def _broadcast_from_rank0(self) -> None:
        """Start from rank 0's parameters and buffers, as DDP does."""
        if self.comm.world_size == 1:
            return
        with torch.no_grad():
            for seg in self.segments:
                self.comm.broadcast(seg.param_buffer)
            for _, p in self.frozen:
                self.comm.broadcast(p.data)
            for b in self.model.buffers():
                self.comm.broadcast(b)

    def _build_pieces(self, optimizer: torch.optim.Optimizer) -> list[OptimPiece]:
        rank = self.comm.rank
        per_seg = [
            s.layout.pieces(rank) if self.plan.shard_optimizer else s.layout.full_pieces()
            for s in self.segments
        ]
        master = [(s.param_buffer, False) for s in self.segments]
        grads = [self.reducer.grad_storage(i) for i in range(len(self.segments))]
        return make_pieces(self.segments, per_seg, group_of_params(optimizer), master, grads)

    # -- the training step ---------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self.config.broadcast_buffers and self.comm.world_size > 1:
            with torch.no_grad():
                for b in module.buffers():
                    self.comm.broadcast(b)

    def finish_gradients(self) -> None:
        """Wait for the step's reductions and agree on which parameters got a gradient."""
        if self.reducer._averaged:  # already done for this step
            return
        self.reducer.finish()
        used = self._agree_on_used()
        for op in self.pieces:
            op.tensor.grad = op.grad if used[op.seg][op.slot] else None

    def _agree_on_used(self) -> list[list[bool]]:
        """One small all-reduce (MAX) of [used bit per parameter..., error flag]: a parameter
        gets an update iff some rank produced a gradient for it, exactly as in unsharded
        training; the flag makes every rank raise together instead of leaving others hanging."""
        flags = [u for seg in self.reducer.used for u in seg]
        changed = self._requires_grad_changed()
        t = torch.tensor([*flags, bool(changed)], dtype=torch.uint8)
        t = t.to(self.segments[0].device if self.segments else "cpu")
        self.comm.all_reduce_control(t, op="max")
        bits = t.tolist()
        if bits[-1]:
            raise RuntimeError(
                "requires_grad of a parameter changed after zerodp.initialize "
                f"({changed or 'on another rank'}); freezing or unfreezing after initialize is "
                "not supported: set requires_grad before zerodp.initialize and re-initialize"
            )
        out, k = [], 0
        for seg in self.reducer.used:
            out.append([bool(b) for b in bits[k : k + len(seg)]])
            k += len(seg)
        return out

    def _requires_grad_changed(self) -> str:
        for seg in self.segments:
            for name, p in zip(seg.names, seg.params, strict=True):
                if not p.requires_grad:
                    return f"'{name}' was frozen"
        for name, p in self.frozen:
            if p.requires_grad:
                return f"'{name}' was unfrozen"
        return ""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_gradients()
        self.optimizer.step()
        self.publish_params()
        self.steps += 1
        self.comm.ledger.end_step()
        return loss

    def publish_params(self) -> None:
        """Make every rank's full parameters equal the owners' updated slices (stages 1-2: one
        all-gather per bucket). Also what a checkpoint load calls after writing the owned slices."""
        if not self.plan.gather_params or self.comm.world_size == 1:
            return
        handles = []
        with torch.no_grad():
            for seg in self.segments:
                lay = seg.layout
                for b, bucket in enumerate(lay.buckets):
                    full = flat_view(seg.param_buffer, bucket)
                    owned = flat_view(seg.param_buffer, lay.bucket_shard(b, self.comm.rank))
                    handles.append(self.comm.all_gather(full, owned, async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        self.reducer.zero_grad()
        for op in self.pieces:
            op.tensor.grad = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.finish_gradients()
        grads = [op.tensor.grad for op in self.pieces if op.tensor.grad is not None]
        device = self.segments[0].device if self.segments else torch.device("cpu")
        return clip_grad_norm(
            grads,
            max_norm,
            norm_type,
            self.comm,
            sharded=self.plan.shard_optimizer,
            device=device,
        )

    # -- introspection -------------------------------------------------------------------------

    def comm_stats(self) -> CommStats | None:
        """Collective traffic of the last completed step."""
        return self.comm.ledger.last_step

    @property
    def num_trainable(self) -> int:
        return sum(s.numel for s in self.segments)

    def remove(self) -> None:
        self.reducer.remove_hooks()
        for h in self._hooks:
            h.remove()


def _unique_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters`` already yields a tied parameter once, under its first name."""
    return list(model.named_parameters())
