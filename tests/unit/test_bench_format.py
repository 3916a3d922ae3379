"""``zerodp bench``'s statistics, command line, optimizer clock and operator profile (no ranks).

These were the pure helpers of ``benchmarks/bench_stages.py``; that script is gone, and what it
measured that ``zerodp bench`` did not (the torch optimizer's own time within ``step``, the top
operators under torch.profiler, zerodp's collectives by kind) is now part of ``zerodp bench``.
"""

from __future__ import annotations

import pytest
import torch

from zerodp.apps.bench import stats
from zerodp.apps.bench.operators import format_profile_table, top_operators
from zerodp.apps.bench.runner import OptimizerClock
from zerodp.apps.bench.systems import BY_NAME
from zerodp.apps.bench.table import OPTIMIZER, PHASES
from zerodp.apps.bench.text import format_meta, ledger_cell
from zerodp.apps.cli.main import build_parser

MIB = 2**20


def test_command_line_defaults_and_validation() -> None:
    args = build_parser().parse_args(["bench", "--steps", "3", "--configs", "zero1,ddp"])
    assert args.steps == 3 and args.configs == ["zero1", "ddp"]
    assert args.world_size is None and args.preset == "bench25m" and args.batch == 4
    assert args.profile_steps == 0
    assert build_parser().parse_args(["bench", "--profile-steps", "3"]).profile_steps == 3
    for bad in (["--steps", "0"], ["--configs", "ddp,zero9"], ["--profile-steps", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", *bad])


def test_zero_stage_of_each_configuration() -> None:
    names = ("ddp", "plain", "zero0", "zero1", "zero2", "zero3")
    assert [BY_NAME[c].zero_stage for c in names] == [0, 0, 0, 1, 2, 3]
    assert [BY_NAME[c].family for c in names] == ["torch"] * 2 + ["zerodp"] * 4


def test_round_order_rotates_every_position() -> None:
    configs = ["a", "b", "c"]
    orders = [stats.round_order(configs, s) for s in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for pos in range(3):  # each configuration runs in each position once per cycle
        assert sorted(o[pos] for o in orders) == configs
    assert stats.round_order(configs, 4) == orders[1]


def test_percentile_and_summarize() -> None:
    assert stats.percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert stats.percentile([5.0], 25) == 5.0
    assert stats.percentile([0.0, 10.0], 25) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    s = stats.summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 100.0 and s["n"] == 5
    assert s["p25"] == 2.0 and s["p75"] == 4.0
    assert s["iqr_rel"] == pytest.approx(2.0 / 3.0)


def test_phase_medians_and_max_over_ranks() -> None:
    order = (*PHASES, OPTIMIZER)
    samples = [{"forward": 1.0, "total": 2.0}, {"forward": 3.0, "total": 4.0, OPTIMIZER: 0.5}]
    ph = stats.phase_medians(samples, order)
    assert ph == {"forward": 2.0, "total": 3.0, OPTIMIZER: 0.25}
    assert list(ph) == [p for p in order if p in ph]  # table order
    assert stats.phase_medians([], order) == {}
    assert stats.max_over_ranks([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]


def test_top_operators_uses_medians() -> None:
    samples = [{"mm": 10.0, "copy": 1.0}, {"mm": 12.0, "copy": 500.0}, {"mm": 11.0}]
    ops = top_operators(samples, {"mm": 4, "copy": 1})
    assert [o["name"] for o in ops] == ["mm", "copy"]
    assert ops[0]["self_ms_per_step"] == 11.0 and ops[0]["calls_per_step"] == 4
    assert ops[1]["self_ms_per_step"] == 1.0  # one descheduled step does not dominate
    assert top_operators(samples, {}, top=1)[0]["name"] == "mm"
    assert top_operators([], {}) == []


def test_profile_table_shows_rank_0s_top_operators() -> None:
    ops = [{"name": "aten::mm", "self_ms_per_step": 12.3, "calls_per_step": 4}]
    report = {"configs": {"ddp": {"profile_rank0": ops}, "zero2": {"profile_rank0": None}}}
    assert format_profile_table(report) == "- **ddp** (ms/step): aten::mm 12"
    assert format_profile_table({"configs": {"ddp": {}}}) == ""


def test_ledger_cell_and_meta() -> None:
    stats_dict = {"calls": {"all_gather": 4}, "bytes": {"all_gather": 3 * MIB}}
    assert ledger_cell(stats_dict) == "all_gather 4x 3.0 MiB"
    assert ledger_cell(None) == "-"
    meta = {"preset": "x", "loadavg_start": [1.5, 0, 0], "loadavg_end": [2.25, 0, 0]}
    assert format_meta(meta) == "preset=x, loadavg 1.50->2.25"


def test_optimizer_clock_times_only_the_optimizers_own_steps() -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    with OptimizerClock(opt, torch.device("cpu")) as clock:
        assert clock.take() is None  # no step yet
        opt.step()
        opt.step()  # zerodp's mixed precision steps once per bucket: the calls add up
        seconds = clock.take()
        assert seconds is not None and seconds > 0
        assert clock.take() is None  # taken
    opt.step()  # hooks removed on exit
    assert clock.take() is None
    with OptimizerClock(opt, torch.device("cuda")) as clock:  # only a device name: no CUDA
        opt.step()
        assert clock.take() is None  # kernel launches are not the update: not timed


def test_the_offloaded_steps_timing_is_a_median_of_timed_steps() -> None:
    """Each step carries the record of the step before it ([Note: offload timing]); the table
    shows the median of every figure in ms, and nothing for configurations without one."""
    from zerodp.apps.bench.table import offload_medians
    from zerodp.apps.bench.text import format_offload

    def record(blocked: float) -> dict[str, float]:
        keys = ("unpack", "optimizer", "cast", "landing")
        return {"blocked": blocked, **dict.fromkeys(keys, 0.01), "unpack_chunks": 4.0}

    steps = [{"offload": record(b)} for b in (0.003, 0.009, 0.004)] + [{}]
    medians = offload_medians(steps)
    assert medians is not None and medians["blocked"] == 0.004 and medians["unpack_chunks"] == 4
    assert offload_medians([{}, {}]) is None
    report = {"configs": {"zero2": {}, "zero2-offload": {"offload_timing_s": medians}}}
    assert format_offload(report).splitlines()[2] == "| zero2-offload | 4 | 10 | 10 | 10 | 10 | 4 |"
    assert format_offload({"configs": {"zero2": {}}}) == ""
