"""`zerodp train` without ranks: report theory lines and formatting, options, failure messages."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from zerodp.apps.cli.train import add_train_arguments, options_from_args
from zerodp.apps.models.gpt import GPTConfig
from zerodp.apps.train.launch import (
    describe_failure,
    format_child_failure,
    format_failures,
    read_error_notes,
)
from zerodp.apps.train.loop import lr_factor, resolve_out_dir
from zerodp.apps.train.options import ErrorNote, TrainOptions, parse_fail_at, under_torchrun
from zerodp.apps.train.report import (
    COMM_UNIT,
    RunResult,
    build_report,
    comm_entry,
    comm_theory_bytes,
    comm_theory_elements,
    comm_theory_multiplier,
    comm_volume_bytes,
    format_count,
    format_mb,
    format_summary,
    loss_summary,
    memory_bars,
    memory_theory,
    throughput,
    write_report,
)
from zerodp.apps.train.theory import (
    PEAK_CATEGORIES,
    activations_theory,
    memory_peak,
    memory_peak_theory,
    working_theory,
)
from zerodp.apps.train.world import device_peak
from zerodp.config import Activations

PSI = 1000  # Ψ of the made-up runs below; world size 2, fp32


def _memory(rank: int, stage: int) -> dict[str, Any]:
    """A MemoryReport.to_dict() as a 2-rank fp32 Adam run of Ψ = 1000 would give."""
    n = 2
    grads = 4 * PSI // (n if stage >= 2 else 1)
    opt = 8 * PSI // (n if stage >= 1 else 1)
    return {
        "rank": rank,
        "world_size": n,
        "stage": stage,
        "num_params": PSI,
        "padded_numel": PSI + 8,
        "parameters": 4 * (PSI + 8),
        "gradients": grads,
        "optimizer_state": opt,
        "optimizer_scalar_bytes": 8,
        "comm_buffers": 6048 if stage == 2 else 0,
        "frozen_parameters": 0,
        "theory": {"parameters": 4.0 * PSI, "gradients": float(grads), "optimizer_state": opt},
        "model_states": 0,
    }


def _comm(stage: int) -> dict[str, Any]:
    if stage == 0:
        elements = {"all_reduce": PSI + 8}
    else:
        elements = {"reduce_scatter": PSI + 8, "all_gather": PSI + 8}
    volume = sum(v * (2 if k == "all_reduce" else 1) for k, v in elements.items())
    return {
        "elements": elements,
        "bytes": {k: 4 * v for k, v in elements.items()},
        "calls": {k: 1 for k in elements},
        "volume_elements": volume,
        "control_elements": 3,
        "control_calls": 1,
    }


def _run(stage: int, losses: list[float] | None = None) -> RunResult:
    losses = losses or [5.0, 4.0, 3.0]
    return RunResult(
        stage=stage,
        losses=losses,
        grad_norms=[1.0] * len(losses),
        lrs=[1e-3] * len(losses),
        step_times=[0.5] + [0.1] * (len(losses) - 1),
        tokens_per_step=256,
        num_params=PSI,
        element_size=4,
        bucket_bytes=32 * 2**20,
        memory=[_memory(0, stage), _memory(1, stage)],
        comm=_comm(stage),
        comm_volumes=[2 * (PSI + 8)] * len(losses),
        sample_prompt="def ",
        sample_text="foo(self):\n    return 1",
    )


def _options(**kw: Any) -> dict[str, Any]:
    return TrainOptions(preset="tiny", steps=3, batch=2, **kw).to_dict()


ENV = {"world_size": 2, "backend": "gloo", "device": "cpu", "seq_len": 64, "nodes": 1}


# -- theory -----------------------------------------------------------------------------------


def test_comm_theory_is_2psi_for_stages_0_to_2_and_3psi_for_stage_3() -> None:
    assert [comm_theory_multiplier(s) for s in (0, 1, 2, 3)] == [2, 2, 2, 3]
    assert comm_theory_elements(2, 7) == 14
    assert comm_theory_elements(3, 7) == 21
    with pytest.raises(ValueError, match="stage"):
        comm_theory_multiplier(4)


def test_one_rank_has_no_communication_in_theory_either() -> None:
    """At world size 1 nothing is communicated: the theory is 0, not 2Ψ (issue 17)."""
    run = _run(2)
    run.memory = [{**run.memory[0], "world_size": 1}]
    run.comm = {**_comm(2), "elements": {}, "bytes": {}, "calls": {}, "volume_elements": 0}
    entry = comm_entry(run)
    assert entry is not None
    assert (entry["formula"], entry["theory_elements"], entry["theory_bytes"]) == (
        "0 (one rank)",
        0,
        0,
    )
    two = comm_entry(_run(2))
    assert two is not None and two["formula"] == "2Ψ" and two["theory_elements"] == 2 * PSI
    # DP 1 x TP 2: two ranks hold the model, one data-parallel rank: ZeRO moves nothing.
    run.memory = [{**m, "world_size": 1} for m in _run(2).memory]
    split = comm_entry(run)
    assert split is not None and split["formula"] == "0 (one rank)"


def test_comm_theory_bytes_counts_gradients_in_the_reduce_dtype() -> None:
    assert comm_theory_bytes(0, 10, param_bytes=4, reduce_bytes=4) == 80
    assert comm_theory_bytes(2, 10, param_bytes=4, reduce_bytes=4) == 80
    # bf16 parameters gathered, fp32 gradients reduced
    assert comm_theory_bytes(1, 10, param_bytes=2, reduce_bytes=4) == 60
    assert comm_theory_bytes(3, 10, param_bytes=2, reduce_bytes=4) == 80


def test_comm_volume_bytes_counts_all_reduce_twice() -> None:
    assert comm_volume_bytes(_comm(0)) == 2 * 4 * (PSI + 8)
    assert comm_volume_bytes(_comm(2)) == 2 * 4 * (PSI + 8)


def test_memory_theory_caps_the_bucket_at_the_model_size() -> None:
    run = _run(2)
    theory = memory_theory(run, run.memory[0])
    assert theory is not None
    assert theory["optimizer_state"] == 8 * PSI / 2
    assert theory["gradients"] == 4 * PSI / 2
    # two staging buckets, each at most the (padded) model: not the configured 32 MiB
    assert theory["comm_buffers"] == 2 * 4 * (PSI + 8)
    assert theory["total"] == sum(
        theory[k] for k in ("parameters", "gradients", "optimizer_state", "comm_buffers")
    )
    assert memory_theory(_run(1), _memory(0, 1))["comm_buffers"] == 0  # type: ignore[index]


def test_memory_theory_is_none_when_the_optimizer_is_unknown() -> None:
    measured = _memory(0, 2) | {"theory": None}
    assert memory_theory(_run(2), measured) is None


def test_throughput_leaves_out_the_first_step() -> None:
    t = throughput([1.0, 0.5, 0.5], tokens_per_step=100)
    assert t["tokens_per_s"] == pytest.approx(200.0)
    assert t["step_time_s"] == pytest.approx(0.5)
    assert t["total_time_s"] == pytest.approx(2.0)
    assert throughput([0.25], 100)["tokens_per_s"] == pytest.approx(400.0)
    assert throughput([], 100)["tokens_per_s"] is None


def test_loss_summary_smooths_the_last_steps() -> None:
    s = loss_summary([10.0] * 5 + [2.0] * 10)
    assert (s["first"], s["last"], s["final"]) == (10.0, 2.0, 2.0)
    assert loss_summary([])["final"] is None


# -- formatting -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(13_234_567, "13.2"), (482_304, "0.48"), (123_456_789, "123"), (0, "0"), (None, "n/a")],
)
def test_format_mb(num_bytes: float | None, text: str) -> None:
    assert format_mb(num_bytes) == text


@pytest.mark.parametrize(
    ("n", "text"), [(3_257_856, "3.26M"), (120_576, "121k"), (950, "950"), (2.5e9, "2.5G")]
)
def test_format_count(n: float, text: str) -> None:
    assert format_count(n) == text


def test_summary_shows_measured_and_theory_for_memory_and_comm() -> None:
    report = build_report(_options(), ENV, [_run(2)])
    text = format_summary(report)
    assert "preset tiny" in text and "2 ranks (gloo, cpu)" in text
    assert "loss 5.000 -> 4.000" in text
    assert "memory per rank in MB (1e6 bytes), measured / theory" in text
    assert "0.004 / 0.004" in text  # optimizer state: 4 KB measured and in theory
    assert "theory 2Ψ" in text and "all-reduce counted twice" in text
    assert "| def foo(self):" in text
    entry = report["runs"][0]
    assert entry["comm"]["theory_elements"] == 2 * PSI
    assert entry["comm"]["measured_elements"] == 2 * (PSI + 8)
    assert entry["comm"]["unit"] == COMM_UNIT and entry["comm"]["steady"]
    assert [row["rank"] for row in entry["memory"]] == [0, 1]


def test_summary_of_an_offloaded_run_says_where_the_bytes_are() -> None:
    run = _run(2)
    for m in run.memory:
        m.update(offload="nvme", device=9_000_000, host=2_500_000, nvme=12_288_000)
    text = format_summary(build_report(_options(), ENV, [run]))
    tiers = text.split("optimizer offloaded to 'nvme'; MB per rank by tier:\n")[1].splitlines()
    assert tiers[:2] == [
        "     0  device 9.00, host 2.50, nvme 12.3",
        "     1  device 9.00, host 2.50, nvme 12.3",
    ]
    plain = format_summary(build_report(_options(), ENV, [_run(2)]))
    assert "offloaded" not in plain


def test_compare_table_has_one_row_per_stage() -> None:
    runs = [_run(0), _run(1, [5.0, 4.0, 3.5]), _run(2), _run(3)]
    report = build_report(_options(compare_stages=True, stages=(0, 1, 2, 3)), ENV, runs)
    assert report["comparison"]["reference_stage"] == 0
    assert report["comparison"]["max_abs_loss_diff"] == {"0": 0.0, "1": 0.5, "2": 0.0, "3": 0.0}
    text = format_summary(report)
    assert "Stages compared on the same seed and data (memory per rank):" in text
    assert "Stage 3: 1,000 parameters" in text
    table = text.split("Stages compared")[1].splitlines()
    assert [line.split()[0] for line in table[2:]] == ["0", "1", "2", "3"]
    assert "5.00e-01" in table[3]


def test_the_measured_peak_is_split_by_what_held_it() -> None:
    """[Note: memory meters]: the rest is what the categories and the runtime leave."""
    m = {
        **_memory(0, 2),
        "gathered_peak": 0,
        "process": {"source": "RSS", "baseline": 9000, "peak": 30000, "activations": 5000},
    }
    peak = memory_peak(m)
    assert peak is not None
    held = 4 * (PSI + 8) + 2000 + 4000 + 6048
    assert (peak["runtime"], peak["activations"], peak["total"]) == (9000, 5000, 30000)
    assert peak["rest"] == 30000 - 9000 - 5000 - held and peak["source"] == "RSS"
    assert memory_peak(_memory(0, 2)) is None  # an older report: no measured peak
    run = _run(2)
    run.activations_theory, run.working_theory = 4321.0, 555.0
    predicted = memory_peak_theory(run, {**m, "gathered_bound": 77})
    assert predicted is not None
    assert (predicted["activations"], predicted["gathered"]) == (4321.0, 77.0)
    assert predicted["rest"] == 555.0  # the backward's working set, as `zerodp estimate`'s margin
    assert predicted["total"] == pytest.approx(sum(predicted[k] for k in PEAK_CATEGORIES[:7]))


def test_stage_3_predicts_its_gathered_units_once() -> None:
    """The comm buffers' theory is the staging buckets, as measured; the gathered units are
    their own category, predicted by the schedule's bound, and counted once in the total."""
    run = _run(3)
    run.activations_theory = 100.0
    measured = {**_memory(0, 3), "gathered_bound": 77}
    theory = memory_theory(run, measured)
    assert theory is not None
    assert theory["comm_buffers"] == 2 * 4 * (PSI + 8)  # what stage 2 stages, nothing more
    predicted = memory_peak_theory(run, measured)
    assert predicted is not None
    held = sum(theory[k] for k in ("parameters", "gradients", "optimizer_state", "comm_buffers"))
    assert predicted["total"] == held + 77 + 100  # no working set given


