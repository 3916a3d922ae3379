"""Gradient shards on NVMe (``ZeroConfig.offload.gradients="nvme"``, issue 15, ZeRO-Infinity):
exact, no gradient in memory, the file's bytes, the step's checks.

Each reduce-scatter's averaged run goes to a file as backward produces it and the offloaded
step reads it back chunk by chunk ([Note: gradients on NVMe] in zerodp/offload/grad_spill.py):
the same values through the same operations, so an unclipped run (accumulating over ``no_sync``
and over synchronised backwards) is **bitwise** the run that keeps the shards on the device;
clipping sums the norm by run instead of by parameter piece, so a clipped step is within fp32
rounding (normwise relative error ``TOL``; a bf16 parameter at most one rounding apart).
"""

from __future__ import annotations

import dataclasses

import hf_models
import pytest
import torch
from offloadtest import (
    TIMEOUT,
    compare,
    model_loss,
    offload_config,
    one_rounding,
    relative,
    tiny_gpt,
    train,
)
from zerotest import TOL, rank_world

import zerodp
from zerodp.offload.swapfile import ALIGN, aligned

TIERS = (("nvme", "nvme"), ("cpu", "none"))  # (optimizer, params)


def grads_config(precision: str, tiers: tuple[str, str], root: str, gradients: str, **extra):  # type: ignore[no-untyped-def]
    optimizer, params = tiers
    nvme = "nvme" in (optimizer, params, gradients)
    return offload_config(
        3,
        precision,
        optimizer,
        params=params,
        gradients=gradients,
        path=root if nvme else None,
        ring_buckets=2,
        **extra,
    )


def case_parity(root: str, kind: str, precisions: tuple[str, ...]) -> list[str]:
    problems = []
    for precision in precisions:
        for tiers in TIERS:
            device = grads_config(precision, tiers, root, "device")
            nvme = grads_config(precision, tiers, root, "nvme")
            what = f"{precision} {tiers}"
            for synced in (False, True):
                wrong, report = compare(kind, device, nvme, clip=False, synced=synced)
                if wrong:
                    problems.append(f"{what} unclipped synced={synced}: {wrong}")
                if report.gradients != 0:
                    problems.append(f"{what}: {report.gradients} gradient bytes in memory")
            # One clipped step: later steps would compound a last-bit difference chaotically.
            want, want_state, _ = train(kind, device, steps=1)
            got, got_state, _ = train(kind, nvme, steps=1)
            worst = max(relative(want[n], got[n]) for n in want)
            worst_state = max(relative(a, b) for a, b in zip(want_state, got_state, strict=True))
            rounded = all(one_rounding(want[n], got[n]) for n in want)
            exact_enough = worst <= TOL if precision == "fp32" else rounded
            # exp_avg_sq squares the gradient: twice the coefficient's relative difference.
            if not exact_enough or worst_state > 4 * TOL:
                problems.append(f"{what} clipped: params {worst:.2e}, state {worst_state:.2e}")
    return problems


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(("kind", "precisions"), [("gpt", ("fp32", "bf16")), ("llama", ("fp32",))])
def test_parity_with_the_shards_on_the_device(world, tmp_path, world_size, kind, precisions):
    """Both optimizer tiers (the gradient file is read by either offloaded step); two ring
    slots and 2 KiB buckets: many runs and chunks, each slot reused within a backward."""
    results = world(world_size).run(case_parity, str(tmp_path), kind, precisions, timeout=TIMEOUT)
    assert results == [[]] * world_size


# -- the file: its size, what one step writes and reads ------------------------------------------


def case_file_bytes(root: str) -> dict:
    rank, world = rank_world()
    model = hf_models.build("llama")
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = grads_config("bf16", ("nvme", "nvme"), root, "nvme")
    model, opt = zerodp.initialize(model, inner, config)
    engine = opt.engine
    spill = engine.param_sync.spill
    segments = engine.segments
    itemsize = {s.dtype.itemsize for s in segments}
    opt.backward(model_loss("llama", model, 0, rank, world))
    runs = [
        aligned(n * segments[i].dtype.itemsize)
        for i, plan in enumerate(engine.reducer._chunks)
        for _, _, n in plan
    ]
    opt.step()
    engine.wait_optimizer()
    chunks = [aligned(c.numel * segments[c.seg].dtype.itemsize) for c in engine.runner.chunks]
    report = opt.memory_report()
    home, store = engine.param_sync.home, engine.masters.store
    out = {
        "itemsize": itemsize,
        "file": spill.nvme_nbytes,
        "regions": sum(
            aligned(b.shard_numel * s.dtype.itemsize) for s in segments for b in s.layout.buckets
        ),
        "runs": (len(runs), sum(runs)),
        "written": spill.file.bytes_written,
        "read": spill.file.bytes_read,
        "chunks": sum(chunks),
        "run_starts": all(
            off % ALIGN == 0 for plan in engine.reducer._chunks for _, off, _ in plan
        ),
        "gradients": report.gradients,
        "where": report.gradients_offload,
        "table": [
            line.split()[0] + " " + line.split("MiB")[1].strip()
            for line in report.table().splitlines()[1:]
            if line.split()[0] in ("gradients", "nvme")
        ],
        "nvme": report.nvme,
        "tiers": store.nvme_nbytes + home.nvme_nbytes + spill.nvme_nbytes,
        "ring": spill.host_nbytes,
        "largest_run": max(runs),
    }
    opt.close()
    return out


