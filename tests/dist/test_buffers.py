"""Constant-size buffers (ZeRO-R's C_B): communication buffers do not grow with the model.

The gradient staging pool (``grads/staging.py``: ``StagingPool``) holds ``count`` = 2 buffers,
each the size of the largest bucket, in the reduce dtype, and, where gradients are
reduce-scattered (stages 1-3) point to point (gloo on CPU, as here), the (N-1)/N of it that the
reduce-scatter receives into ([Note: point-to-point reduce-scatter] in comm/gloo_cpu.py).
A bucket is ``bucket_bytes`` of parameters in their stored (compute) dtype, rounded down to a
multiple of N x align elements (``partition/layout.py: build_layout``; align = 16 B), so for a
model larger than one bucket::

    comm_buffers = 2 x floor(bucket_bytes / e / (N * 16 / e)) x (N * 16 / e) x r x (2N - 1) / N

with ``e`` the compute dtype's and ``r`` the reduce dtype's element size (stage 0, which
all-reduces: without the last factor). The pool exists in
stage 2 (and stage 3), and in stages 0-1 only when gradients are reduced in another dtype than
they are stored in (bf16 with fp32 reduction); fp32 stages 0-1 reduce in place in the gradient
buffer and hold no communication buffer at all.

Each model below is a stack of 128 x 128 linear layers (every weight spans several buckets); the
"deep" one has twice the layers, the "wide" one layers of twice the elements (182 x 182): both
twice the parameters. Stage 3 reduce-scatters each unit in chunks of one bucket ([Note: stage-3
reduce chunks] in ``params/reduce.py``), so the same formula holds; before chunking its pool was
2 x the largest unit, constant in depth but not in width, which the "wide" model catches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodp

TIMEOUT = 120.0
WORLD = 2
BUCKET_BYTES = 8192  # fp32: 2048 elements (8 per weight); bf16: 4096 (4 per weight)
LAYERS, WIDTH = 4, 128
SHAPES = {"base": (LAYERS, WIDTH), "deep": (2 * LAYERS, WIDTH), "wide": (LAYERS, 182)}
ELSIZE = {"fp32": 4, "bf16": 2}
REDUCE_ELSIZE = 4  # ZeroConfig.reduce_dtype defaults to fp32
STAGING_COUNT = 2  # GradReducer / ShardedGrads: staging_buffers=2


class Stack(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def case_buffers(stage: int, precision: str, shape: str) -> dict[str, Any]:
    layers, width = SHAPES[shape]
    torch.manual_seed(0)
    model = Stack(layers, width)
    cfg = zerodp.ZeroConfig(stage=stage, precision=precision, bucket_bytes=BUCKET_BYTES)
    model, opt = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    x = torch.randn(2, width)
    opt.backward(F.mse_loss(model(x).float(), torch.zeros(2, width)))
    opt.step()
    opt.zero_grad()
    report = opt.memory_report()
    return {
        "report": report.to_dict(),
        "table": report.table(),
        "buckets": sum(len(s.layout.buckets) for s in opt.engine.segments),
    }


def expected_comm_buffers(stage: int, precision: str) -> int:
    e = ELSIZE[precision]
    if stage < 2 and e == REDUCE_ELSIZE:
        return 0  # reduced in place in the gradient buffer
    quantum = WORLD * (16 // e)  # N x alignment, in elements
    bucket_numel = (BUCKET_BYTES // e) // quantum * quantum
    received = 0 if stage == 0 else bucket_numel // WORLD * (WORLD - 1)
    return STAGING_COUNT * (bucket_numel + received) * REDUCE_ELSIZE


def expected_scratch(stage: int, precision: str) -> int:
    """The mixed-precision step's fp32 gradient scratch ([Note: chunked fp32 gradients] in
    ``optim/chunked.py``): one bucket (stage 0) or one bucket's owned slice, in fp32."""
    e = ELSIZE[precision]
    if e == 4:
        return 0  # fp32: the optimizer steps the reduced gradients in place
    quantum = WORLD * (16 // e)
    bucket_numel = (BUCKET_BYTES // e) // quantum * quantum
    return 4 * (bucket_numel if stage == 0 else bucket_numel // WORLD)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_buffers_do_not_grow_with_the_model(world, stage, precision):
    runs = {
        shape: world(WORLD).run(case_buffers, stage, precision, shape, timeout=TIMEOUT)
        for shape in SHAPES
    }
    expected = expected_comm_buffers(stage, precision)
    psi = {shape: out[0]["report"]["num_params"] for shape, out in runs.items()}
    assert psi["deep"] == 2 * psi["base"]
    assert 2 * psi["base"] <= psi["wide"] < 2.02 * psi["base"]
    for shape, out in runs.items():
        for rank, o in enumerate(out):
            r = o["report"]
            if stage < 3:
                # Every weight spans several buckets, so the largest bucket is a full one.
                assert o["buckets"] >= 4 * SHAPES[shape][0], (shape, o["buckets"])
            assert r["comm_buffers"] == expected, (shape, rank, r["comm_buffers"], expected)
            line = next(ln for ln in o["table"].splitlines() if "comm buffers" in ln)
            assert f"{expected:,} B" in line, line
            scratch = expected_scratch(stage, precision)
            if stage < 3:
                assert r["step_transient"] == scratch, (shape, rank, r["step_transient"], scratch)
            else:  # a unit is one bucket: the largest unit's shard (or a persistent bucket's)
                unit_shard = 4 * (r["largest_unit"] // ELSIZE[precision]) // WORLD
                assert r["step_transient"] in (unit_shard, scratch), (shape, r, unit_shard)
    if stage >= 2 or precision != "fp32":  # the bucket: bucket_bytes exactly (no rounding)
        staged = STAGING_COUNT * BUCKET_BYTES * REDUCE_ELSIZE // ELSIZE[precision]
        received = 0 if stage == 0 else staged // WORLD * (WORLD - 1)
        assert expected == staged + received


def test_default_bucket_is_32_mib():
    """The default suits gloo and NCCL alike (large enough to amortise a collective's latency,
    small enough to bound staging at 2 x 32 MiB x r/e whatever the model; on gloo CPU x (2N-1)/N
    with the receive buffers)."""
    assert zerodp.ZeroConfig().bucket_bytes == 32 * 2**20
