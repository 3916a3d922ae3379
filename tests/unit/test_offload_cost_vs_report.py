"""The cost model's built tier against a real offloaded run: the bytes ``tier_bytes`` predicts
for ``optimizer="cpu"`` are the bytes ``opt.memory_report()`` counts (2 gloo ranks, tiny GPT),
given the stored element count (the layout pads each segment to whole buckets)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from offloadtest import TIMEOUT, model_loss, tiny_gpt
from zerotest import rank_world

import zerodp
from zerodp.memory import Placement, Workload, tier_bytes

BUCKET_BYTES = 4096
WORLD = 2


def case_report(stage: int, precision: str) -> dict[str, Any]:
    rank, world = rank_world()
    config = zerodp.ZeroConfig(
        stage=stage,
        precision=precision,
        bucket_bytes=BUCKET_BYTES,
        offload=zerodp.OffloadConfig(optimizer="cpu"),
    )
    model = tiny_gpt()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zerodp.initialize(model, inner, config)
    opt.backward(model_loss("gpt", model, 0, rank, world))
    opt.step()
    report: dict[str, Any] = opt.memory_report().to_dict()
    opt.close()
    return report


@pytest.mark.parametrize(("stage", "precision"), [(1, "fp32"), (2, "bf16")])
def test_built_tier_is_the_memory_report(world: Any, stage: int, precision: str) -> None:
    for r in world(WORLD).run(case_report, stage, precision, timeout=TIMEOUT):
        w = Workload(
            num_params=r["padded_numel"],
            tokens=1,
            precision=precision,
            world_size=WORLD,
            bucket_bytes=BUCKET_BYTES,
        )
        b = tier_bytes(w, Placement(optimizer="cpu", stage=stage))
        assert b.host.get("optimizer state") == r["optimizer_state"] - r["optimizer_scalar_bytes"]
        assert b.host.get("gradients") == r["host_gradients"]
        assert b.host.get("transfer rings") == r["host_buffers"]
        assert b.device.get("parameters") == r["parameters"]
        assert b.device.get("gradients") == r["gradients"]
        assert b.device.get("gradient staging") == r["comm_buffers"]
        assert b.device.get("step scratch") == r["step_transient"]
