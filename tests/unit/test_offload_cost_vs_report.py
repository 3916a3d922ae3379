"""The cost model against a real offloaded run: the bytes ``tier_bytes`` predicts for
``optimizer="cpu"`` (whole, partial, with a host gradient ring) are the bytes
``opt.memory_report()`` counts (2 gloo ranks, tiny GPT), given the stored element count (the
layout pads each segment to whole buckets) and, for partial offload, the fraction the run
really offloaded (whole parameters are kept)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from offloadtest import TIMEOUT, model_loss, tiny_gpt
from zerotest import rank_world

import zerodp
from zerodp.memory import Placement, Workload, tier_bytes

BUCKET_BYTES = 4096
WORLD = 2


def case_report(stage: int, precision: str, fraction: float, how: str) -> dict[str, Any]:
    rank, world = rank_world()
    offload = zerodp.OffloadConfig(optimizer="cpu", optimizer_fraction=fraction, host_gradients=how)
    config = zerodp.ZeroConfig(
        stage=stage, precision=precision, bucket_bytes=BUCKET_BYTES, offload=offload
    )
    model = tiny_gpt()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zerodp.initialize(model, inner, config)
    opt.backward(model_loss("gpt", model, 0, rank, world))
    opt.step()
    report: dict[str, Any] = opt.memory_report().to_dict()
    opt.close()
    return report


@pytest.mark.parametrize(
    ("stage", "precision", "fraction", "how"),
    [
        (1, "fp32", 1.0, "auto"),
        (2, "bf16", 1.0, "auto"),
        (2, "bf16", 0.6, "auto"),
        (2, "bf16", 1.0, "ring"),
    ],
)
def test_cpu_tier_is_the_memory_report(
    world: Any, stage: int, precision: str, fraction: float, how: str
) -> None:
    args = (case_report, stage, precision, fraction, how)
    for r in world(WORLD).run(*args, timeout=TIMEOUT):
        w = Workload(
            num_params=r["padded_numel"],
            tokens=1,
            precision=precision,
            world_size=WORLD,
            bucket_bytes=BUCKET_BYTES,
            receive_fraction=(WORLD - 1) / WORLD,  # gloo on CPU: point-to-point reduce-scatter
        )
        f = r["offload_fraction"]
        assert (f < 1.0) == (fraction < 1.0)
        p = Placement(optimizer="cpu", stage=stage, optimizer_fraction=f, host_gradients=how)
        b = tier_bytes(w, p)
        exact = partial(pytest.approx, rel=1e-12)  # f x elements, in floating point
        on_device = r["optimizer_on_device"]
        # Each piece's 4-byte step counter is counted with the state, on its own tier.
        steps = r["optimizer_scalar_bytes"]
        host_state = r["optimizer_state"] - on_device
        assert host_state - steps <= b.host.get("optimizer state") <= host_state
        assert on_device - steps <= b.device.get("optimizer state") <= on_device
        assert b.host.get("gradients") == exact(r["host_gradients"] if how != "ring" else 0)
        rings = b.host.get("transfer rings") + b.host.get("gradient ring")
        assert rings == r["host_buffers"] + (r["host_gradients"] if how == "ring" else 0)
        assert b.device.get("parameters") == r["parameters"]
        assert b.device.get("gradients") == r["gradients"]
        assert b.device.get("gradient staging") == r["comm_buffers"]
        assert b.device.get("step scratch") == r["step_transient"]
