"""`zerodp estimate` end to end through the dispatcher: the paper's tables, JSON, and bad input."""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from zerodp.apps.cli.main import main
from zerodp.memory import (
    GPTShape,
    gpt_activation_bytes,
    gpt_param_count,
    gpt_saved_bytes,
    gpt_working_bytes,
)

# Table 1 of the ZeRO paper (P_os, P_os+g, P_os+g+p in GB), one dict per model size.
TABLE_1 = {
    "7.5e9": {
        1: ["120", "120", "120"],
        4: ["52.5", "41.3", "30"],
        16: ["35.6", "21.6", "7.5"],
        64: ["31.4", "16.6", "1.88"],
        256: ["30.4", "15.4", "0.47"],
        1024: ["30.1", "15.1", "0.12"],
    },
    "128e9": {
        1: ["2048", "2048", "2048"],
        4: ["896", "704", "512"],
        16: ["608", "368", "128"],
        64: ["536", "284", "32"],
        256: ["518", "263", "8"],
        1024: ["513", "257", "2"],
    },
    "1e12": {
        1: ["16000", "16000", "16000"],
        4: ["7000", "5500", "4000"],
        16: ["4750", "2875", "1000"],
        64: ["4187", "2218", "250"],
        256: ["4046", "2054", "62.5"],
        1024: ["4011", "2013", "15.6"],
    },
}
PAPER_WORLD_SIZES = "1,4,16,64,256,1024"
GPT_ARGS = ["--gpt-layers", "4", "--gpt-hidden", "64", "--gpt-vocab", "1000", "--gpt-seq", "128"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["estimate", *argv]) == 0
    return capsys.readouterr().out


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(_run(capsys, *argv, "--json"))
    return result


def _table_rows(text: str) -> dict[int, list[str]]:
    """World size -> the four stage cells of the first table (the model-state table)."""
    rows: dict[int, list[str]] = {}
    for line in text.splitlines():
        if not line.strip():
            if rows:
                break
            continue
        first, *cells = line.split()
        if first.isdigit():
            rows[int(first)] = cells
    return rows


@pytest.mark.parametrize("params", list(TABLE_1))
def test_default_table_reproduces_table_1(capsys: pytest.CaptureFixture[str], params: str) -> None:
    out = _run(capsys, "--params", params, "--world-sizes", PAPER_WORLD_SIZES)
    assert "1 GB = 1e9 bytes" in out
    rows = _table_rows(out)
    assert list(rows) == [1, 4, 16, 64, 256, 1024]
    baseline = TABLE_1[params][1][0]
    for n, printed in TABLE_1[params].items():
        assert rows[n] == [baseline, *printed]


