"""``zerodp.initialize``: the one call that turns a model and optimizer into ZeRO training."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerodp.activations import (
    CheckpointOffload,
    CheckpointPartition,
    CheckpointStore,
    checkpoint_modules,
    checkpoint_wrapper,
)
from zerodp.comm import GroupLike
from zerodp.config import ZeroConfig
from zerodp.engine import ZeroEngine
from zerodp.module import attach, zero_class
from zerodp.optim.optimizer import ZeroOptimizer
from zerodp.params.manager import Stage3Options
from zerodp.params.nocompile import check_not_compiled
from zerodp.params.policy import UnitPolicy
from zerodp.snapshot import InitSnapshot
from zerodp.streams import make_streams
from zerodp.tensor_parallel import check_split_root, layout_of


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig | None = None,
    process_group: GroupLike = None,
    *,
    unit_policy: UnitPolicy | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
) -> tuple[nn.Module, ZeroOptimizer]:
    """Shard ``optimizer`` (and, by stage, gradients) of ``model`` across ``process_group``.

    The model is modified **in place** and returned: its parameters become views into flat
    buffers, its class gains ``no_sync()``, and rank 0's parameters and buffers are broadcast to
    every rank. The returned ``ZeroOptimizer`` replaces ``optimizer`` (which is rebound to this
    rank's shard; do not step it directly). Every rank must call this with the same config and
    the same model structure; otherwise every rank raises ``ValueError`` naming the difference.
    On any error the model, its class, its parameters and the optimizer are left exactly as
    they were ([Note: initialize is all or nothing] in ``zerodp/snapshot.py``).

    ``process_group`` is the data-parallel group (default: the whole world): a
    ``ProcessGroup``, or a 1-D ``DeviceMesh`` such as ``mesh["dp"]`` of a DP x TP mesh (a mesh
    of more dimensions is a ``ValueError``). Every zerodp collective runs on that group only;
    the other dimensions' collectives are the model's. Under tensor parallelism,
    ``clip_grad_norm_`` sees this TP rank's shards only ([Note: data-parallel sub-groups] in
    ``zerodp/comm/groups.py``), and each TP rank saves checkpoints to its own directory
    ([Note: one data-parallel group per root] in ``zerodp/checkpoint/save.py``).

    Stage 3 only: ``unit_policy(name, module) -> bool`` chooses the modules whose parameters are
    gathered together (default: ``ZeroConfig.stage3.unit_classes`` / the container-element
    policy, see ``zerodp/params/policy.py``). A model built under ``zerodp.sharded_init()`` (on the
    meta device) is materialised here unit by unit on ``device`` (default: cpu), initialised by
    ``init_fn(unit_module)`` (default: its ``init_weights()`` or ``reset_parameters()``).
    """
    if config is None:
        config = ZeroConfig()
    if not isinstance(config, ZeroConfig):
        raise TypeError(
            f"config must be a zerodp.ZeroConfig; got {type(config).__name__} "
            "(use ZeroConfig.from_dict / from_json for dicts and files)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer)}")
    if isinstance(optimizer, ZeroOptimizer) or getattr(model, "_zero_engine", None) is not None:
        raise ValueError("this model or optimizer is already managed by zerodp.initialize")
    if isinstance(model, torch._dynamo.OptimizedModule):
        raise TypeError(
            "zerodp.initialize takes the uncompiled module: call zerodp.initialize(model, ...) "
            "first, then model.compile() or torch.compile(model) (stages 0-2)"
        )
    if config.stage == 3:
        check_not_compiled(model)
    if config.stage != 3 and (unit_policy is not None or init_fn is not None or device is not None):
        raise ValueError("unit_policy, init_fn and device apply to ZeroConfig(stage=3) only")
    stage3 = Stage3Options(unit_policy, init_fn, torch.device(device) if device else None)
    zcls = zero_class(type(model))  # before any change: it may fail
    checkpointed = [
        model.get_submodule(n) for n in checkpoint_modules(model, config.activations.checkpoint)
    ]
    check_split_root(model)
    if config.activations.partition and layout_of(model) is None:
        raise ValueError(
            "ZeroConfig.activations.partition=True partitions checkpoints over the model's "
            "tensor-parallel group, and this model is not split: split it with "
            "zerodp.tensor_parallel.parallelize before zerodp.initialize"
        )
    snapshot = InitSnapshot.take(model, optimizer)
    try:  # [Note: initialize is all or nothing] in snapshot.py
        engine = ZeroEngine(model, optimizer, config, process_group, stage3)
        zopt = ZeroOptimizer(engine)
        attach(model, engine, zcls)
        offload = _checkpoint_offload(model, config)
        for module in checkpointed:  # last: nothing after it can fail
            checkpoint_wrapper(module, offload)
    except BaseException:
        snapshot.restore()
        raise
    return model, zopt


def _checkpoint_offload(model: nn.Module, config: ZeroConfig) -> CheckpointStore | None:
    """Where the inputs of the checkpointed modules wait: slices over the tensor-parallel group
    (``activations.partition``), or host memory (``activations.offload``), on the model's
    device (one store for every checkpointed module of the model, so that the backward brings
    each back one module ahead)."""
    activations = config.activations
    layout = layout_of(model)
    if activations.partition and layout is not None:
        return CheckpointPartition(layout.tp)
    if activations.offload == "none":
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return CheckpointOffload(make_streams(device), activations.on_device)
