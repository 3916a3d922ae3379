"""``zerodp bench``'s pure parts: configurations, options, report building, tables, parity.

No ranks are launched; the per-rank results are synthetic dicts shaped like
``zerodp.apps.bench.runner.rank_main``'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from zerodp.apps.bench import stats
from zerodp.apps.bench.options import BenchOptions
from zerodp.apps.bench.parity import compare_params
from zerodp.apps.bench.systems import BY_NAME, KNOWN, parse_configs
from zerodp.apps.bench.table import accounting, build_report, memory_row, round_times, rss_summary
from zerodp.apps.bench.text import (
    format_breakdown_table,
    format_comm_table,
    format_memory_table,
    format_phase_memory_table,
    format_report,
    format_time_table,
)
from zerodp.apps.bench.tolerance import judge, loss_rel_diff, tolerance

MIB = 2**20
PHASES = ("zero_grad", "forward", "backward", "step")


def _step(i: int, total: float, peak: int, loss: float = 5.0) -> dict[str, Any]:
    """One step: phases sum to ``total``; RSS 100 MiB, +10 MiB after forward, peak in backward."""
    times = {"zero_grad": 0.0, "forward": total / 4, "backward": total / 2, "step": total / 4}
    memory = {
        "zero_grad": {"now": 100 * MIB, "peak": 100 * MIB},
        "forward": {
            "now": 110 * MIB,
            "peak": 110 * MIB,
            "heap_used": 60 * MIB,
            "heap_free": 5 * MIB,
        },
        "backward": {"now": 105 * MIB, "peak": peak},
        "step": {"now": 100 * MIB, "peak": 101 * MIB},
    }
    return {"step": i, "times": {**times, "total": total}, "memory": memory, "loss": loss}


def _rank(
    rank: int, totals: list[float], peak: int = 120 * MIB, comm: dict[str, Any] | None = None
) -> dict[str, Any]:
    steps = [_step(i, t, peak) for i, t in enumerate(totals)]
    held = {"parameters": 4 * MIB, "gradients": 4 * MIB, "optimizer_state": 8 * MIB}
    # the last step also accounts at the end of its forward pass
    steps[-1]["forward_end"] = {
        "saved": 3 * MIB,
        "saved_alive": 3 * MIB,
        **held,
        "buffers": 2 * MIB,
    }
    return {
        "rank": rank,
        "status": "ok",
        "num_params": 1000,
        "rss_baseline": 80 * MIB,
        "rss_setup": 90 * MIB,
        "peak_rss_setup": 95 * MIB,
        "peak_resettable": True,
        "steps": steps,
        "memory": {
            "parameters": 4 * MIB,
            "gradients": 4 * MIB,
            "optimizer_state": 8 * MIB,
            "buffers": 2 * MIB,
        },
        "comm": comm,
        "rss_end": 100 * MIB,
    }


def _report() -> dict[str, Any]:
    # warmup 1: the first step of every rank is not timed
    ddp = [[_rank(0, [9.0, 1.0, 2.0, 1.0]), _rank(1, [9.0, 1.5, 1.0, 1.0])]]
    ledger = {"volume_elements": 2000, "elements": {"all_reduce": 1000}}
    zero2 = [
        [
            _rank(0, [9.0, 0.5, 0.5, 0.5], peak=130 * MIB, comm=ledger),
            _rank(1, [9.0, 0.5, 0.6, 0.5], peak=150 * MIB, comm=ledger),
        ]
    ]
    exact = {"model_rel_diff": 0.0, "max_rel_diff": 0.0, "max_abs_diff": 0.0}
    close = {"model_rel_diff": 2e-6, "max_rel_diff": 3e-4, "max_abs_diff": 1e-7}
    return build_report(
        meta={"preset": "tiny", "warmup": 1, "precision": "fp32", "world_size": 2},
        order=["ddp", "zero2", "plain", "deepspeed1"],
        statuses={
            "ddp": {"status": "ok"},
            "zero2": {"status": "ok"},
            "plain": {"status": "not available", "reason": "world size 1 only"},
            "deepspeed1": {"status": "not installed", "reason": "no deepspeed"},
        },
        runs={"ddp": ddp, "zero2": zero2},
        parity={
            "ddp": {**exact, "mismatched_names": []},
            "zero2": {**close, "mismatched_names": []},
        },
    )


def test_parse_configs() -> None:
    assert parse_configs("ddp, zero2,fsdp2") == ["ddp", "zero2", "fsdp2"]
    assert parse_configs("all") == list(KNOWN)
    assert {"zero3", "zro", "fsdp2-noreshard", "deepspeed3"} <= set(KNOWN)
    for bad, match in (("ddp,zero9", "unknown"), ("ddp,ddp", "repeated"), (" , ", "empty")):
        with pytest.raises(ValueError, match=match):
            parse_configs(bad)


def test_systems_theory() -> None:
    assert BY_NAME["fsdp2"].comm_impl == 3 and BY_NAME["fsdp2-noreshard"].comm_impl == 2
    assert BY_NAME["zro"].comm_paper == 2 and BY_NAME["zro"].comm_impl == 3
    assert [BY_NAME[f"zero{s}"].comm_paper for s in range(4)] == [2, 2, 2, 3]
    assert tolerance("fp32").judged_on == "parameters" and tolerance("fp32").bound == 1e-5
    assert tolerance("bf16").judged_on == "loss curve" and tolerance("bf16").bound == 2.0**-8
    with pytest.raises(ValueError, match="precision"):
        tolerance("fp8")


def test_options_validate_and_serialise() -> None:
    opts = BenchOptions(configs=("ddp", "zero1"), bucket_mb=1.5)
    assert opts.bucket_bytes == int(1.5 * MIB)
    assert json.loads(json.dumps(opts.to_dict()))["configs"] == ["ddp", "zero1"]
    with pytest.raises(ValueError, match="unknown"):
        BenchOptions(configs=("ddp", "nope"))
    with pytest.raises(ValueError, match="precision"):
        BenchOptions(precision="fp16")
    with pytest.raises(ValueError, match="steps"):
        BenchOptions(steps=0)
    with pytest.raises(ValueError, match="preset"):
        BenchOptions(preset="nope")


def test_the_backend_option_lets_ranks_share_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--backend gloo``: gloo carries CUDA tensors too, and ranks beyond the GPUs share them
    round robin (NCCL refuses two ranks on one GPU); ``auto`` leaves the choice to
    ``init_process_group`` (NCCL with CUDA, gloo on CPU)."""
    from zerodp.apps.train.world import local_placement

    assert BenchOptions().process_backend(cuda=True) is None
    gloo = BenchOptions(backend="gloo")
    assert gloo.process_backend(cuda=True) == "cpu:gloo,cuda:gloo"
    assert gloo.process_backend(cuda=False) == "gloo"
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'gloo'\), got 'nccl'"):
        BenchOptions(backend="nccl")

    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    for rank in range(3):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert local_placement() == (rank, 3, torch.device("cuda", rank % 2))
    assert chosen == [torch.device("cuda", i) for i in (0, 1, 0)]


