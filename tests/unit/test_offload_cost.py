"""The offload cost model: bytes per tier to the byte, step times to hand-computed values, the
search, and the H100_BOX predictions the issue targets (predictions of this model, not
measurements). The command and the measurements: test_cli_estimate_offload.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from zerodp.memory import (
    CALIBRATION_SHAPE,
    CALIBRATION_STEP_S,
    H100_BOX,
    GiB,
    Machine,
    Placement,
    Workload,
    cheapest_fit,
    device_step_bytes,
    gpt3_shape,
    gpt_largest_unit_params,
    largest_fit,
    model_state_bytes,
    pipeline,
    predict,
    predict_step,
    smallest_fraction,
    tier_bytes,
)

BUCKET = 32 * 2**20  # ZeroConfig's default bucket_bytes: 16,777,216 bf16 elements
RINGS_WORLD_1 = 2 * 4 * 4 * 16_777_216  # two rings x 4 slots x fp32 x one bucket
FSDP2_OFFLOAD_1_3B_S = 0.612  # measured on the H100 box (FSDP2 CPUOffloadPolicy)


def _round_machine(**overrides: float) -> Machine:
    """Round rates so that every predicted time below is computed by hand."""
    values: dict[str, Any] = {
        "name": "round",
        "device_bytes": 100e9,
        "device_reserve_bytes": 0.0,
        "host_bytes": 1000e9,
        "host_reserve_bytes": 0.0,
        "nvme_bytes": None,
        "pcie_bytes_per_s": 1e9,
        "host_memcpy_bytes_per_s": 2e9,
        "cpu_adam_params_per_s": 1e9,
        "disk_read_bytes_per_s": 0.5e9,
        "disk_write_bytes_per_s": 1e9,
        "device_peak_flops": 1e12,
        "mfu": 1.0,
        "device_memory_bytes_per_s": 1e12,
    }
    values.update(overrides)
    return Machine(**values)


# 1e9 bf16 parameters, 1000 tokens: forward 2 s, backward 4 s at 1e12 FLOP/s; buckets of
# 1e8 elements (10 of them); every copy of the 2e9 gradient or parameter bytes takes 2 s at
# 1 GB/s, each upcast or downcast 1e9 x (2 + 4) / (2 x 2e9) = 1.5 s, CPU Adam 1 s.
ROUND = Workload(num_params=1e9, tokens=1000, bucket_bytes=200_000_000)


# -- bytes per tier ------------------------------------------------------------------------------


def test_cpu_offload_world_1_host_is_16_bytes_per_param_plus_rings() -> None:
    b = tier_bytes(Workload(num_params=1e9, tokens=4096), Placement(optimizer="cpu"))
    assert b.host.as_dict() == {
        "optimizer state": 12e9,  # fp32 masters + exp_avg + exp_avg_sq
        "gradients": 4e9,  # the built path's full fp32 copy of the owned gradient
        "transfer rings": RINGS_WORLD_1,
    }
    assert b.host.total == 16e9 + 536_870_912
    assert b.device.as_dict() == {
        "parameters": 2e9,
        "gradients": 2e9,
        "step scratch": 4 * 16_777_216,  # fp32, one bucket's owned slice
        "gradient staging": 2 * 4 * 16_777_216,  # two fp32 buckets (stage 2)
    }
    assert b.nvme.total == 0.0


def test_cpu_offload_world_4_shards_the_host_and_the_rings() -> None:
    w = Workload(num_params=1e9, tokens=4096, world_size=4)
    b = tier_bytes(w, Placement(optimizer="cpu", stage=2))
    assert b.host.as_dict() == {
        "optimizer state": 3e9,
        "gradients": 1e9,
        "transfer rings": 2 * 4 * 4 * 4_194_304,
    }
    assert b.device.get("parameters") == 2e9
    assert b.device.get("gradients") == 0.5e9


def test_nvme_optimizer_keeps_slots_on_the_host_and_the_state_on_disk() -> None:
    b = tier_bytes(Workload(num_params=1e9, tokens=4096), Placement(optimizer="nvme"))
    assert b.nvme.as_dict() == {"optimizer state": 12e9}
    assert b.host.as_dict() == {
        "transfer rings": RINGS_WORLD_1,
        "gradient ring": 4 * 4 * 16_777_216,  # gradients stay on the device, pulled per bucket
        "nvme swap slots": 4 * 12 * 16_777_216,  # (masters + 2 moments) x fp32 x 4 slots
    }


def test_gradients_on_nvme_leave_nothing_on_the_device_but_units() -> None:
    w = Workload(num_params=1e9, tokens=4096)
    p = Placement(optimizer="nvme", params="nvme", gradients="nvme", stage=3)
    b = tier_bytes(w, p)
    assert b.nvme.as_dict() == {"optimizer state": 12e9, "parameters": 2e9, "gradients": 2e9}
    assert b.device.get("gradients") == b.device.get("parameters") == 0.0
    assert b.host.get("gradient spill slots") == 4 * 2 * 16_777_216  # 4 slots of one bucket
    assert b.host.get("gradient ring") == 4 * 4 * 16_777_216  # the step's fp32 unpack ring
    assert p.label() == "optimizer=nvme params=nvme grads=nvme s3"


def test_built_offloaded_params_keep_the_gradient_shards_on_the_device() -> None:
    """As built (``gradients="device"``), the reduced shards wait on the device for the step."""
    w = Workload(num_params=1e9, tokens=4096, world_size=2)
    for optimizer in ("cpu", "nvme"):
        b = tier_bytes(w, Placement(optimizer=optimizer, params="cpu", stage=3))
        assert b.device.get("gradients") == 2 * 0.5e9
        assert b.host.get("gradients") == (4 * 0.5e9 if optimizer == "cpu" else 0.0)


def test_params_and_part_of_the_optimizer_offloaded() -> None:
    """Partial offload at stage 3 keeps whole units, state and shards, on the device."""
    shape = gpt3_shape("1.3B")
    w = Workload.gpt(shape)
    psi, unit = w.num_params, float(gpt_largest_unit_params(shape))
    b = tier_bytes(w, Placement(optimizer="cpu", params="cpu", optimizer_fraction=0.25, stage=3))
    assert b.host.get("parameters") == 2 * 0.25 * psi
    assert b.host.get("optimizer state") == 12 * 0.25 * psi
    assert b.host.get("gradients") == 4 * 0.25 * psi  # fp32, of the offloaded part
    assert b.host.get("parameter staging") == 2 * unit * 2
    assert b.device.get("parameters") == 2 * 0.75 * psi
    assert b.device.get("gradients") == 2 * psi  # every reduced shard, until the step
    assert b.device.get("optimizer state") == 12 * 0.75 * psi
    assert b.device.get("gathered units") == 2 * unit * 2
    assert b.device.get("unit gradients") == unit * 2


@pytest.mark.parametrize(
    "placement",
    [
        Placement(),
        Placement(optimizer="cpu", optimizer_fraction=0.4),
        Placement(optimizer="nvme", stage=1),
        Placement(optimizer="cpu", params="cpu", optimizer_fraction=0.7, stage=3),
        Placement(optimizer="nvme", params="nvme", stage=3),
        Placement(optimizer="nvme", params="nvme", gradients="nvme", stage=3),
        Placement(optimizer="cpu", gradients="nvme", stage=3),
    ],
    ids=lambda p: p.label(),
)
def test_exact_adam_is_16_bytes_per_param_across_tiers(placement: Placement) -> None:
    # Parameters, gradients, masters and moments wherever they rest: 2 + 2 + 12 per parameter,
    # besides the offloaded step's fp32 host gradient (whole by default on the cpu tier).
    w = Workload(num_params=3e9, tokens=4096)
    b = tier_bytes(w, placement)
    states = ("parameters", "gradients", "optimizer state")
    total = sum(tier.get(name) for tier in (b.device, b.nvme) for name in states)
    total += b.host.get("parameters") + b.host.get("optimizer state")
    assert total == pytest.approx(16 * 3e9, rel=1e-12)
    whole = placement.host_gradient == "fp32"
    assert b.host.get("gradients") == (4 * placement.offloaded * 3e9 if whole else 0.0)


@pytest.mark.parametrize(("fraction", "how"), [(1.0, "auto"), (0.5, "auto"), (0.5, "ring")])
def test_the_host_gradient_is_fp32_of_the_offloaded_part_or_a_ring(
    fraction: float, how: str
) -> None:
    w = Workload(num_params=3e9, tokens=4096)
    p = Placement(optimizer="cpu", optimizer_fraction=fraction, host_gradients=how)
    b = tier_bytes(w, p)
    states = ("parameters", "gradients", "optimizer state")
    ring = how == "ring"
    assert b.host.get("gradients") == (0.0 if ring else 4 * fraction * 3e9)
    assert b.host.get("gradient ring") == (4 * 4 * 16_777_216 if ring else 0.0)
    assert sum(t.get(n) for t in (b.device, b.host) for n in states) == pytest.approx(
        (16 + (0 if ring else 4 * fraction)) * 3e9, rel=1e-12
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_offload_device_states_are_the_estimators(stage: int) -> None:
    w = Workload(num_params=7.5e9, tokens=4096, world_size=64)
    b = tier_bytes(w, Placement(stage=stage))
    paper = model_state_bytes(
        7.5e9, 64, stage, param_bytes=2, grad_bytes=2, optimizer_bytes_per_param=12
    )
    assert b.device.get("parameters") == paper.parameters
    assert b.device.get("gradients") == paper.gradients
    assert b.device.get("optimizer state") == paper.optimizer_state
    assert b.host.total == b.nvme.total == 0.0


def test_placement_rules() -> None:
    with pytest.raises(ValueError, match="stage 3"):
        Placement(params="cpu", stage=2)
    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        Placement(optimizer="cpu", stage=0)
    with pytest.raises(ValueError, match="needs an offloaded optimizer"):
        Placement(optimizer_fraction=0.5)
    with pytest.raises(ValueError, match="host_gradients needs an offloaded optimizer"):
        Placement(host_gradients="ring")
    with pytest.raises(ValueError, match=r"host_gradients must be one of auto, full, ring"):
        Placement(optimizer="cpu", host_gradients="half")
    with pytest.raises(ValueError, match=r"need the whole optimizer offloaded \(fraction 1\)"):
        Placement(optimizer="cpu", gradients="nvme", optimizer_fraction=0.5, stage=3)
    with pytest.raises(ValueError, match="gradients on NVMe need stage 3"):
        Placement(optimizer="cpu", gradients="nvme", stage=2)
    with pytest.raises(ValueError, match="and an offloaded optimizer"):
        Placement(gradients="nvme", stage=3)
    with pytest.raises(ValueError, match=r"Placement\.gradients must be one of device, nvme"):
        Placement(optimizer="cpu", gradients="cpu", stage=3)
    with pytest.raises(ValueError, match="offloaded parameters need an offloaded optimizer"):
        Placement(params="cpu", stage=3)  # refused by initialize too


# -- step time -----------------------------------------------------------------------------------


def test_pipeline_is_the_slowest_stage_plus_one_item_of_the_others() -> None:
    assert pipeline([("a", 2.0), ("b", 1.5), ("c", 0.0)], 10) == (2.0 + 1.5 / 10, "a")
    assert pipeline([("a", 2.0), ("b", 3.0)], 0.5) == (5.0, "b")  # one item: the sum
    assert pipeline([], 4) == (0.0, "compute")


def test_device_step_bytes() -> None:
    assert device_step_bytes(12, 2, mixed=True) == 40  # bf16 Adam
    assert device_step_bytes(8, 4, mixed=False) == 28  # fp32 Adam: params are the masters


def _path(w: Workload, p: Placement, m: Machine) -> list[tuple[str, str, float]]:
    t = predict_step(w, p, m)
    return [(s.label, s.resource, round(s.seconds, 9)) for s in t.path]


def test_no_offload_is_compute_then_device_step() -> None:
    t = predict_step(ROUND, Placement(), _round_machine())
    assert t.seconds == pytest.approx(4 + 0.04 + 2)  # 1e9 x 40 B at 1e12 B/s
    assert t.bottleneck == "compute"


def test_compute_bound_offload() -> None:
    # step() waits for every gradient on the host: d2h 2 s (+ one bucket's upcast, 0.15 s);
    # then the forward (2 s), while the host's chain, 2.5 + (2 + 1.5 + 2) / 10 + 0.2 = 3.25 s,
    # is shorter.
    m = _round_machine()
    assert _path(ROUND, Placement(optimizer="cpu"), m) == [
        ("backward", "compute", 4.0),
        ("gradients to host", "pcie d2h", 2.15),
        ("forward", "compute", 2.0),
    ]
    t = predict_step(ROUND, Placement(optimizer="cpu"), m)
    assert t.seconds == pytest.approx(8.15)
    assert t.bottleneck == "compute"
    assert dict(t.components) == pytest.approx(
        {
            "compute": 6.0,
            "device step": 0.0,
            "cpu adam": 1.0,
            "host memcpy": 3.0,
            "pcie d2h": 2.0,
            "pcie h2d": 2.0,
            "disk read": 0.0,
            "disk write": 0.0,
        }
    )


def test_cpu_adam_bound_offload() -> None:
    # Adam 5 s, plus one bucket of the other stages (d2h 2, upcast 1.5, cast 1.5 on a worker
    # of its own, h2d 2) and of the forward.
    m = _round_machine(cpu_adam_params_per_s=0.2e9)
    assert _path(ROUND, Placement(optimizer="cpu"), m) == [
        ("backward", "compute", 4.0),
        ("offloaded step", "cpu adam", 5 + (2 + 1.5 + 1.5 + 2) / 10 + 0.2),
    ]
    assert predict_step(ROUND, Placement(optimizer="cpu"), m).bottleneck == "cpu adam"


def test_pcie_bound_offload() -> None:
    m = _round_machine(pcie_bytes_per_s=0.2e9)  # each copy 10 s
    t = predict_step(ROUND, Placement(optimizer="cpu"), m)
    assert t.seconds == pytest.approx(4 + 10.15 + 2)
    assert t.bottleneck == "pcie d2h"


def test_disk_bound_offload() -> None:
    # Read 12 B/param at 0.5 GB/s (24 s) and write them at 1 GB/s (12 s), one drive.
    t = predict_step(ROUND, Placement(optimizer="nvme"), _round_machine())
    assert t.seconds == pytest.approx(4 + 36 + (2 + 1.5 + 2.5 + 2) / 10 + 0.2)
    assert t.bottleneck == "disk"
    assert t.component("disk read") == 24.0 and t.component("disk write") == 12.0


def test_gradients_on_nvme_are_written_in_the_backward_and_read_by_the_step() -> None:
    # Parameters, optimizer state and gradients on NVMe, 10 units (one per bucket). Backward:
    # per unit the disk reads the shard (4 s) and writes the reduced gradient (2 s), the
    # slowest stage: 6 + (h2d 2 + compute 4 + d2h 2) / 10 = 6.8 s. The step: the disk reads
    # 12 B/param (24 s) and the gradients (4 s), writes 12 B/param (12 s) and the shards (2 s),
    # and reads the shards for the forward (4 s): 46 s on one drive.
    p = Placement(optimizer="nvme", params="nvme", gradients="nvme", stage=3)
    t = predict_step(ROUND, p, _round_machine())
    assert _path(ROUND, p, _round_machine()) == [
        ("backward", "disk", 6.8),
        ("offloaded step", "disk", 46.0),
    ]
    assert t.component("disk read") == 24 + 2 * 4 + 4 and t.component("disk write") == 16.0
    # Without: the gradients wait on the device (6 s less disk, 2 s of d2h in the step).
    shards = predict_step(
        ROUND, Placement(optimizer="nvme", params="nvme", stage=3), _round_machine()
    )
    assert shards.seconds == pytest.approx(4.6 + 42.0)


def test_partial_offload_steps_part_on_the_device() -> None:
    # Half on the device (0.02 s) first; then the device waits for the offloaded half's
    # gradients on the host (d2h 1 s, upcast 0.75 s over 5 buckets: 1.15 s) and runs the
    # forward (2 s), longer than the host's half: 0.02 + 1 + (0.5 + 0.75 + 0.75 + 1) / 5 + 0.2.
    p = Placement(optimizer="cpu", optimizer_fraction=0.5)
    assert _path(ROUND, p, _round_machine()) == [
        ("backward", "compute", 4.0),
        ("device step", "device step", 0.02),
        ("gradients to host", "pcie d2h", 1.15),
        ("forward", "compute", 2.0),
    ]


def test_a_host_gradient_ring_holds_the_forward_back() -> None:
    # step() returns when all but the last 4 of 10 chunks are stepped: the host's chain,
    # Adam 2.5 s + (2 + 1.5 + 1.5 + 2) / 10 = 3.2 s, less 4 chunks of Adam (1 s); then the
    # forward (2 s), longer than the last chunks and the tail. With the whole host gradient
    # step() returns after the d2h copies instead (2 + 1.5 / 10 s): 0.05 s sooner here.
    m = _round_machine(cpu_adam_params_per_s=0.4e9)
    p = Placement(optimizer="cpu", host_gradients="ring")
    assert _path(ROUND, p, m) == [
        ("backward", "compute", 4.0),
        ("offloaded step to its last chunks", "cpu adam", 2.2),
        ("forward", "compute", 2.0),
    ]
    assert _path(ROUND, Placement(optimizer="cpu"), m) == [
        ("backward", "compute", 4.0),
        ("gradients to host", "pcie d2h", 2.15),
        ("forward", "compute", 2.0),
    ]


def test_offloaded_params_pipeline_units_through_pcie() -> None:
    # As built: 10 units (no shape: one per bucket); backward: h2d 2, compute 4 -> 4 + 0.2 (the
    # reduced gradients stay on the device until the step); then the device's track: every
    # gradient to the host (d2h 2, upcast 1.5 -> 2 + 0.15) and the forward (h2d 2, compute 2
    # -> 2.2): 4.35 s, longer than the host's (CPU Adam and cast 2.5 + (2 + 1.5) / 10).
    p = Placement(optimizer="cpu", params="cpu", stage=3)
    assert _path(ROUND, p, _round_machine()) == [
        ("backward", "compute", 4.2),
        ("gradients to host", "pcie d2h", 2.15),
        ("forward", "pcie h2d", 2.2),
    ]


# -- the H100 box: calibration and the targets, as predictions of this model -----------


def test_calibration_reproduces_the_measured_1_3b_step() -> None:
    w = Workload.gpt(CALIBRATION_SHAPE)
    assert predict(w, Placement(), H100_BOX).time.seconds == pytest.approx(CALIBRATION_STEP_S)
    assert 0.3 < H100_BOX.mfu < 0.6


def test_predicted_1_3b_cpu_offload_on_h100() -> None:
    w = Workload.gpt(gpt3_shape("1.3B"))
    pr = predict(w, Placement(optimizer="cpu"), H100_BOX)
    assert pr.fits
    # Host: exactly 16 B/param of model states plus the fixed rings (0.42 B/param at 1.3B).
    assert pr.bytes.host.total - pr.bytes.host.get("transfer rings") == 16 * w.num_params
    assert pr.bytes.host.get("transfer rings") == RINGS_WORLD_1
    # 48 ms backward + 232 ms CPU Adam (the cast on a worker of its own) + one bucket of the
    # other stages and of the forward: 0.283 s, CPU-Adam bound, 2.2x faster than FSDP2's
    # offload measured on that box.
    assert pr.time.seconds == pytest.approx(0.2826, abs=1e-4)
    assert pr.time.bottleneck == "cpu adam"
    assert FSDP2_OFFLOAD_1_3B_S / pr.time.seconds > 2.1


def test_target_1_3b_cpu_offload_at_most_0_30_s() -> None:
    """The issue's target, as this model predicts it (not measured: no GPU here)."""
    w = Workload.gpt(gpt3_shape("1.3B"))
    assert predict(w, Placement(optimizer="cpu"), H100_BOX).time.seconds <= 0.30