def test_working_theory_is_the_estimators_margin() -> None:
    """The rest the train report predicts is the margin `zerodp estimate` adds: the larger of
    the head's (logits, their two fp32 gradients, the final LayerNorm's gradient, the head's
    weight gradient) and a block's working set ([Note: backward working set]), by hand."""
    gpt = GPTConfig(vocab_size=50, seq_len=4, n_layer=2, n_head=2, n_embd=8)
    logits = 3 * 4 * 50  # b·s·V
    head = logits * 4 + 2 * 4 * logits + 3 * 4 * 8 * 4 + 50 * 8 * 4  # fp32: no cast back
    block = 4 * 3 * 4 * 8 * 4 + 4 * 8 * 8 * 4
    assert working_theory(gpt, 3, 4) == max(head, block) == head
    # bf16 with the logits' cast back; the head and the 4h-wide layers split over 2 TP ranks
    half = logits // 2
    head = half * 2 + 2 * 4 * half + half * 2 + 3 * 4 * 8 * 2 + 50 * 8 * 2 // 2
    block = (4 * 3 * 4 * 8 * 2 + 4 * 8 * 8 * 2) // 2
    assert working_theory(gpt, 3, 2, tensor_parallel=2) == max(head, block) == head


def test_activations_theory_counts_what_the_gpt_saves() -> None:
    """[Note: GPT activations], by hand: 2 layers, h 8, 2 heads, vocab 50, s 4, b 3, bf16."""
    gpt = GPTConfig(vocab_size=50, seq_len=4, n_layer=2, n_head=2, n_embd=8)
    bs, bsh = 3 * 4, 3 * 4 * 8
    block = 16 * bsh * 2 + 4 * bs * 2 + 3 * 2 * 4 * 4  # + the attention's fp32 log-sum-exp
    outside = 2 * bsh * 2 + 2 * bs * 2 + 4 * bs * 50 + 16 * bs + 8 * 4 + 4
    assert activations_theory(gpt, 3, 2, Activations()) == 2 * block + outside
    full = Activations(checkpoint=("Block",))
    assert activations_theory(gpt, 3, 2, full) == 2 * bsh * 2 + outside
    offload = Activations(checkpoint=("Block",), offload="cpu", on_device=1)
    assert activations_theory(gpt, 3, 2, offload) == bsh * 2 + outside


