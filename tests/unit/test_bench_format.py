"""The pure table/JSON helpers of ``benchmarks/bench_stages.py`` (no ranks are launched)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_stages.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_stages", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_stages"] = module  # dataclass/annotation lookups need it registered
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_stages", None)


def _report(bench):
    times = {"ddp": [1.0, 2.0, 1.0, 1.0], "zero1": [0.9, 1.8, 1.0, 1.1]}
    phases = {
        "ddp": [{"forward": 0.3, "backward": 0.6, "total": 1.0}] * 4,
        "zero1": [{"forward": 0.3, "backward": 0.5, "wait": 0.05, "gather": 0.02, "total": 0.9}],
    }
    memory = {
        "ddp": {"parameters": 4 * 2**20, "gradients": 4 * 2**20, "model_states": 16 * 2**20},
        "zero1": {"parameters": 4 * 2**20, "optimizer_state": 4 * 2**20, "comm_buffers": 0},
    }
    parity = {"ddp": {"max_rel_diff": 0.0, "max_abs_diff": 0.0}, "zero1": None}
    return bench.build_report(
        meta={"preset": "tiny", "world_size": 2, "steps": 4},
        times=times,
        phases=phases,
        memory=memory,
        parity=parity,
        comm={"zero1": {"calls": {"all_gather": 4}, "bytes": {"all_gather": 3 * 2**20}}},
        profile={"ddp": [{"name": "aten::mm", "self_ms_per_step": 12.3, "calls_per_step": 4}]},
    )


def test_parse_configs(bench):
    assert bench.parse_configs("ddp, zero2,zero0") == ["ddp", "zero2", "zero0"]
    with pytest.raises(ValueError, match="unknown"):
        bench.parse_configs("ddp,zero3")
    with pytest.raises(ValueError, match="repeated"):
        bench.parse_configs("ddp,ddp")
    with pytest.raises(ValueError, match="empty"):
        bench.parse_configs(" , ")


def test_parse_args_defaults_and_validation(bench):
    args = bench.parse_args(["--steps", "3", "--configs", "zero1,ddp"])
    assert args.steps == 3 and args.config_list == ["zero1", "ddp"]
    assert args.world_size == 2 and args.preset == "bench25m" and args.batch == 4
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "0"])


def test_stage_of(bench):
    assert [bench.stage_of(c) for c in ("ddp", "zero0", "zero1", "zero2", "local")] == [
        None,
        0,
        1,
        2,
        None,
    ]


def test_round_order_rotates_every_position(bench):
    configs = ["a", "b", "c"]
    orders = [bench.round_order(configs, s) for s in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for pos in range(3):  # each configuration runs in each position once per cycle
        assert sorted(o[pos] for o in orders) == configs
    assert bench.round_order(configs, 4) == orders[1]


def test_percentile_and_summarize(bench):
    assert bench.percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert bench.percentile([5.0], 25) == 5.0
    assert bench.percentile([0.0, 10.0], 25) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        bench.percentile([], 50)
    s = bench.summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 100.0 and s["n"] == 5
    assert s["p25"] == 2.0 and s["p75"] == 4.0
    assert s["iqr_rel"] == pytest.approx(2.0 / 3.0)


def test_paired_ratios(bench):
    r = bench.paired_ratios({"ddp": [1.0, 2.0, 4.0], "z": [2.0, 2.0, 2.0]})
    assert r["ddp"]["median"] == 1.0
    assert r["z"]["median"] == 1.0 and r["z"]["p25"] == 0.75 and r["z"]["p75"] == 1.5
    assert bench.paired_ratios({"z": [1.0]}) == {}


def test_phase_medians_and_max_over_ranks(bench):
    ph = bench.phase_medians([{"forward": 1.0, "total": 2.0}, {"forward": 3.0, "total": 4.0}])
    assert ph == {"forward": 2.0, "total": 3.0}
    assert list(ph) == [p for p in bench.PHASES if p in ph]  # table order
    assert bench.phase_medians([]) == {}
    assert bench.max_over_ranks([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]


def test_build_report_is_json_and_has_ratios(bench):
    rep = _report(bench)
    json.dumps(rep)  # serialisable as is
    ddp, z1 = rep["configs"]["ddp"], rep["configs"]["zero1"]
    assert ddp["ratio_to_ddp"] == 1.0 and ddp["stage"] is None
    assert z1["stage"] == 1
    assert z1["step_time_s"]["median"] == pytest.approx(1.05)
    assert z1["ratio_to_ddp"] == pytest.approx(1.05 / 1.0)
    assert z1["paired_ratio_to_ddp"]["median"] == pytest.approx(0.95)
    assert z1["phases_median_s"]["wait"] == 0.05
    assert z1["comm_last_step"]["calls"] == {"all_gather": 4}
    assert z1["step_times_s"] == [0.9, 1.8, 1.0, 1.1]


def test_build_report_without_reference(bench):
    rep = bench.build_report(
        meta={}, times={"zero2": [1.0, 3.0]}, phases={}, memory={}, parity={"zero2": None}
    )
    c = rep["configs"]["zero2"]
    assert c["ratio_to_ddp"] is None and c["paired_ratio_to_ddp"] is None
    assert "| zero2 | 2000 | 1000 |" in bench.format_table(rep)


def test_format_table(bench):
    text = bench.format_table(_report(bench))
    lines = text.splitlines()
    assert lines[0].startswith("| config | median ms | min ms |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    ddp = next(line for line in lines if line.startswith("| ddp "))
    z1 = next(line for line in lines if line.startswith("| zero1 "))
    assert "| 1000 | 1000 |" in ddp and "| 1.000 |" in ddp and "| 4.0 | 4.0 |" in ddp
    assert "| 0 |" in ddp  # exact parity prints as 0
    assert "| 1050 | 900 |" in z1 and "| 1.050 |" in z1 and "n/a" in z1
    assert "0.950 (" in z1


def test_format_phase_and_profile_tables(bench):
    rep = _report(bench)
    phase = bench.format_phase_table(rep).splitlines()
    assert phase[0] == "| config | " + " | ".join(bench.PHASES) + " |"
    assert phase[2] == "| ddp | - | 300 | 600 | - | - | - | 1000 |"
    prof = bench.format_profile_table(rep["profile"])
    assert prof == "- **ddp** (ms/step): aten::mm 12"
    assert bench.format_profile_table({}) == ""


def test_format_comm_and_meta(bench):
    rep = _report(bench)
    assert bench.format_comm(rep) == "- zero1: all_gather 4x 3.0 MiB"
    meta = {"preset": "x", "loadavg_start": [1.5, 0, 0], "loadavg_end": [2.25, 0, 0]}
    assert bench.format_meta(meta) == "preset=x, loadavg 1.50->2.25"


def test_format_report_mentions_meta_and_tables(bench):
    text = bench.format_report(_report(bench))
    assert "preset=tiny, world_size=2, steps=4" in text
    assert "all_gather 4x" in text
    assert "| zero1 |" in text and "Median phase times" in text and "aten::mm" in text


def test_top_operators_uses_medians(bench):
    samples = [{"mm": 10.0, "copy": 1.0}, {"mm": 12.0, "copy": 500.0}, {"mm": 11.0}]
    ops = bench.top_operators(samples, {"mm": 4, "copy": 1})
    assert [o["name"] for o in ops] == ["mm", "copy"]
    assert ops[0]["self_ms_per_step"] == 11.0 and ops[0]["calls_per_step"] == 4
    assert ops[1]["self_ms_per_step"] == 1.0  # one descheduled step does not dominate
    assert bench.top_operators(samples, {}, top=1)[0]["name"] == "mm"
    assert bench.top_operators([], {}) == []
