"""The DeepSpeed adapter (an optional extra: imported only when a ``deepspeed*`` row runs).

``deepspeed.initialize`` takes the model and our ``torch.optim.AdamW`` (a "client optimizer",
allowed with ``zero_allow_untested_optimizer``) and returns an engine that runs forward,
``engine.backward(loss)`` and ``engine.step()`` (which also zeroes the gradients, so the
``zero_grad`` phase is empty). Buckets are set to ``--bucket-mb`` and gradient clipping is
turned off (DeepSpeed's default clips to norm 1.0; no other system here clips); everything else
is DeepSpeed's default, which is what a user gets.

Memory: DeepSpeed keeps its partitions in attributes of its ZeRO optimizer, not in documented
places, so the bytes are found by walking those attributes (best effort, see ``_walk``) and
classified by where a storage is first seen: the model's parameters (stage 3: their partitions)
-> parameters; the wrapped optimizer's state and the fp32 partitions (master weights) ->
optimizer state; attributes named ``*grad*`` and ``.grad`` of those tensors -> gradients;
anything else the optimizer holds -> buffers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zerodp.apps.bench.options import BenchOptions
from zerodp.apps.bench.peers import Peer
from zerodp.apps.bench.probe import optimizer_state_tensors, tensor_bytes

_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


class DeepSpeedPeer(Peer):
    def __init__(
        self, module: nn.Module, engine: Any, stage: int, client: torch.optim.Optimizer
    ) -> None:
        super().__init__(module, engine, engine.optimizer, autocast=False)
        self.engine = engine
        self.stage = stage
        self.client = client  # our AdamW, which DeepSpeed's ZeRO optimizer steps

    def inner_optimizer(self) -> torch.optim.Optimizer:
        return self.client

    def zero_grad(self) -> None:
        pass  # engine.step() zeroes the gradients itself

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def memory(self) -> dict[str, int | None]:
        zero = self.engine.optimizer
        seen: set[tuple[str, int]] = set()
        params = list(self.engine.module.parameters())
        stored = [getattr(p, "ds_tensor", p) for p in params]  # stage 3: the partitions
        out: dict[str, int | None] = {"parameters": tensor_bytes(stored, seen, self.device_type)}
        masters = [t for a in _MASTER_ATTRS for t in _walk(getattr(zero, a, None))]
        grads = [p.grad for p in params] + [t.grad for t in masters]
        grads += [t for k, v in vars(zero).items() if "grad" in k.lower() for t in _walk(v)]
        out["gradients"] = tensor_bytes(grads, seen, self.device_type)
        inner = getattr(zero, "optimizer", None)
        state = optimizer_state_tensors(inner) if isinstance(inner, torch.optim.Optimizer) else []
        out["optimizer_state"] = tensor_bytes([*state, *masters], seen, self.device_type)
        out["buffers"] = tensor_bytes(
            (t for v in vars(zero).values() for t in _walk(v)), seen, self.device_type
        )
        return out

    def full_params(self) -> dict[str, torch.Tensor]:
        if self.stage < 3:
            return super().full_params()
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
            return super().full_params()


def _walk(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in ``value``: itself, or inside lists, tuples and dicts, 3 levels deep."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, list | tuple):
        for item in value:
            yield from _walk(item, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from _walk(item, depth + 1)


def ds_config(stage: int, options: BenchOptions) -> dict[str, Any]:
    """DeepSpeed's JSON config for this run: its defaults plus our batch, buckets, precision."""
    bucket_elements = options.bucket_bytes // 4  # DeepSpeed counts bucket sizes in elements
    return {
        "train_micro_batch_size_per_gpu": options.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 2**31 - 1,
        "zero_allow_untested_optimizer": True,
        # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise; no other
        # system here clips, so this would be a different training, not a different system.
        "gradient_clipping": 0.0,
        "bf16": {"enabled": options.precision == "bf16"},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket_elements,
            "allgather_bucket_size": bucket_elements,
        },
    }


def build_deepspeed(
    stage: int, module: nn.Module, opt: torch.optim.Optimizer, options: BenchOptions
) -> Peer:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=opt, config=ds_config(stage, options), dist_init_required=False
    )
    return DeepSpeedPeer(module, engine, stage, opt)