def test_phase_medians_keep_order() -> None:
    samples = [{"step": 1.0, "forward": 3.0}, {"forward": 5.0}]
    assert list(stats.phase_medians(samples, PHASES)) == ["forward", "step"]
    assert stats.phase_medians(samples, PHASES)["step"] == 0.5  # missing counts as 0


def test_round_times_take_slowest_rank_after_warmup() -> None:
    ranks = [_rank(0, [9.0, 1.0, 2.0]), _rank(1, [9.0, 1.5, 1.0])]
    assert round_times(ranks, warmup=1) == [1.5, 2.0]


def test_rss_summary_and_accounting() -> None:
    r = rss_summary(_rank(0, [1.0, 1.0], peak=150 * MIB), warmup=1)
    assert r["peak_steps"] == 150 * MIB and r["peak_where"] == "backward (step 0)"
    assert r["forward_growth"] == 10 * MIB and r["baseline"] == 80 * MIB
    assert r["cuda_peak"] is None and r["saved_for_backward"] == 3 * MIB
    mem = memory_row(_rank(0, [1.0]))
    assert mem["model_states"] == 16 * MIB
    # 150 peak - 80 runtime - 16 model states - 2 buffers
    assert accounting(r, mem) == 52 * MIB
    assert memory_row({"memory": {"parameters": 1}})["model_states"] is None


def test_build_report_is_json_with_ratios_and_statuses() -> None:
    rep = _report()
    json.dumps(rep)
    ddp, z2 = rep["configs"]["ddp"], rep["configs"]["zero2"]
    assert ddp["step_time_s"]["median"] == 1.5 and ddp["ratio_to_ddp"] == 1.0
    assert z2["step_time_s"]["median"] == 0.5
    assert z2["ratio_to_ddp"] == pytest.approx(0.5 / 1.5)
    assert z2["round_ratio_to_ddp"] == pytest.approx(0.5 / 1.5)
    assert z2["comm"]["measured_psi"] == 2.0 and ddp["comm"]["measured_psi"] is None
    assert z2["rss_bytes"]["peak_steps"] == 150 * MIB  # the rank with the highest peak
    assert [r["peak_steps"] for r in z2["rss_bytes_per_rank"]] == [130 * MIB, 150 * MIB]
    assert z2["parity_vs_ddp"]["passed"] and z2["parity_vs_ddp"]["tolerance"] == 1e-5
    assert rep["configs"]["plain"]["status"] == "not available"
    assert "step_time_s" not in rep["configs"]["deepspeed1"]


