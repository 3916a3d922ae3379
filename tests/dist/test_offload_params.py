"""Parameter offload at stage 3 (``ZeroConfig.offload.params="cpu"|"nvme"``, issue 15,
ZeRO-Infinity): exact, bounded, private files, read ahead, everything outside the step.

Parity: the shards only rest elsewhere between gathers; every gather copies the same values back
and every step computes the same updates with the same kernels ([Note: offloaded parameters] in
zerodp/offload/home.py), so parameters and optimizer state must be **bitwise** those of the
stage-3 run without any offload.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from offloadtest import (
    TIMEOUT,
    clipped_step,
    compare,
    differing,
    full_params,
    offload_config,
    state_values,
    tiny_gpt,
    train,
)

import zerodp
from zerodp.offload.chunks import chunk_numel
from zerodp.offload.swapfile import ALIGN, SwapFile, aligned

# (optimizer tier, parameter tier, stage 3's persist_numel): 64 keeps the tiny GPT's LayerNorm
# parameters replicated on the device beside the offloaded unit shards.
COMBOS = (("cpu", "cpu", 0), ("cpu", "nvme", 64), ("nvme", "cpu", 64), ("nvme", "nvme", 0))


def _config(precision: str, optimizer: str, params: str, root: str, persist: int = 0, **extra):  # type: ignore[no-untyped-def]
    path = root if "nvme" in (optimizer, params) else None
    return offload_config(
        3, precision, optimizer, persist, params=params, path=path, ring_buckets=2, **extra
    )


def case_parity(root: str, kind: str, precisions: tuple[str, ...]) -> list[str]:
    differ = []
    for precision in precisions:
        for optimizer, params, persist in COMBOS:
            want = offload_config(3, precision, "none", persist)
            got = _config(precision, optimizer, params, root, persist)
            wrong, report = compare(kind, want, got)
            assert report.params_offload == params, "the parameters were not offloaded"
            if wrong:
                differ.append(f"{optimizer}/{params} {precision}: {wrong}")
    return differ


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(("kind", "precisions"), [("gpt", ("fp32", "bf16")), ("llama", ("fp32",))])
def test_bitwise_parity_with_stage_3_on_the_device(world, tmp_path, world_size, kind, precisions):
    """Every combination of tiers, clipping, accumulation and a scheduler (``train``), two
    ring slots: the read-ahead and the step's writes reuse slots within a step."""
    results = world(world_size).run(case_parity, str(tmp_path), kind, precisions, timeout=TIMEOUT)
    assert results == [[]] * world_size


# -- where the bytes are --------------------------------------------------------------------------


def case_bytes(root: str, params: str) -> dict:
    model = tiny_gpt()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    path = root if params == "nvme" else None
    config = offload_config(3, "bf16", "cpu", 64, params=params, path=path, ring_buckets=3)
    model, opt = zerodp.initialize(model, inner, config)
    clipped_step(model, opt, 0)
    clipped_step(model, opt, 1)
    report = opt.memory_report().to_dict()
    sharded = opt.engine.params
    home = sharded.home
    unit_segs = [s for u in sharded.units for s in u.segments]
    out = {
        "report": report,
        "shard_bytes": [s.shard_numel_bytes for s in unit_segs],
        "held": [s.shard.numel() for s in unit_segs],
        "devices": {s.shard.device.type for s in unit_segs},
        "persistent": sharded.persistent_bytes(),
        "listed": os.listdir(root) if os.path.isdir(root) else [],
        "largest_chunk": max(c.numel for c in opt.engine.runner.chunks),
        "chunk": chunk_numel(opt.engine.plan.bucket_bytes),
    }
    if params == "nvme":
        out["mode"] = home.file.mode
        out["size"] = os.fstat(home.file.fd).st_size
        out["hits"] = (home.hits, home.misses)
    opt.close()
    return out


def test_host_parameters_are_the_shards(world, tmp_path):
    """ "cpu": the unit shards are host tensors, counted as ``host_parameters``, not on the
    device, whose ``parameters`` are the persistent ones only."""
    for r in world(2).run(case_bytes, str(tmp_path), "cpu", timeout=TIMEOUT):
        rep = r["report"]
        assert r["devices"] == {"cpu"} and min(r["held"]) > 0
        assert rep["params_offload"] == "cpu"
        assert rep["host_parameters"] == sum(r["shard_bytes"])
        assert rep["parameters"] == r["persistent"] > 0
        assert rep["nvme"] == 0
        host = rep["optimizer_state"] + rep["host_gradients"] + rep["host_buffers"]
        assert rep["host"] == host + rep["host_parameters"]
        assert rep["device"] + rep["host"] - rep["host_buffers"] - rep["host_gradients"] == (
            rep["model_states"]
            + rep["comm_buffers"]
            + rep["step_transient"]
            + rep["gathered_cached"]
        )


