"""One small adapter per system: the same training step, and what each rank holds, for all.

Every adapter wraps a freshly built model (same seed on every rank) and a ``torch.optim.AdamW``
over its parameters, the way that system's documentation says to, and exposes the four phases
the runner times (``zero_grad``, ``forward``, ``backward``, ``step``), the torch optimizer that
does the update inside ``step`` (timed apart), the bytes it holds by category, and the full
parameters at the end (for the parity check against DDP).

Mixed precision (``--precision bf16``) is each system's own recipe: zerodp
``ZeroConfig(precision="bf16")`` (bf16 parameters, fp32 masters, fp32 reduction); DDP and
ZeroRedundancyOptimizer ``torch.autocast`` over fp32 parameters (what PyTorch documents for
DDP); FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; DeepSpeed its
``bf16`` section.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from zerodp import MemoryReport
from zerodp.apps.bench.options import BenchOptions
from zerodp.apps.bench.probe import optimizer_state_tensors, tensor_bytes
from zerodp.apps.bench.systems import BY_NAME


class Unavailable(Exception):
    """This configuration cannot run here; ``status`` is "not installed" or "not available"."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this rank sits (what the adapters need of it)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


class Peer:
    """The plain-PyTorch step; subclasses override what their system does differently."""

    def __init__(self, module: nn.Module, model: nn.Module, opt: Any, autocast: bool) -> None:
        self.module = module  # the user's model: parameter names as the user knows them
        self.model = model  # what forward runs on (a wrapper, or the module itself)
        self.opt = opt
        self._autocast = autocast
        # What the bench's meter measures ([Note: memory meters]): the rank's device (``build``
        # sets it; a system may move parameters elsewhere, e.g. to host memory).
        self.device_type = "cpu"

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast_context(x.device):
            _, loss = self.model(x, y)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.opt.step()

    def memory(self) -> dict[str, int | None]:
        """Bytes held by category, counted from the tensors themselves (see ``probe``)."""
        seen: set[tuple[str, int]] = set()
        params = list(self.module.parameters())
        return {
            "parameters": tensor_bytes(params, seen, self.device_type),
            "gradients": tensor_bytes((p.grad for p in params), seen, self.device_type),
            "optimizer_state": tensor_bytes(
                optimizer_state_tensors(self.inner_optimizer()), seen, self.device_type
            ),
            "buffers": None,
        }

    def comm(self) -> dict[str, Any] | None:
        """Measured traffic of the last step; only zerodp measures its own."""
        return None

    def nvme_io(self) -> dict[str, int] | None:
        """Bytes read from and written to NVMe files so far (zerodp's "nvme" tiers)."""
        return None

    def offload_timing(self) -> dict[str, float] | None:
        """zerodp's offloaded step: the last complete step's seconds per host stage."""
        return None

    def full_params(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters on CPU, by name. A collective for sharded systems: every rank
        calls it."""
        return {n: p.detach().float().cpu().clone() for n, p in self.module.named_parameters()}

    def settle(self) -> None:
        """Wait for communication a step leaves in flight (before a profiler stops)."""

    def close(self) -> None:
        pass

    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that updates the parameters: its state is the optimizer state,
        its ``step`` the update (``runner`` times it apart from the rest of ``step``)."""
        return self.opt

    def _autocast_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)


def measured_categories(report: MemoryReport, device_type: str) -> dict[str, int]:
    """Model states by category as the bench's meter sees them. On CPU, RSS measures host
    memory too: offloaded parameter shards count as parameters, the host's fp32 gradient as
    gradients, the offloaded optimizer state as such. On a GPU only what stays on the device:
    the persistent parameters, the device gradients, the optimizer state not offloaded."""
    if device_type == "cpu":
        return {
            "parameters": report.parameters + report.host_parameters,
            "gradients": report.gradients + report.host_gradients,
            "optimizer_state": report.optimizer_state,
        }
    state = report.optimizer_state if report.offload == "none" else report.optimizer_on_device
    return {
        "parameters": report.parameters,
        "gradients": report.gradients,
        "optimizer_state": state,
    }