def test_format_tables() -> None:
    rep = _report()
    time_table = format_time_table(rep).splitlines()
    assert all(line.count("|") == time_table[0].count("|") for line in time_table)
    assert "| ddp | DistributedDataParallel | 1500 | 1000 |" in time_table[2]
    assert "| 0.333 | 0.33 |" in time_table[3]  # medians and the one round
    assert time_table[2].endswith("| identical |")
    assert "| 500 |" in time_table[3] and "2.0e-06 (3.0e-04); 0 ok" in time_table[3]
    assert "not available (world size 1 only)" in time_table[4]
    assert "not installed" in time_table[5]
    mem = format_memory_table(rep).splitlines()
    assert len(mem) == 4  # header, rule, the two configurations that ran
    assert "| zero2 | 4.0 | 4.0 | 8.0 | 2.0 | 16.0 | 80.0 | 150.0 | 52.0 | 3.0 | 10.0 |" in mem[3]
    # at the end of forward: 110 = 80 runtime + 16 states + 2 buffers + 3 activations + 5 free
    # + 4 rest;
    # then 40 more up to the peak of 150 in backward
    breakdown = format_breakdown_table(rep)
    assert "| zero2 | 150.0 | 80.0 | 16.0 | 2.0 | 3.0 | 5.0 | 4.0 | 40.0 |" in breakdown
    phases = format_phase_memory_table(rep)
    assert "| zero2 | 80.0 | 90.0 | 95.0 | 100.0 | 110.0 | 150.0 | 101.0 | 100.0 |" in phases
    comm = format_comm_table(rep)
    assert "| zero2 | 2.000 | 2 | 2 |" in comm and "| ddp | - | 2 | 2 |" in comm
    assert comm.splitlines()[0].endswith("| how | measured by collective |")
    text = format_report(rep)
    assert "preset=tiny" in text and "Communication per step" in text


def test_optimizer_time_and_profile_are_rank_0s() -> None:
    ranks = [_rank(0, [9.0, 1.0, 1.0]), _rank(1, [9.0, 1.0, 1.0])]
    for r in ranks:
        for s in r["steps"]:
            s["times"]["optimizer"] = 0.1 if r["rank"] == 0 else 0.2
    ranks[0]["profile"] = [{"name": "aten::mm", "self_ms_per_step": 12.3, "calls_per_step": 4}]
    rep = build_report(
        meta={"preset": "tiny", "warmup": 1, "precision": "fp32", "world_size": 2},
        order=["zero2"],
        statuses={},
        runs={"zero2": [ranks]},
        parity={},
    )
    z2 = rep["configs"]["zero2"]
    assert z2["phases_median_s"]["optimizer"] == 0.1  # within step: not part of the total
    assert z2["phases_median_s"]["total"] == 1.0
    assert z2["profile_rank0"][0]["name"] == "aten::mm"
    table = format_time_table(rep).splitlines()
    assert "| step ms | optimizer ms |" in table[0]
    assert "| 250 | 100 |" in table[2]  # step 1.0 / 4, of which the optimizer 0.1
    text = format_report(rep)
    assert "Top operators by median self CPU ms per step" in text
    assert "- **zero2** (ms/step): aten::mm 12" in text


def test_failed_parity_is_flagged() -> None:
    rep = _report()
    rep_bad = build_report(
        meta=rep["meta"],
        order=["ddp", "zero2"],
        statuses={},
        runs={"ddp": [[_rank(0, [1.0, 1.0])]], "zero2": [[_rank(0, [1.0, 1.0])]]},
        parity={"zero2": {"model_rel_diff": 1e-3, "max_rel_diff": 1e-2, "max_abs_diff": 1e-3}},
    )
    zero2 = rep_bad["configs"]["zero2"]
    assert not zero2["parity_vs_ddp"]["passed"]
    assert rep_bad["configs"]["ddp"]["parity_vs_ddp"] is None