def test_nvme_parameters_are_one_private_file(world, tmp_path):
    """ "nvme": one file per rank, 0600, unlinked at creation, each shard at a 4 KiB-aligned
    extent; no shard in memory between gathers; host memory adds the read ring (3 aligned
    slots of a chunk) and the outgoing ring becomes aligned. Gathers in the second step found
    parts read ahead."""
    for r in world(2).run(case_bytes, str(tmp_path), "nvme", timeout=TIMEOUT):
        rep = r["report"]
        extent = sum(aligned(n) for n in r["shard_bytes"])
        assert r["listed"] == [] and r["mode"] == 0o600
        assert r["size"] == extent == rep["nvme"] and extent % ALIGN == 0
        assert set(r["held"]) == {0} and rep["host_parameters"] == 0
        assert rep["parameters"] == r["persistent"] > 0
        # Read in parts of a chunk of fp32 ([Note: offload chunks]): the units are larger.
        slot = 4 * r["chunk"]
        assert slot < aligned(max(r["shard_bytes"]))
        largest = r["largest_chunk"]
        transfer = 3 * 4 * largest + 3 * aligned(4 * largest)  # in, and out (aligned: O_DIRECT)
        assert rep["host_buffers"] == transfer + 3 * slot
        hits, misses = r["hits"]
        assert hits > 0, (hits, misses)


# -- everything outside the step ------------------------------------------------------------------


def _run(optimizer: str, params: str, root: str | None):  # type: ignore[no-untyped-def]
    model = tiny_gpt()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if optimizer == "none":
        return zerodp.initialize(model, inner, offload_config(3, "bf16", "none", 64))
    assert root is not None
    return zerodp.initialize(model, inner, _config("bf16", optimizer, params, root, 64))


def _edit_and_step(model, opt, step: int) -> None:  # type: ignore[no-untyped-def]
    with zerodp.full_parameters(model, writeback=True), torch.no_grad():
        model.blocks[0].mlp.c_fc.weight.mul_(0.5)  # a unit shard, written back
    clipped_step(model, opt, step)


def case_outside_the_step(root: str, optimizer: str, params: str) -> list[str]:
    """A run without offload saves after 2 steps; the offloaded run loads it, edits a unit
    parameter through ``full_parameters(writeback=True)``, steps, saves; the run without
    offload does the same: equal, ``state_dict`` included. The offloaded run's checkpoint loads
    into a run without offload; ``load_state_dict`` into another offloaded run."""
    problems = []
    ref_model, ref = _run("none", "none", None)
    for step in range(2):
        clipped_step(ref_model, ref, step)
    zerodp.save_checkpoint(f"{root}/a", ref_model, ref)
    off_model, off = _run(optimizer, params, f"{root}/nvme")
    zerodp.load_checkpoint(f"{root}/a", off_model, off)
    for model, opt in ((ref_model, ref), (off_model, off)):
        _edit_and_step(model, opt, 2)
    want, got = full_params(ref_model), full_params(off_model)
    if differing(want, got) or not _same(state_values(ref), state_values(off)):
        problems.append("load + edit + step differs from the run without offload")
    sd_want, sd_got = ref_model.state_dict(), off_model.state_dict()
    if differing(sd_want, sd_got):
        problems.append(f"state_dict differs: {differing(sd_want, sd_got)[:3]}")
    zerodp.save_checkpoint(f"{root}/b", off_model, off)
    back_model, back = _run("none", "none", None)
    zerodp.load_checkpoint(f"{root}/b", back_model, back)
    if differing(got, full_params(back_model)):
        problems.append("the offloaded run's checkpoint loads different parameters")
    other_model, other = _run(optimizer, params, f"{root}/nvme")
    other_model.load_state_dict(sd_got)
    if differing(got, full_params(other_model)):
        problems.append("model.load_state_dict differs")
    clipped_step(other_model, other, 3)  # the loaded shards are where the next gather reads
    for opt in (ref, off, back, other):
        opt.close()
    return problems


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("optimizer", "params"), [("nvme", "nvme"), ("cpu", "cpu")])
def test_checkpoints_state_dict_and_edits(world, tmp_path, optimizer, params):
    results = world(2).run(case_outside_the_step, str(tmp_path), optimizer, params)
    assert results == [[], []]


# -- ordering, with a slow disk ------------------------------------------------------------------


def case_slow_disk(root: str) -> list[str]:
    """Every read and write of the files takes 20 ms longer: the reads ahead and the step's
    writes are still in flight when the gathers that need them come, which must wait."""
    read, write = SwapFile.read, SwapFile.write

    def slow_read(self, offset, buf):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        read(self, offset, buf)

    def slow_write(self, offset, buf):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        write(self, offset, buf)

    SwapFile.read, SwapFile.write = slow_read, slow_write  # type: ignore[method-assign]
    try:
        want, want_state, _ = train("gpt", offload_config(3, "bf16", "none"))
        got, got_state, _ = train("gpt", _config("bf16", "nvme", "nvme", root))
    finally:
        SwapFile.read, SwapFile.write = read, write  # type: ignore[method-assign]
    problems = differing(want, got)
    if not _same(want_state, got_state):
        problems.append("optimizer state")
    return problems


def test_gathers_wait_for_slow_reads_and_writes(world, tmp_path):
    assert world(1).run(case_slow_disk, str(tmp_path), timeout=TIMEOUT) == [[]]
