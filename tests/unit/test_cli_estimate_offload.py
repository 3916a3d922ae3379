"""``zerodp estimate --offload``: the table for the H100 preset, JSON, flag overrides and
errors; ``--measure`` and the measurement functions (tiny sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerodp.apps.cli.main import main
from zerodp.memory import measure_cpu_adam, measure_disk, measure_memcpy

RINGS_WORLD_1 = 2 * 4 * 4 * 16_777_216  # two rings x 4 slots x fp32 x one bucket
ROOT = Path(__file__).resolve().parents[2]


# -- the command ---------------------------------------------------------------------------------


def _estimate(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["estimate", *argv]) == 0
    return capsys.readouterr().out


def test_cli_prints_the_three_models_and_the_largest_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _estimate(capsys, "--offload")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1.3B"], ["13B"])]
    assert {r[0] for r in rows} == {"1.3B", "13B"}
    assert any(line.startswith("6.7B ") for line in out.splitlines())
    cpu = next(r for r in rows if r[0] == "1.3B" and "optimizer=cpu" in r)
    assert cpu[-4:] == ["yes", "0.283", "cpu", "adam"]  # fits, s/step, bottleneck
    best_13b = next(r for r in rows if r[0] == "13B" and r[2].startswith("*"))
    assert best_13b[2:6] == ["*optimizer=cpu:0.83", "hostgrad=ring", "s2", "ckpt"]
    assert "Largest GPT (hidden = 128 x layers) that fits without NVMe" in out
    assert "12.75B (40 layers x 5120)" in out


@pytest.mark.parametrize("doc", ["README.md", "docs/offload.md"])
def test_the_docs_show_the_real_table(capsys: pytest.CaptureFixture[str], doc: str) -> None:
    out = _estimate(capsys, "--offload").splitlines()
    text = (ROOT / doc).read_text()
    rows = [ln for ln in out if ln.startswith(("1.3B ", "6.7B ", "13B ")) and ": " not in ln]
    table = [*rows, *(ln for ln in out if ln.startswith("Largest"))]
    assert len(table) == 9
    for line in table:
        assert line in text, f"{doc} does not show: {line}"


def test_cli_json_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--offload", "--params", "1e9", "--offload-optimizer", "cpu", "--json"]
    data = json.loads(_estimate(capsys, *argv, "--cpu-adam-params-per-s", "1e9"))
    assert data["machine"]["cpu_adam_params_per_s"] == 1e9
    (row,) = data["rows"]
    assert row["bytes"]["host"]["total"] == 16e9 + RINGS_WORLD_1
    assert row["placement"]["host_gradients"] == "auto"
    assert row["components_s"]["cpu adam"] == pytest.approx(1.0)
    assert row["bottleneck"] == "cpu adam"


def test_cli_gradients_on_nvme(capsys: pytest.CaptureFixture[str]) -> None:
    """``--offload-gradients nvme`` alone makes the placement stage 3 (its only stage)."""
    argv = ["--offload", "--params", "1e9", "--offload-optimizer", "nvme"]
    data = json.loads(_estimate(capsys, *argv, "--offload-gradients", "nvme", "--json"))
    (row,) = data["rows"]
    assert row["placement"]["gradients"] == "nvme" and row["placement"]["stage"] == 3
    assert row["bytes"]["nvme"]["gradients"] == 2e9
    assert "gradients" not in row["bytes"]["device"]


def test_cli_host_gradient_ring(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--offload", "--params", "1e9", "--offload-optimizer", "cpu", "--json"]
    data = json.loads(_estimate(capsys, *argv, "--offload-host-gradients", "ring"))
    (row,) = data["rows"]
    assert row["placement"]["host_gradients"] == "ring"
    assert "gradients" not in row["bytes"]["host"]
    assert row["bytes"]["host"]["gradient ring"] == 4 * 4 * 16_777_216


def test_cli_offload_flags_need_offload(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--params", "1e9", "--offload-optimizer", "cpu"])
    assert exc.value.code == 2
    assert "needs --offload" in capsys.readouterr().err


# -- measurements on this machine ----------------------------------------------------------------


def test_measurements_are_positive(tmp_path: Path) -> None:
    adam = measure_cpu_adam(numel=4096, repeats=2)
    assert adam.name == "cpu_adam_params_per_s" and adam.value > 0
    assert measure_cpu_adam(numel=4096, repeats=2, fused=False).value > 0
    assert measure_memcpy(nbytes=2**20, repeats=2).value > 0
    write, read = measure_disk(str(tmp_path), nbytes=2**20)
    assert (write.name, read.name) == ("disk_write_bytes_per_s", "disk_read_bytes_per_s")
    assert write.value > 0 and read.value > 0
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_cli_measure(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["--offload", "--measure", "--measure-dir", str(tmp_path), "--measure-mib", "1"]
    data = json.loads(_estimate(capsys, *argv, "--json"))
    names = [m["name"] for m in data["measured"]]
    assert "cpu_adam_params_per_s" in names and "disk_read_bytes_per_s" in names
    assert all(m["value"] > 0 and m["preset"] > 0 for m in data["measured"])