def test_parity_is_judged_on_the_parameters_in_fp32_and_on_the_loss_curve_in_bf16() -> None:
    """[Note: parity tolerances]: bf16 recipes differ by roundings the parameters amplify (a
    worst tensor 1.6 relative was measured), the loss curve stays within one bf16 rounding."""
    bf16_params = {"model_rel_diff": 3.6e-3, "max_rel_diff": 1.6, "max_abs_diff": 1e-3}
    ddp = [5.0, 4.0, 3.0]
    close = [5.0 * (1 + 2e-4), 4.0, 3.0 * (1 - 3e-3)]
    skipped = [5.0, 5.0, 3.0]  # a step that did not happen: the next loss is the previous one
    assert judge(bf16_params, close, ddp, "bf16")["passed"]
    out = judge(bf16_params, skipped, ddp, "bf16")
    assert not out["passed"] and out["loss_rel_diff"] == pytest.approx(0.25)
    assert out["judged_on"] == "loss curve" and out["tolerance"] == 2.0**-8
    assert not judge(bf16_params, close, None, "bf16")["passed"]  # nothing to judge by
    # fp32: the same parameters fail, whatever the loss curve.
    fp32 = judge(bf16_params, close, ddp, "fp32")
    assert not fp32["passed"] and fp32["judged_on"] == "parameters"
    assert judge({**bf16_params, "model_rel_diff": 4e-6}, skipped, ddp, "fp32")["passed"]
    assert loss_rel_diff([1.0, 2.0], [1.0]) == float("inf")


def test_the_report_states_the_tolerance_it_applied() -> None:
    text = format_report(_report())
    assert (
        "Parity with DDP (fp32), judged on the parameters: max|p - p_ddp| / max|p_ddp| <= 1e-05"
    ) in text


def test_compare_params() -> None:
    ref = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([1e-3, 0.0])}
    same = compare_params({k: v.clone() for k, v in ref.items()}, ref)
    assert same["max_abs_diff"] == 0 and same["model_rel_diff"] == 0
    noisy = {"w": ref["w"].clone(), "b": torch.tensor([1.5e-3, 0.0])}
    out = compare_params(noisy, ref)
    assert out["max_rel_diff"] == pytest.approx(0.5)  # the small tensor, relative to itself
    assert out["model_rel_diff"] == pytest.approx(5e-4 / 2.0)  # relative to the model's max
    assert next(iter(out["worst_parameters"])) == "b"
    missing = compare_params({"w": ref["w"]}, ref)
    assert missing["mismatched_names"] == ["b"] and missing["model_rel_diff"] == float("inf")
    reshaped = compare_params({"w": ref["w"].view(2, 1), "b": ref["b"]}, ref)
    assert reshaped["mismatched_names"] == ["w"]


def test_the_tables_name_what_the_memory_was_measured_with() -> None:
    """[Note: memory meters]: RSS on CPU; on CUDA the allocator, and the tables say so."""
    assert "| peak RSS |" in format_memory_table(_report())
    ranks = [{**_rank(r, [9.0, 1.0]), "memory_source": "CUDA allocated"} for r in (0, 1)]
    rep = build_report(
        meta={"preset": "tiny", "warmup": 1, "precision": "bf16", "world_size": 2},
        order=["zero2"],
        statuses={},
        runs={"zero2": [ranks]},
        parity={},
    )
    assert rep["configs"]["zero2"]["rss_bytes"]["source"] == "CUDA allocated"
    table = format_memory_table(rep).splitlines()[0]
    assert "| CUDA baseline | peak CUDA |" in table and "RSS" not in table
    assert "CUDA of the rank with the highest peak" in format_report(rep)


def test_one_rank_has_no_communication_in_theory() -> None:
    rep = build_report(
        meta={"preset": "tiny", "warmup": 1, "precision": "fp32", "world_size": 1},
        order=["zero2"],
        statuses={},
        runs={"zero2": [[_rank(0, [1.0, 1.0])]]},
        parity={},
    )
    comm = rep["configs"]["zero2"]["comm"]
    assert (comm["paper_psi"], comm["implementation_psi"]) == (0, 0)
    assert "| zero2 |" in format_comm_table(
        rep
    ) and "one rank: nothing to send" in format_comm_table(rep)


def test_the_docs_state_the_tolerances_the_code_applies() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert "| fp32 | parameters: max\\|p - p_ddp\\| / max\\|p_ddp\\| | <= 1e-05 |" in docs
    assert f"| <= {tolerance('bf16').bound:.2g} (2^-8, one bf16 rounding) |" in docs
    assert tolerance("fp32").bound == 1e-5
