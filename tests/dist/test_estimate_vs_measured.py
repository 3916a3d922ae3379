"""The estimator and the measured report come from the same formulas (issue 7): a real run's
bytes per category equal ``zerodp.memory`` estimates, up to padding and bucket rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_accounting import BUCKET_BYTES, Wide
from zerotest import build

import zerodp
from zerodp.memory import bytes_per_param, comm_buffer_bytes, model_state_bytes

TIMEOUT = 120.0


def case_measure(stage: int, precision: str) -> dict:
    model = build(Wide)
    cfg = zerodp.ZeroConfig(stage=stage, bucket_bytes=BUCKET_BYTES, precision=precision)
    model, opt = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    opt.backward(F.mse_loss(model(torch.randn(4, 61)).float(), torch.zeros(4, 1)))
    opt.step()
    return opt.memory_report().to_dict()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_real_run_matches_estimate(world, stage, precision):
    n = 2
    r = world(n).run(case_measure, stage, precision, timeout=TIMEOUT)[0]
    per = bytes_per_param(precision, "adamw")
    est = model_state_bytes(r["num_params"], n, stage, **per._asdict())
    padding = r["padded_numel"] - r["num_params"]
    for name in ("parameters", "gradients", "optimizer_state"):
        measured = r[name] - (r["optimizer_scalar_bytes"] if name == "optimizer_state" else 0)
        assert abs(measured - getattr(est, name)) <= 16 * padding, (name, measured, est)
    buffers = comm_buffer_bytes(stage, BUCKET_BYTES, param_bytes=per.param_bytes, reduce_bytes=4)
    # Buckets are rounded down to a multiple of N x 16 bytes of elements.
    assert buffers - 2 * 4 * n * 8 < r["comm_buffers"] <= buffers, (r["comm_buffers"], buffers)
    if stage < 2 and precision == "fp32":
        assert r["comm_buffers"] == buffers == 0