def ddp_bucket_bytes(ddp: Any) -> int | None:
    """Bytes of DDP's gradient buckets, from its logging data (private API: best effort)."""
    try:
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        return sum(int(s) for s in str(sizes).split(",") if s.strip())
    except Exception:
        return None


class DDPPeer(Peer):
    """``DistributedDataParallel``, optionally with ``ZeroRedundancyOptimizer``."""

    def memory(self) -> dict[str, int | None]:
        out = super().memory()
        out["buffers"] = ddp_bucket_bytes(self.model)
        return out

    def inner_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.opt, "optim", self.opt)  # ZeroRedundancyOptimizer: its local shard


class ZerodpPeer(Peer):
    """``zerodp.initialize``: the model is modified in place and is its own wrapper."""

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def memory(self) -> dict[str, int | None]:
        r = self.opt.memory_report()
        return {
            **measured_categories(r, self.device_type),
            "buffers": r.comm_buffers,
            "zerodp_report": r.to_dict(),
        }

    def comm(self) -> dict[str, Any] | None:
        stats = self.opt.comm_stats()
        return None if stats is None else stats.to_dict()

    def nvme_io(self) -> dict[str, int] | None:
        io: dict[str, int] = self.opt.nvme_io()
        return io if any(io.values()) else None

    def offload_timing(self) -> dict[str, float] | None:
        timing: dict[str, float] | None = self.opt.offload_timing()
        return timing

    def full_params(self) -> dict[str, torch.Tensor]:
        import zerodp

        with zerodp.full_parameters(self.module, writeback=False):
            return super().full_params()

    def inner_optimizer(self) -> torch.optim.Optimizer:
        return self.opt.inner  # the user's AdamW over this rank's pieces

    def settle(self) -> None:
        # A profiler must not stop while a gloo thread reports an allocation to it: stages 1-2
        # leave the parameter all-gather in flight after step (zerodp.memory.alloc_trace).
        self.opt.wait_params()

    def close(self) -> None:
        self.opt.close()


class FSDP2Peer(Peer):
    """``fully_shard`` per transformer block, then the root: parameters are DTensors whose
    local shards this rank holds. Gather/reduce buffers live only within a step (none at rest),
    so ``buffers`` is not reported."""

    def full_params(self) -> dict[str, torch.Tensor]:
        # Parameters are DTensors here (typed as Parameter): full_tensor() all-gathers one.
        params = self.module.named_parameters()
        return {n: cast(Any, p).full_tensor().detach().float().cpu() for n, p in params}


def _adamw(params: Any, options: BenchOptions) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **adamw_kwargs(options))


def adamw_kwargs(options: BenchOptions) -> dict[str, Any]:
    """The optimizer every system gets. ``fused`` left unset (torch's default: the for-loop
    kernel on CPU) unless ``--fused-adamw``; zerodp switches unset groups to the fused kernel
    itself (``zerodp.optim.pieces.select_fused``)."""
    out: dict[str, Any] = {"lr": options.lr, "weight_decay": options.weight_decay}
    if options.fused_adamw:
        out["fused"] = True
    return out