def test_one_step_writes_every_run_once_and_reads_every_chunk_once(world, tmp_path):
    """World 2, bf16: the file holds each bucket's owned region (aligned); a backward and a step
    write each run's aligned extent once and read each chunk's once (an unclipped step reads
    nothing else); the report counts the file in ``nvme`` and no gradient in memory."""
    for got in world(2).run(case_file_bytes, str(tmp_path), timeout=TIMEOUT):
        assert got["itemsize"] == {2}
        assert got["file"] == got["regions"] > 0
        count, total = got["runs"]
        assert count >= 3 and got["written"] == total
        assert got["read"] == got["chunks"] > 0
        assert got["run_starts"]
        assert got["gradients"] == 0 and got["where"] == "nvme"
        assert got["table"] == [
            "gradients none in memory: the owned gradient shards are on NVMe",
            "nvme masters and optimizer state and parameter shards and gradient shards, files in "
            "offload.path",
        ]
        assert got["nvme"] == got["tiers"]
        assert got["ring"] == 2 * got["largest_run"]


# -- what the step must know before any update ---------------------------------------------------


def case_norms(root: str) -> list[str]:
    """The total norm ``clip_grad_norm_`` returns, device vs NVMe, for three norm types, twice
    per step (the second sees the first's clipping) and with a gradient accumulated over two
    synchronised backwards."""
    rank, world = rank_world()
    problems = []
    for norm_type in (2.0, 1.0, float("inf")):
        totals = []
        for gradients in ("device", "nvme"):
            model = hf_models.build("llama")
            inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
            config = grads_config("fp32", ("cpu", "none"), root, gradients)
            model, opt = zerodp.initialize(model, inner, config)
            seen = []
            for step in range(2):
                for micro in range(1 + step):
                    opt.backward(model_loss("llama", model, 10 * step + micro, rank, world))
                seen.append(float(opt.clip_grad_norm_(0.1, norm_type)))
                seen.append(float(opt.clip_grad_norm_(0.1, norm_type)))
                opt.step()
                opt.zero_grad()
            totals.append(seen)
            opt.close()
        device, nvme = totals
        for a, b in zip(device, nvme, strict=True):
            if abs(a - b) > TOL * abs(a):
                problems.append(f"norm {norm_type}: device {device} nvme {nvme}")
                break
        if not device[1] < device[0]:
            problems.append(f"norm {norm_type}: the second clip saw unclipped gradients {device}")
    return problems


def test_clip_norms_match_the_device(world, tmp_path):
    assert world(2).run(case_norms, str(tmp_path), timeout=TIMEOUT) == [[], []]


def _poison(model: torch.nn.Module, when: set[int], step: list[int]) -> None:
    """At the steps in ``when``, backward through the first block's output turns inf: the loss
    stays finite, only gradients are not."""

    def hook(module, args, out):  # type: ignore[no-untyped-def]
        if step[0] in when and torch.is_grad_enabled():
            out.register_hook(lambda g: g * float("inf"))

    first = next(m for m in model.modules() if type(m).__name__ == "Block")
    first.register_forward_hook(hook)


def case_nonfinite(root: str) -> list:
    """``nonfinite="skip"``: the same steps are skipped with the gradients on NVMe, and the
    parameters after are bitwise those of the device run (a poisoned step at 1; at 2 the
    gradients are finite again)."""
    rank, world = rank_world()
    results = []
    for gradients in ("device", "nvme"):
        model = tiny_gpt()
        step = [0]
        _poison(model, {1}, step)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
        config = grads_config("bf16", ("nvme", "nvme"), root, gradients)
        precision = zerodp.Precision(compute="bf16", nonfinite="skip")
        config = dataclasses.replace(config, precision=precision)
        model, opt = zerodp.initialize(model, inner, config)
        skipped = []
        for s in range(3):
            step[0] = s
            opt.backward(model_loss("gpt", model, s, rank, world))
            opt.step()
            skipped.append(opt.last_step.skipped)
            opt.zero_grad()
        with zerodp.full_parameters(model):
            params = [p.detach().clone() for p in model.parameters()]
        results.append((skipped, params))
        opt.close()
    (want_skips, want), (got_skips, got) = results
    return [want_skips, got_skips, all(torch.equal(a, b) for a, b in zip(want, got, strict=True))]


def test_a_nonfinite_gradient_skips_the_same_step(world, tmp_path):
    for want_skips, got_skips, same in world(2).run(case_nonfinite, str(tmp_path), timeout=TIMEOUT):
        assert want_skips == [False, True, False]
        assert got_skips == want_skips and same