def test_figure_1_example(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _table_rows(_run(capsys, "--params", "7.5e9", "--world-sizes", "64"))
    assert [float(cell) for cell in rows[64]] == [120, 31.4, 16.6, 1.88]  # 1.88 prints as 1.9


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--params", "7.5e9", "--world-sizes", "1,64")
    assert data["gb"] == 1e9
    assert data["bytes_per_param"] == {
        "param_bytes": 2,
        "grad_bytes": 2,
        "optimizer_bytes_per_param": 12,
    }
    stages = data["world_sizes"][1]["stages"]
    assert [s["model_states"] for s in stages] == pytest.approx(
        [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    )
    assert stages[2]["gradients"] == pytest.approx(2 * 7.5e9 / 64)
    assert all(s["fits"] is None for s in stages)
    assert data["world_sizes"][1]["recommended_stage"] is None


def test_device_memory_answers_fit_and_recommends(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--params", "7.5e9", "--world-sizes", "1,16,64", "--device-memory-gb", "32"]
    out = _run(capsys, *argv, "--bucket-bytes", "1")
    assert "recommended" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines["1"].endswith("none")  # the last "1" row is the fit table's
    assert lines["16"].endswith("stage 2")
    assert lines["64"].endswith("stage 1")
    data = _json(capsys, *argv, "--bucket-bytes", "1")
    assert [w["recommended_stage"] for w in data["world_sizes"]] == [None, 2, 1]
    assert [s["fits"] for s in data["world_sizes"][2]["stages"]] == [False, True, True, True]


def test_gpt_description_counts_params_and_activations(capsys: pytest.CaptureFixture[str]) -> None:
    shape = GPTShape(layers=4, hidden=64, vocab=1000, seq_len=128, micro_batch=8)
    data = _json(capsys, *GPT_ARGS, "--gpt-batch", "8", "--world-sizes", "2")
    assert data["num_params"] == gpt_param_count(shape)
    # [Note: GPT activations], one head per 64 of hidden by default.
    assert data["activation_bytes"] == gpt_saved_bytes(shape, dtype_bytes=2)
    root_unit = (1000 + 128) * 64 + 2 * 64  # embeddings and final LayerNorm
    assert data["largest_unit_bytes"] == 2 * root_unit  # in bf16
    ckpt = _json(capsys, *GPT_ARGS, "--gpt-batch", "8", "--activation-checkpointing")
    recomputed = gpt_saved_bytes(shape, dtype_bytes=2) - gpt_saved_bytes(
        dataclasses.replace(shape, layers=3), dtype_bytes=2
    )  # one block, recomputed in the backward, reading its input from the checkpoint
    kept = gpt_saved_bytes(shape, dtype_bytes=2, checkpointing=True)
    assert ckpt["activation_bytes"] == kept + recomputed - 8 * 128 * 64 * 2
    heads = _json(capsys, *GPT_ARGS, "--gpt-batch", "8", "--gpt-heads", "4")
    more = 4 * 8 * 3 * 128 * 4  # 3 more heads' fp32 log-sum-exp per block
    assert heads["activation_bytes"] == data["activation_bytes"] + more
    assert "Activations per rank" in _run(capsys, *GPT_ARGS)


def test_precision_optimizer_and_k(capsys: pytest.CaptureFixture[str]) -> None:
    sgd = _json(capsys, "--params", "1e9", "--precision", "fp32", "--optimizer", "sgd")
    assert sgd["bytes_per_param"]["optimizer_bytes_per_param"] == 4
    over = _json(capsys, "--params", "1e9", "--optimizer", "sgd", "--k", "6")
    assert over["bytes_per_param"]["optimizer_bytes_per_param"] == 6
    assert over["world_sizes"][0]["stages"][0]["model_states"] == pytest.approx(10e9)


def test_model_factory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "zerodp_cli_fixture.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def tied():
                emb = nn.Embedding(100, 8)
                head = nn.Linear(8, 100, bias=False)
                head.weight = emb.weight
                return nn.Sequential(emb, head)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "zerodp_cli_fixture", raising=False)
    assert _json(capsys, "--model", "zerodp_cli_fixture:tied")["num_params"] == 800


def test_model_step_measures_activations_and_the_working_set(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model-step``: one measured step of the user's model ([Note: backward working set]);
    on the shipped GPT the activations are the formula's to the byte."""
    (tmp_path / "zerodp_step_fixture.py").write_text(
        textwrap.dedent(
            """
            import torch
            from zerodp.apps.models.gpt import GPT, GPTConfig

            def gpt():
                torch.manual_seed(0)
                return GPT(GPTConfig(64, 16, 2, 2, 32))

            def step(model):
                ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
                return model(ids, ids.roll(1, dims=1))[1]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "zerodp_step_fixture", raising=False)
    argv = ["--model", "zerodp_step_fixture:gpt", "--model-step", "zerodp_step_fixture:step"]
    argv += ["--precision", "fp32", "--world-sizes", "2", "--device-memory-gb", "1"]
    shape = GPTShape(layers=2, hidden=32, vocab=64, seq_len=16, micro_batch=3, heads=2)
    (stage0, *_) = _json(capsys, *argv)["world_sizes"][0]["stages"]
    assert stage0["activations"] == gpt_saved_bytes(shape, dtype_bytes=4)
    assert 0 < stage0["margin"] <= gpt_working_bytes(shape, dtype_bytes=4)
    assert stage0["peak"] == stage0["total"] + stage0["margin"]
    text = _run(capsys, *argv)
    assert "Activations per rank: 0.00022 GB (measured: one step of zerodp_step_fixture:step)" in (
        text
    )
    assert "         2 0.0007 yes 0.00059 yes" in text  # wide cells keep a space between
    assert "Margin per rank: " in text


def test_tensor_parallel_and_partitioned_checkpoints(capsys: pytest.CaptureFixture[str]) -> None:
    """``--tensor-parallel T``: a GPT split T ways, per TP rank (the formulas' layout, checked
    against a split model in tests/dist/test_tensor_parallel.py); ``--partition-activations``
    keeps 1/T of each checkpoint."""
    gpt = ["--gpt-layers", "4", "--gpt-hidden", "256", "--gpt-vocab", "512", "--gpt-seq", "128"]
    argv = [*gpt, "--gpt-heads", "4", "--gpt-batch", "2", "--world-sizes", "2"]
    shape = GPTShape(layers=4, hidden=256, vocab=512, seq_len=128, micro_batch=2, heads=4)
    kw = {"dtype_bytes": 2, "checkpointing": True, "tensor_parallel": 2}
    ckpt = ["--activation-checkpointing", "--tensor-parallel", "2"]
    split = _json(capsys, *argv, *ckpt)
    parted = _json(capsys, *argv, *ckpt, "--partition-activations")
    assert split["num_params"] == gpt_param_count(shape, tensor_parallel=2)
    assert split["num_params"] < gpt_param_count(shape) / 2 + 256 * 128 + 12 * 256 * 4
    acts = [d["world_sizes"][0]["stages"][0]["activations"] for d in (split, parted)]
    assert acts == [
        gpt_activation_bytes(shape, **kw),
        gpt_activation_bytes(shape, **kw, partitioned=True),
    ]
    # Half of each block's bf16 input, but of the one being recomputed (whole again then).
    assert acts[0] - acts[1] == (4 - 1) * 2 * 128 * 256 * 2 // 2
    text = _run(capsys, *argv, *ckpt, "--partition-activations")
    assert "parameters per tensor-parallel rank (the model split 2 ways)" in text
    assert "(with activation checkpointing, partitioned (P_a), micro-batch 2)" in text


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--params", "1e9", "--tensor-parallel", "2"], "--tensor-parallel"),
        (
            [
                "--gpt-layers",
                "2",
                "--gpt-hidden",
                "30",
                "--gpt-vocab",
                "64",
                "--gpt-seq",
                "8",
                "--tensor-parallel",
                "4",
            ],
            "--tensor-parallel",
        ),
        (
            [
                "--gpt-layers",
                "2",
                "--gpt-hidden",
                "64",
                "--gpt-vocab",
                "64",
                "--gpt-seq",
                "8",
                "--tensor-parallel",
                "2",
                "--partition-activations",
            ],
            "--partition-activations",
        ),
        (["--offload", "--tensor-parallel", "2"], "--tensor-parallel"),
        (["--params", "1e9", "--model-step", "m:f"], "--model-step"),
        (["--params", "1e9", "--world-sizes", "0"], "--world-sizes"),
        (["--params", "1e9", "--world-sizes", "4,x"], "--world-sizes"),
        (["--params", "1e9", "--world-sizes", ""], "--world-sizes"),
        (["--params", "-1"], "--params"),
        (["--params", "abc"], "--params"),
        (["--params", "nan"], "--params"),
        (["--params", "1e9", "--device-memory-gb", "0"], "--device-memory-gb"),
        (["--params", "1e9", "--k", "-1"], "--k"),
        (["--params", "1e9", "--bucket-bytes", "0"], "--bucket-bytes"),
        (["--params", "1e9", "--precision", "fp8"], "--precision"),
        (["--gpt-layers", "2"], "--gpt-hidden"),
        ([], "--params"),
        (["--params", "1e9", "--model", "x:y"], "--model"),
        (["--model", "zerodp_no_such_module:f"], "--model"),
        (["--params", "1e9", "--activation-checkpointing"], "--activation-checkpointing"),
    ],
)
def test_bad_input_is_an_argparse_error_naming_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["estimate", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "zerodp estimate: error:" in err
    assert option in err.split("error:", 1)[1]


def test_the_readme_shows_the_real_which_stage_table(capsys: pytest.CaptureFixture[str]) -> None:
    """README's "Which stage do I need?" quotes this command's output, every line."""
    argv = ["--gpt-layers", "32", "--gpt-hidden", "4096", "--gpt-vocab", "32000"]
    argv += ["--gpt-seq", "2048", "--gpt-batch", "1", "--world-sizes", "1,8,64"]
    assert main(["estimate", *argv, "--device-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Which stage do I need?") : readme.index("## Use")]
    for line in out.splitlines():
        assert line in section, f"README does not show: {line}"