def test_predicted_13b_fits_one_h100_box_without_nvme() -> None:
    w = Workload.gpt(gpt3_shape("13B"))
    assert not predict(w, Placement(), H100_BOX).fits
    assert not predict(w, Placement(optimizer="cpu"), H100_BOX).fits  # host: 190 GiB
    best = cheapest_fit(w, H100_BOX)  # exact fp32 Adam; NVMe not allowed
    assert best is not None
    # 17% of the optimizer state on the device, the host gradient a ring (whole, the host
    # would need 4 B more per offloaded parameter: 39 GiB), the model's own checkpointing.
    assert best.placement == Placement(
        optimizer="cpu",
        optimizer_fraction=0.83,
        stage=2,
        checkpointing=True,
        host_gradients="ring",
    )
    assert best.bytes.nvme.total == 0.0
    assert best.bytes.device.total <= H100_BOX.device_usable_bytes
    assert best.bytes.host.total <= H100_BOX.host_usable_bytes
    assert not predict(w, replace(best.placement, host_gradients="full"), H100_BOX).fits_host
    assert best.time.seconds == pytest.approx(2.903, abs=1e-3)


def test_predicted_largest_gpt_on_h100_without_nvme() -> None:
    largest = largest_fit(H100_BOX)
    assert largest is not None and largest.workload.shape is not None
    assert (largest.workload.shape.layers, largest.workload.shape.hidden) == (40, 5120)


def test_smallest_fraction_is_the_first_that_fits() -> None:
    w = Workload.gpt(gpt3_shape("6.7B"))
    p = Placement(optimizer="cpu")
    f = smallest_fraction(w, p, H100_BOX)
    assert f == 0.55
    room = H100_BOX.device_usable_bytes
    assert tier_bytes(w, Placement(optimizer="cpu", optimizer_fraction=f)).device.total <= room
    below = Placement(optimizer="cpu", optimizer_fraction=f - 0.01)
    assert tier_bytes(w, below).device.total > room


def test_gib_constant() -> None:
    assert GiB == 2**30
