"""``zerodp train --offload-optimizer / --offload-params / --offload-dir``: the flags' mapping to
``ZeroConfig.offload``, and the usage errors that stop a bad combination before any rank starts.

The run itself (stage 2 with the optimizer offloaded to the CPU) is in
tests/dist/test_cli_train.py.
"""

from __future__ import annotations

import argparse
import pickle

import pytest

from zerodp import OffloadConfig, ZeroConfig
from zerodp.apps.cli.main import main
from zerodp.apps.cli.train import add_train_arguments, options_from_args
from zerodp.apps.train import launch
from zerodp.apps.train.options import TORCHRUN_ENV, TrainOptions


@pytest.fixture(autouse=True)
def _no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A combination these tests expect refused must fail the test, not start training."""

    def refuse(*args: object) -> int:
        raise AssertionError("zerodp train started its ranks: the options were not refused")

    monkeypatch.setattr(launch, "launch_local", refuse)
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


def _parse(*argv: str) -> TrainOptions:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return options_from_args(parser.parse_args(list(argv)))


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``zerodp train ARGV`` must exit 2 with an argparse error; its message."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: zerodp train ")
    _, sep, message = err.partition("\nzerodp train: error: ")
    assert sep, err
    return message.rstrip("\n")


# -- flag -> config -----------------------------------------------------------------------------


def test_no_offload_by_default() -> None:
    o = _parse()
    assert (o.offload_optimizer, o.offload_params, o.offload_dir) == ("none", "none", None)
    assert o.offload_config() == OffloadConfig()
    assert o.zero_config(2, param_bytes=10**9) == ZeroConfig(stage=2)


def test_offload_optimizer_cpu_reaches_the_config() -> None:
    o = _parse("--stage", "2", "--offload-optimizer", "cpu")
    assert (o.stages, o.offload_optimizer, o.offload_params, o.offload_dir) == (
        (2,),
        "cpu",
        "none",
        None,
    )
    config = o.zero_config(2, param_bytes=10**9)
    assert config.offload == OffloadConfig(optimizer="cpu")
    # The other settings are the same as without the flag.
    assert config == ZeroConfig(stage=2, offload=OffloadConfig(optimizer="cpu"))


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_optimizer_cpu_at_other_sharded_stages(stage: int) -> None:
    o = _parse("--stage", str(stage), "--offload-optimizer", "cpu", "--precision", "bf16")
    config = o.zero_config(stage, param_bytes=10**9)
    assert (config.stage, config.precision.compute) == (stage, "bf16")
    assert config.offload == OffloadConfig(optimizer="cpu")


def test_nvme_tiers_take_the_offload_dir() -> None:
    o = _parse(
        "--stage", "3", "--offload-optimizer", "nvme", "--offload-params", "nvme",
        "--offload-dir", "/scratch/z",
    )  # fmt: skip
    assert o.offload_config() == OffloadConfig(optimizer="nvme", params="nvme", path="/scratch/z")
    assert o.zero_config(3, param_bytes=10**9).offload == o.offload_config()


def test_gradients_on_nvme_at_stage_3() -> None:
    o = _parse(
        "--stage", "3", "--offload-optimizer", "cpu", "--offload-gradients", "nvme",
        "--offload-dir", "/scratch/z",
    )  # fmt: skip
    want = OffloadConfig(optimizer="cpu", gradients="nvme", path="/scratch/z")
    assert o.offload_gradients == "nvme" and o.offload_config() == want
    assert o.zero_config(3, param_bytes=10**9).offload == want
    assert _parse("--stage", "3").offload_gradients == "device"


@pytest.mark.parametrize(("text", "value"), [("0.25", 0.25), ("1", 1.0), ("auto", "auto")])
def test_offload_fraction_reaches_the_config(text: str, value: float | str) -> None:
    o = _parse("--stage", "2", "--offload-optimizer", "cpu", "--offload-fraction", text)
    want = OffloadConfig(optimizer="cpu", optimizer_fraction=value)
    assert o.offload_fraction == value and o.zero_config(2, param_bytes=10**9).offload == want
    assert _parse().offload_fraction == 1.0


@pytest.mark.parametrize("how", ["full", "ring"])
def test_offload_host_gradients_reach_the_config(how: str) -> None:
    o = _parse("--stage", "2", "--offload-optimizer", "cpu", "--offload-host-gradients", how)
    want = OffloadConfig(optimizer="cpu", host_gradients=how)
    assert o.zero_config(2, param_bytes=10**9).offload == want
    assert _parse().offload_host_gradients == "auto"


def test_params_cpu_at_stage_3() -> None:
    o = _parse("--stage", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu")
    want = OffloadConfig(optimizer="cpu", params="cpu")
    assert o.zero_config(3, param_bytes=10**9).offload == want


def test_options_with_offload_pickle_and_report_as_plain_values() -> None:
    """The options travel to the ranks pickled, and are written into report.json."""
    o = _parse("--stage", "1", "--offload-optimizer", "cpu")
    assert pickle.loads(pickle.dumps(o)) == o
    d = o.to_dict()
    assert (d["offload_optimizer"], d["offload_params"], d["offload_dir"]) == ("cpu", "none", None)


def test_zero_config_keeps_the_bucket_rule() -> None:
    o = TrainOptions(offload_optimizer="cpu", bucket_mb=0.5)
    assert o.zero_config(1, param_bytes=10**9).bucket_bytes == 2**19
    auto = TrainOptions(offload_optimizer="cpu")
    assert auto.zero_config(1, param_bytes=13_031_424).bucket_bytes == 13_031_424 // 8


# -- usage errors: ZeroConfig's message, before any rank starts ---------------------------------


STAGE_2_GRADIENTS_ON_NVME = [
    "--stage", "2", "--offload-optimizer", "cpu", "--offload-gradients", "nvme",
    "--offload-dir", "/d",
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--stage", "0", "--offload-optimizer", "cpu"],
            "ZeroConfig.offload.optimizer='cpu' needs stage 1, 2 or 3 (stage 0 keeps the whole "
            "optimizer state on every rank): set stage >= 1",
        ),
        (
            ["--stage", "2", "--offload-params", "cpu"],
            "ZeroConfig.offload.params='cpu' needs stage 3 (only stage 3 shards the "
            "parameters); got stage 2",
        ),
        (
            ["--stage", "1", "--offload-params", "nvme", "--offload-dir", "/d"],
            "ZeroConfig.offload.params='nvme' needs stage 3 (only stage 3 shards the "
            "parameters); got stage 1",
        ),
        (
            ["--offload-dir", "/d"],
            "ZeroConfig.offload.path='/d' is only used by the 'nvme' tier, but "
            "ZeroConfig.offload.optimizer='none', ZeroConfig.offload.params='none' and "
            "ZeroConfig.offload.gradients='device': drop it or choose 'nvme'",
        ),
        (
            ["--offload-optimizer", "cpu", "--offload-dir", "/d"],
            "ZeroConfig.offload.path='/d' is only used by the 'nvme' tier, but "
            "ZeroConfig.offload.optimizer='cpu', ZeroConfig.offload.params='none' and "
            "ZeroConfig.offload.gradients='device': drop it or choose 'nvme'",
        ),
        (
            ["--offload-optimizer", "nvme"],
            "ZeroConfig.offload.path is required by the 'nvme' tier: give a directory on a "
            "local disk for the offloaded state",
        ),
        (
            ["--stage", "2", "--offload-fraction", "0.5"],
            "ZeroConfig.offload.optimizer_fraction=0.5 needs the optimizer offloaded: set "
            "ZeroConfig.offload.optimizer to 'cpu' or 'nvme', or drop it",
        ),
        (
            ["--stage", "2", "--offload-optimizer", "cpu", "--offload-fraction", "1.5"],
            "ZeroConfig.offload.optimizer_fraction must be 'auto' or a number in (0, 1] (1 "
            "offloads all of it); got 1.5",
        ),
        (
            ["--stage", "2", "--offload-optimizer", "cpu", "--offload-fraction", "half"],
            "argument --offload-fraction: not a number: 'half'",
        ),
        (
            STAGE_2_GRADIENTS_ON_NVME,
            "ZeroConfig.offload.gradients='nvme' needs stage 3 (stages 1-2 keep their gradients "
            "where the backward writes them); got stage 2",
        ),
    ],
)
def test_bad_combinations_exit_with_zeroconfigs_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert _usage_error(capsys, *argv) == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--offload-optimizer", "cpu"],
            "--offload-optimizer cpu needs stage 1, 2 or 3, but --compare-stages also trains "
            "stage 0: drop --offload-optimizer or --compare-stages",
        ),
        (
            ["--offload-optimizer", "nvme", "--offload-dir", "/d"],
            "--offload-optimizer nvme needs stage 1, 2 or 3, but --compare-stages also trains "
            "stage 0: drop --offload-optimizer or --compare-stages",
        ),
        (
            ["--offload-params", "cpu"],
            "--offload-params cpu needs stage 3, but --compare-stages also trains stages 0, 1 "
            "and 2: drop --offload-params or --compare-stages",
        ),
        (
            # Both: the optimizer flag is named first (stage 0 refuses both).
            ["--offload-optimizer", "cpu", "--offload-params", "cpu"],
            "--offload-optimizer cpu needs stage 1, 2 or 3, but --compare-stages also trains "
            "stage 0: drop --offload-optimizer or --compare-stages",
        ),
        (
            # The stage-independent rules keep ZeroConfig's message.
            ["--offload-dir", "/d"],
            "ZeroConfig.offload.path='/d' is only used by the 'nvme' tier, but "
            "ZeroConfig.offload.optimizer='none', ZeroConfig.offload.params='none' and "
            "ZeroConfig.offload.gradients='device': drop it or choose 'nvme'",
        ),
        (
            ["--offload-params", "nvme"],
            "ZeroConfig.offload.path is required by the 'nvme' tier: give a directory on a "
            "local disk for the offloaded state",
        ),
        (
            ["--offload-optimizer", "nvme", "--offload-gradients", "nvme", "--offload-dir", "/d"],
            "--offload-optimizer nvme needs stage 1, 2 or 3, but --compare-stages also trains "
            "stage 0: drop --offload-optimizer or --compare-stages",
        ),
        (
            ["--offload-optimizer", "cpu", "--offload-fraction", "0.5"],
            "--offload-optimizer cpu needs stage 1, 2 or 3, but --compare-stages also trains "
            "stage 0: drop --offload-optimizer or --compare-stages",
        ),
        (
            ["--offload-gradients", "nvme", "--offload-dir", "/d"],
            "--offload-gradients nvme needs stage 3, but --compare-stages also trains stages 0, "
            "1 and 2: drop --offload-gradients or --compare-stages",
        ),
    ],
)
def test_compare_stages_refuses_an_offload_some_stage_cannot_take(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert _usage_error(capsys, "--compare-stages", *argv) == message
    # The same message from the options themselves (what torchrun's ranks would build).
    with pytest.raises(ValueError) as err:
        _parse("--compare-stages", *argv)
    assert str(err.value) == message


def test_compare_stages_without_offload_is_accepted() -> None:
    o = _parse("--compare-stages")
    assert o.stages == (0, 1, 2, 3)
    assert [o.zero_config(s, 10**9).offload for s in o.stages] == [OffloadConfig()] * 4


def test_python_m_zerodp_apps_train_reports_the_same_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from zerodp.apps.cli.train import main as train_main

    with pytest.raises(SystemExit) as exit_:
        train_main(["--stage", "0", "--offload-optimizer", "cpu"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        "python -m zerodp.apps.train: error: ZeroConfig.offload.optimizer='cpu' needs stage "
        "1, 2 or 3 (stage 0 keeps the whole optimizer state on every rank): set stage >= 1\n"
    )
