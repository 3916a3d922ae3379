"""Bytes held per rank and elements communicated per step, against the paper (issue 2).

fp32 AdamW with Ψ trainable parameters on N ranks must hold
stage 0: 4Ψ + 4Ψ + 8Ψ, stage 1: 4Ψ + 4Ψ + 8Ψ/N, stage 2: 4Ψ + 4Ψ/N + 8Ψ/N,
up to padding and the configured bucket buffers, and stages 1-2 must move exactly what stage
0's all-reduce moves: reduce-scatter Ψ + all-gather Ψ against 2Ψ.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zerotest import build

import zerodp

TIMEOUT = 120.0
BUCKET_BYTES = 4096  # 1024 fp32 elements


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(61, 67)  # 4154 elements: many buckets, cut mid-parameter
        self.b = nn.Linear(67, 3)
        self.c = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def case_accounting(stage: int, precision: str = "fp32") -> dict:
    model = build(Wide)
    cfg = zerodp.ZeroConfig(stage=stage, bucket_bytes=BUCKET_BYTES, precision=precision)
    model, opt = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    for _ in range(2):
        x = torch.randn(4, 61)
        opt.backward(F.mse_loss(model(x).float(), torch.zeros(4, 1)))
        opt.step()
        opt.zero_grad()
    report = opt.memory_report()
    stats = opt.comm_stats()
    assert stats is not None
    eng = opt.engine
    owned = sum(op.piece.param_range.numel for op in eng.pieces)
    return {
        "report": report.to_dict(),
        "elements": stats.elements,
        "volume": stats.volume,
        "owned": owned,
        "pieces": len(eng.pieces),
        "buckets": sum(len(s.layout.buckets) for s in eng.segments),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_and_traffic_match_theory(world, world_size, stage):
    out = world(world_size).run(case_accounting, stage, timeout=TIMEOUT)
    psi = 61 * 67 + 67 + 67 * 3 + 3 + 3 + 1
    n = world_size
    for o in out:
        r = o["report"]
        padded = r["padded_numel"]
        assert r["num_params"] == psi
        # Padding: each parameter starts 16-byte aligned, the segment ends on N*4 elements.
        assert psi <= padded < psi + 6 * 3 + 4 * n
        shard = padded // n
        # Exact bytes from the layout ...
        assert r["parameters"] == 4 * padded
        assert r["gradients"] == 4 * (padded if stage < 2 else shard)
        assert r["optimizer_state"] == 8 * o["owned"] + 4 * o["pieces"]  # exp_avg/sq + step
        assert r["optimizer_scalar_bytes"] == 4 * o["pieces"]
        # Stage 2: two staging buckets, each with the (N-1)/N its point-to-point reduce-scatter
        # receives into (gloo on CPU); buckets are rounded down to a multiple of N x 4
        # elements so every rank's slice stays 16-byte aligned.
        bucket = (BUCKET_BYTES // 4) // (4 * n) * (4 * n)
        expected_buffers = 0 if stage < 2 else 2 * 4 * (bucket + bucket // n * (n - 1))
        assert expected_buffers <= 4 * BUCKET_BYTES
        assert r["comm_buffers"] == expected_buffers
        # ... and the paper's formula up to padding and the step scalars.
        theory = r["theory"]
        assert theory["parameters"] == 4 * psi
        assert theory["gradients"] == (4 * psi if stage < 2 else 4 * psi / n)
        assert theory["optimizer_state"] == (8 * psi if stage == 0 else 8 * psi / n)
        pad_bytes = 16 * (padded - psi)  # at most 4+4+8 bytes per padding element
        measured = r["model_states"] - r["optimizer_scalar_bytes"]
        theory_total = theory["parameters"] + theory["gradients"] + theory["optimizer_state"]
        assert abs(measured - theory_total) <= pad_bytes, (measured, theory_total)
        # Traffic: exact element counts per step.
        if n == 1:
            assert o["elements"] == {} and o["volume"] == 0  # one rank: no collective at all
            continue
        if stage == 0:
            assert o["elements"] == {"all_reduce": padded}
        else:
            assert o["elements"] == {"reduce_scatter": padded, "all_gather": padded}
        assert o["volume"] == 2 * padded
    if stage > 0:
        assert sum(o["owned"] for o in out) == psi  # the shards partition Ψ exactly


def case_bf16_accounting(stage: int) -> dict:
    return case_accounting(stage, "bf16")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_mixed_precision_memory_matches_paper(world, world_size, stage):
    """bf16 AdamW: stage 0 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N (paper, K = 12)."""
    out = world(world_size).run(case_bf16_accounting, stage, timeout=TIMEOUT)
    psi = 61 * 67 + 67 + 67 * 3 + 3 + 3 + 1
    n = world_size
    for o in out:
        r = o["report"]
        padded = r["padded_numel"]
        shard = padded // n
        assert r["precision"] == "bf16"
        assert r["parameters"] == 2 * padded
        assert r["gradients"] == 2 * (padded if stage < 2 else shard)
        masters = 4 * (padded if stage == 0 else shard)
        assert r["master_parameters"] == masters
        assert r["optimizer_state"] == masters + 8 * o["owned"] + 4 * o["pieces"]
        # Reduction in fp32 through two staging buckets (bucket_bytes of bf16 = 2048 elements),
        # reduce-scattered (stages 1-2) point to point: each with a receive buffer of (N-1)/N.
        bucket = (BUCKET_BYTES // 2) // (8 * n) * (8 * n)
        received = 0 if stage == 0 else bucket // n * (n - 1)
        # The step's fp32 gradient scratch: one bucket (stage 0) or its owned slice.
        assert r["step_transient"] == 4 * min(padded, bucket) // (1 if stage == 0 else n)
        assert r["comm_buffers"] == 2 * 4 * (bucket + received)
        paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n}[stage]
        theory = r["theory"]
        assert theory["parameters"] + theory["gradients"] + theory["optimizer_state"] == paper
        measured = r["model_states"] - r["optimizer_scalar_bytes"]
        assert abs(measured - paper) <= 16 * (padded - psi), (measured, paper)