def test_mfu_needs_a_known_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device_peak(torch.device("cpu"), "bf16")["peak_flops"] is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    h100 = device_peak(torch.device("cuda", 0), "bf16")
    assert h100 == {"device_name": "NVIDIA H100 80GB HBM3", "peak_flops": 989e12}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla T4")
    assert device_peak(torch.device("cuda", 0), "fp32")["peak_flops"] is None


def test_memory_bars_fall_back_to_the_largest_rank_per_run() -> None:
    report = build_report(_options(), ENV, [_run(0), _run(1), _run(2)])
    done = report["runs"]
    assert len(memory_bars(done, max_bars=8)) == 6
    bars = memory_bars(done, max_bars=4)
    assert [b.label.split("\n")[0] for b in bars] == ["stage 0", "stage 1", "stage 2"]


def test_write_report_writes_valid_json_and_a_png(tmp_path: Path) -> None:
    run = _run(2)
    process = {"source": "RSS", "baseline": 9000, "peak": 30000, "activations": 5000}
    run.memory = [{**m, "process": process} for m in run.memory]
    run.grad_norms = [math.inf, 1.0, 1.0]  # an overflowing step: JSON has no inf
    report = build_report(_options(), ENV, [run])
    json_path, png_path = write_report(report, tmp_path / "out")
    loaded = json.loads(json_path.read_text())
    assert loaded["runs"][0]["curves"]["grad_norm"][0] is None
    assert [r["status"] for r in loaded["runs"]] == ["ok"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert loaded["runs"][0]["memory"][0]["peak"]["total"] == 30000


# -- options ----------------------------------------------------------------------------------


def _parse(*argv: str) -> TrainOptions:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return options_from_args(parser.parse_args(list(argv)))


def test_defaults_train_small_at_stage_2() -> None:
    o = _parse()
    assert (o.preset, o.stages, o.precision, o.world_size) == ("small", (2,), "fp32", None)
    assert o.bucket_mb is None and o.resume is None and o.checkpoint_dir is None


def test_default_bucket_is_zeroconfigs_but_at_most_an_eighth_of_the_model() -> None:
    o = TrainOptions()
    assert o.bucket_bytes_for(10**9) == 32 * 2**20
    assert o.bucket_bytes_for(13_031_424) == 13_031_424 // 8
    assert o.bucket_bytes_for(1000) == 64 * 2**10
    assert TrainOptions(bucket_mb=0.5).bucket_bytes_for(10**9) == 2**19


def test_compare_stages_runs_every_stage() -> None:
    assert _parse("--compare-stages").stages == (0, 1, 2, 3)


def test_bare_resume_means_the_checkpoint_dir() -> None:
    assert _parse("--checkpoint-dir", "c", "--resume").resume == "c"
    assert _parse("--resume", "c/step-00000002").resume == "c/step-00000002"
    with pytest.raises(ValueError, match="needs --checkpoint-dir"):
        _parse("--resume")
    with pytest.raises(ValueError, match="--checkpoint-every needs --checkpoint-dir"):
        _parse("--checkpoint-every", "5")
    with pytest.raises(ValueError, match="not --compare-stages"):
        _parse("--compare-stages", "--checkpoint-dir", "c")


def test_stage_3_is_accepted() -> None:
    assert _parse("--stage", "3").stages == (3,)


def test_under_torchrun_needs_all_three_variables() -> None:
    assert under_torchrun({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert not under_torchrun({"RANK": "0", "WORLD_SIZE": "2"})


def test_parse_fail_at() -> None:
    assert parse_fail_at("1:2") == (1, 2)
    assert parse_fail_at("") is None and parse_fail_at(None) is None
    with pytest.raises(ValueError, match="RANK:STEP"):
        parse_fail_at("1")


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    assert lr_factor(0, 100, 5) == pytest.approx(0.2)
    assert lr_factor(4, 100, 5) == pytest.approx(1.0)
    assert lr_factor(5, 100, 5) == pytest.approx(1.0)
    assert lr_factor(100, 100, 5) == pytest.approx(0.1)


def test_default_out_dir_is_timestamped() -> None:
    now = datetime.datetime(2025, 1, 2, 3, 4, 5)
    assert resolve_out_dir(None, now) == Path("runs/train-20250102-030405")
    assert resolve_out_dir("x", now) == Path("x")


# -- failure messages -------------------------------------------------------------------------


def _failure(message: Any, timestamp: int, exitcode: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        message=message, timestamp=timestamp, exitcode=exitcode, signal_name=lambda: "SIGKILL"
    )


def test_failure_report_puts_the_root_cause_first_with_its_traceback() -> None:
    root = {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback...\nboom"}}
    text = format_child_failure(
        {0: _failure("Signal 15 (SIGTERM) received", 20, -15), 1: _failure(root, 10)}
    )
    assert text.index("rank 1 failed: ValueError: boom") < text.index("rank 0")
    assert "Traceback...\nboom" in text
    assert "rank(s) 1, 0" in text


def test_describe_failure_without_an_error_file() -> None:
    assert describe_failure(_failure("", 0, -9)) == ("killed by SIGKILL", "")
    assert describe_failure(_failure("oops", 0, 3)) == ("exit code 3: oops", "")


def test_error_notes_put_the_earliest_error_first(tmp_path: Path) -> None:
    notes = [
        ErrorNote(rank=0, time_ns=20, summary="RuntimeError: connection reset", traceback="tb0"),
        ErrorNote(rank=1, time_ns=10, summary="ValueError: boom", traceback="Traceback\nboom"),
    ]
    for note in notes:
        (tmp_path / f"rank-{note.rank}.json").write_text(json.dumps(dataclasses.asdict(note)))
    (tmp_path / "rank-9.json").write_text("{not json")  # a torn write is ignored
    read = read_error_notes(tmp_path)
    assert [n.rank for n in read] == [1, 0]
    text = format_failures(read, {0: _failure("", 30, -15), 2: _failure("", 30, -9)})
    assert "rank 1 failed first: ValueError: boom\nTraceback\nboom" in text
    assert text.index("then rank 0: RuntimeError: connection reset") < text.index("rank 2:")
    assert "rank 2: killed by SIGKILL" in text and "tb0" not in text


def test_without_notes_the_agents_failures_are_shown() -> None:
    root = {"message": "ValueError: boom", "extraInfo": {"py_callstack": "tb"}}
    assert "rank 1 failed: ValueError: boom" in format_failures([], {1: _failure(root, 1)})
