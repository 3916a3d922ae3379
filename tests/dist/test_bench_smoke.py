"""`zerodp bench` end to end: one short run on the tiny preset, real ranks, real launches.

The command starts its own ranks (one launch of torch's elastic launcher per configuration), so
it runs here as a subprocess: a fresh interpreter whose exit status, table and JSON are checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CONFIGS = ["ddp", "plain", "zero2", "zero3", "fsdp2"]
TIMEOUT_S = 120  # ~10 s on 2 idle cores; generous for a loaded machine


def _bench(cwd: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``zerodp bench ARGS`` in a fresh interpreter; fails the test unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "zerodp.apps.cli.main", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_bench_tiny_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--preset", "tiny", "--world-size", "2", "--steps", "2", "--warmup", "1"]
    args += ["--batch", "2", "--threads", "1", "--configs", ",".join(CONFIGS), "--json", str(out)]
    proc = _bench(tmp_path, [*args, "--profile-steps", "1"])
    assert "| config | system | median ms |" in proc.stdout
    assert "Top operators by median self CPU ms per step" in proc.stdout

    report = json.loads(out.read_text())
    meta = report["meta"]
    assert meta["world_size"] == 2 and meta["preset"] == "tiny" and meta["backend"] == "gloo"
    assert list(report["configs"]) == CONFIGS
    plain = report["configs"]["plain"]  # no data parallelism: one device only
    assert plain["status"] == "not available", plain
    assert plain["reason"] == "plain training has no data parallelism: world size 1", plain
    for name, c in report["configs"].items():
        if name == "plain":
            continue
        assert c["status"] == "ok", (name, c.get("reason"))
        assert c["step_time_s"]["n"] == 2 and c["step_time_s"]["median"] > 0, name
        phases = c["phases_median_s"]
        assert set(phases) >= {"forward", "backward", "step", "optimizer", "total"}, name
        assert 0 < phases["optimizer"] < phases["step"], (name, phases)  # the update, in step
        assert any(op["name"] == "aten::mm" for op in c["profile_rank0"]), name
        mem = c["memory_bytes"]
        assert mem["parameters"] > 0 and mem["optimizer_state"] > 0, (name, mem)
        assert c["rss_bytes"]["peak_steps"] >= c["rss_bytes"]["baseline"] > 0, name
        assert c["parity_vs_ddp"]["passed"], (name, c["parity_vs_ddp"])
        assert c["ratio_to_ddp"] > 0, name
    ddp, zero2 = report["configs"]["ddp"], report["configs"]["zero2"]
    assert ddp["parity_vs_ddp"]["max_abs_diff"] == 0  # DDP's ranks against its rank 0
    assert abs(zero2["comm"]["measured_psi"] - 2.0) < 0.01  # reduce-scatter + all-gather
    assert set(zero2["comm"]["measured"]["calls"]) == {"reduce_scatter", "all_gather"}
    # stage 2 shards gradients and optimizer state, DDP holds them whole
    assert zero2["memory_bytes"]["optimizer_state"] < ddp["memory_bytes"]["optimizer_state"]


def test_bench_plain_one_rank(tmp_path: Path) -> None:
    """At world size 1 the unwrapped model is the baseline, and every system matches it."""
    out = tmp_path / "bench.json"
    args = ["--preset", "tiny", "--world-size", "1", "--steps", "1", "--warmup", "1"]
    args += ["--batch", "2", "--threads", "1", "--configs", "ddp,plain,zero2", "--json", str(out)]
    _bench(tmp_path, args)
    configs = json.loads(out.read_text())["configs"]
    assert configs["plain"]["status"] == "ok", configs["plain"]
    # The same arithmetic as DDP over one rank (same AdamW kernel): identical parameters.
    assert configs["plain"]["parity_vs_ddp"]["max_abs_diff"] == 0
    assert configs["zero2"]["parity_vs_ddp"]["passed"]


def test_bench_infinity_is_built_sharded_and_trains_as_stage_3(tmp_path: Path) -> None:
    """``zero3-infinity`` builds its model with ``zerodp.sharded_init()`` (never whole in
    memory) and still starts from the values every other system gets from the seed: its
    losses are bitwise stage 3's, and its parameters DDP's within the fp32 tolerance. It reads
    and writes its files every step and measures the disk in the same run."""
    out = tmp_path / "bench.json"
    args = ["--preset", "tiny", "--world-size", "1", "--steps", "2", "--warmup", "1"]
    args += ["--batch", "2", "--threads", "1", "--configs", "ddp,zero3,zero3-infinity"]
    args += ["--offload-dir", str(tmp_path / "nvme"), "--json", str(out)]
    proc = _bench(tmp_path, args)
    configs = json.loads(out.read_text())["configs"]
    infinity, stage3 = configs["zero3-infinity"], configs["zero3"]
    assert infinity["status"] == "ok", infinity.get("reason")
    assert infinity["losses_rank0"] == stage3["losses_rank0"]
    assert infinity["parity_vs_ddp"]["passed"], infinity["parity_vs_ddp"]
    assert infinity["memory_bytes"]["parameters"] == 0  # every shard in the file
    per_step = infinity["nvme"]["per_step"]
    assert per_step["read_bytes"] > 0 and per_step["written_bytes"] > 0, per_step
    assert infinity["nvme"]["disk"]["disk_read_bytes_per_s"] > 0
    assert "NVMe traffic per timed step" in proc.stdout


def test_only_infinity_builds_on_the_meta_device() -> None:
    import torch

    from zerodp.apps.bench.runner import _construct
    from zerodp.apps.models.gpt import get_config

    cpu = torch.device("cpu")
    for name, device in (("zero3-infinity", "meta"), ("zero3", "cpu"), ("fsdp2", "cpu")):
        model = _construct(name, get_config("tiny"), cpu)
        assert {p.device.type for p in model.parameters()} == {device}, name


def test_bench_activation_checkpointing_keeps_less_for_backward(tmp_path: Path) -> None:
    """``--activation-checkpointing``: every system's blocks checkpointed alike; the same losses
    as without, and autograd keeps less from each forward (the blocks keep their inputs)."""
    saved, losses = {}, {}
    for flag in ([], ["--activation-checkpointing"]):
        out = tmp_path / f"bench{len(flag)}.json"
        args = ["--preset", "tiny", "--world-size", "1", "--steps", "1", "--warmup", "1"]
        args += ["--batch", "2", "--threads", "1", "--configs", "ddp,zero3", "--json", str(out)]
        proc = _bench(tmp_path, [*args, *flag])
        assert ("every block activation-checkpointed" in proc.stdout) == bool(flag)
        report = json.loads(out.read_text())
        assert report["meta"]["activation_checkpointing"] == bool(flag)
        for name, c in report["configs"].items():
            assert c["status"] == "ok" and c["parity_vs_ddp"]["passed"], (name, c)
            saved[name, bool(flag)] = c["rss_bytes"]["saved_for_backward"]
            losses[name, bool(flag)] = c["losses_rank0"]
    for name in ("ddp", "zero3"):
        assert losses[name, True] == losses[name, False], name
        assert 0 < saved[name, True] < saved[name, False] / 2, (name, saved)