def _units(module: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (what FSDP2 wraps one by one)."""
    from zerodp.apps.models.gpt import Block

    return [m for m in module.modules() if isinstance(m, Block)]


def _build_ddp(module: nn.Module, info: RankInfo, options: BenchOptions) -> Peer:
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.device.index] if info.device.type == "cuda" else None
    ddp = DistributedDataParallel(module, device_ids=ids, bucket_cap_mb=options.bucket_mb)
    return DDPPeer(module, ddp, _adamw(module.parameters(), options), options.precision == "bf16")


def _build_plain(module: nn.Module, info: RankInfo, options: BenchOptions) -> Peer:
    if info.world_size != 1:  # raised on every rank, before any collective
        raise Unavailable("not available", "plain training has no data parallelism: world size 1")
    return Peer(module, module, _adamw(module.parameters(), options), options.precision == "bf16")


def _build_zro(module: nn.Module, info: RankInfo, options: BenchOptions) -> Peer:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.device.index] if info.device.type == "cuda" else None
    ddp = DistributedDataParallel(module, device_ids=ids, bucket_cap_mb=options.bucket_mb)
    opt = ZeroRedundancyOptimizer(
        module.parameters(), optimizer_class=torch.optim.AdamW, **adamw_kwargs(options)
    )
    return DDPPeer(module, ddp, opt, options.precision == "bf16")


def _build_zerodp(
    stage: int, offload: str = "none", params: str = "none", gradients: str = "device"
) -> Callable[[nn.Module, RankInfo, BenchOptions], Peer]:
    def build(module: nn.Module, info: RankInfo, options: BenchOptions) -> Peer:
        import zerodp

        nvme = "nvme" in (offload, params, gradients)
        tiers = zerodp.OffloadConfig(
            optimizer=offload,
            params=params,
            gradients=gradients,
            path=options.offload_dir if nvme else None,
            ring_buckets=options.ring_buckets,
        )
        config = zerodp.ZeroConfig(
            stage=stage,
            precision=options.precision,
            bucket_bytes=options.bucket_bytes,
            offload=tiers,
        )
        model, opt = zerodp.initialize(module, _adamw(module.parameters(), options), config)
        return ZerodpPeer(module, model, opt, autocast=False)

    return build


def _build_fsdp2(reshard: bool) -> Callable[[nn.Module, RankInfo, BenchOptions], Peer]:
    def build(module: nn.Module, info: RankInfo, options: BenchOptions) -> Peer:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(info.device.type, (info.world_size,))
        mp = MixedPrecisionPolicy()
        if options.precision == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in _units(module):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        # The optimizer after sharding, as FSDP2 requires: it must hold the DTensor parameters.
        return FSDP2Peer(module, module, _adamw(module.parameters(), options), autocast=False)

    return build


def _build_deepspeed(stage: int) -> Callable[[nn.Module, RankInfo, BenchOptions], Peer]:
    def build(module: nn.Module, info: RankInfo, options: BenchOptions) -> Peer:
        from zerodp.apps.bench.deepspeed_peer import build_deepspeed

        return build_deepspeed(stage, module, _adamw(module.parameters(), options), options)

    return build


BUILDERS: dict[str, Callable[[nn.Module, RankInfo, BenchOptions], Peer]] = {
    "ddp": _build_ddp,
    "plain": _build_plain,
    "zro": _build_zro,
    **{f"zero{s}": _build_zerodp(s) for s in range(4)},
    **{f"zero{s}-offload": _build_zerodp(s, "cpu") for s in (2, 3)},
    "zero3-infinity": _build_zerodp(3, "nvme", "nvme", "nvme"),
    "fsdp2": _build_fsdp2(True),
    "fsdp2-noreshard": _build_fsdp2(False),
    **{f"deepspeed{s}": _build_deepspeed(s) for s in (1, 2, 3)},
}

_MODULES = {
    "zerodp": ("zerodp",),
    "torch": ("torch.nn.parallel", "torch.distributed.optim", "torch.distributed.fsdp"),
    "deepspeed": ("deepspeed",),
}


def missing_dependency(name: str) -> str | None:
    """Why ``name`` cannot be imported here (checked without importing it), or ``None``."""
    if BY_NAME[name].family != "deepspeed":
        return None
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "`import deepspeed` fails (an optional extra: pip install deepspeed)"
    return None


def import_for(name: str) -> None:
    """Import the system's modules now, so that their memory is part of the baseline RSS that
    the runner measures before building the model, not of the configuration's peak."""
    for module_name in _MODULES[BY_NAME[name].family]:
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            raise Unavailable("not installed", f"import {module_name}: {exc}") from exc


def build(name: str, module: nn.Module, info: RankInfo, options: BenchOptions) -> Peer:
    """Wrap ``module`` (already on ``info.device``) for configuration ``name``; with
    ``activation_checkpointing`` its blocks are checkpointed first, alike for every system."""
    if options.activation_checkpointing:
        import zerodp

        for block in _units(module):
            zerodp.checkpoint_wrapper(block)
    peer = BUILDERS[name](module, info, options)
    peer.device_type = info.device.type
    return peer


@contextlib.contextmanager
def closing(peer: Peer) -> Iterator[Peer]:
    try:
        yield peer
    finally:
        peer.close()
