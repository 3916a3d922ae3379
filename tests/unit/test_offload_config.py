"""``ZeroConfig.offload`` (``OffloadConfig``): every rule's exact message, the stage-dependent
rules of ``check_offload_stage``, and the dict / JSON form.

That ``zerodp.initialize`` refuses the tiers not built yet, touching nothing, is checked with a
process group in tests/dist/test_offload_refused.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from zerodp import OffloadConfig, ZeroConfig
from zerodp.config.offload import check_offload_stage
from zerodp.plan import resolve


def _message(make: Callable[[], object]) -> str:
    with pytest.raises(ValueError) as err:
        make()
    return str(err.value)


# -- OffloadConfig's own rules ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"optimizer": "gpu"},
            "ZeroConfig.offload.optimizer must be one of 'none', 'cpu', 'nvme'; got 'gpu'",
        ),
        (
            {"optimizer": None},
            "ZeroConfig.offload.optimizer must be one of 'none', 'cpu', 'nvme'; got None",
        ),
        (
            {"params": "disk"},
            "ZeroConfig.offload.params must be one of 'none', 'cpu', 'nvme'; got 'disk'",
        ),
        (
            {"gradients": "cpu"},
            "ZeroConfig.offload.gradients must be one of 'device', 'nvme'; got 'cpu'",
        ),
        (
            {"optimizer": "cpu", "gradients": "nvme"},
            "ZeroConfig.offload.path is required by the 'nvme' tier: give a directory on a "
            "local disk for the offloaded state",
        ),
        ({"ring_buckets": 0}, "ZeroConfig.offload.ring_buckets must be a positive integer; got 0"),
        (
            {"ring_buckets": -1},
            "ZeroConfig.offload.ring_buckets must be a positive integer; got -1",
        ),
        (
            {"ring_buckets": True},
            "ZeroConfig.offload.ring_buckets must be a positive integer; got True",
        ),
        (
            {"ring_buckets": 2.0},
            "ZeroConfig.offload.ring_buckets must be a positive integer; got 2.0",
        ),
        (
            {"optimizer": "nvme", "path": 5},
            "ZeroConfig.offload.path must be a directory; got 5",
        ),
        (
            {"optimizer": "nvme", "path": Path("/x")},
            "ZeroConfig.offload.path must be a directory; got PosixPath('/x')",
        ),
        (
            {"optimizer": "nvme"},
            "ZeroConfig.offload.path is required by the 'nvme' tier: give a directory on a "
            "local disk for the offloaded state",
        ),
        (
            {"params": "nvme", "path": ""},
            "ZeroConfig.offload.path is required by the 'nvme' tier: give a directory on a "
            "local disk for the offloaded state",
        ),
        (
            {"path": "/x"},
            "ZeroConfig.offload.path='/x' is only used by the 'nvme' tier, but "
            "ZeroConfig.offload.optimizer='none', ZeroConfig.offload.params='none' and "
            "ZeroConfig.offload.gradients='device': drop it or choose 'nvme'",
        ),
        (
            {"optimizer": "cpu", "params": "cpu", "path": "/x"},
            "ZeroConfig.offload.path='/x' is only used by the 'nvme' tier, but "
            "ZeroConfig.offload.optimizer='cpu', ZeroConfig.offload.params='cpu' and "
            "ZeroConfig.offload.gradients='device': drop it or choose 'nvme'",
        ),
    ],
)
def test_offload_config_rules(kwargs: dict[str, Any], message: str) -> None:
    assert _message(lambda: OffloadConfig(**kwargs)) == message


FRACTION = (
    "ZeroConfig.offload.optimizer_fraction must be 'auto' or a number in (0, 1] (1 offloads "
    "all of it); got {value!r}"
)


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.5, float("nan"), True, "half", None, "1"])
def test_optimizer_fraction_must_be_auto_or_in_0_1(value: object) -> None:
    make = partial(OffloadConfig, optimizer="cpu", optimizer_fraction=value)
    assert _message(make) == FRACTION.format(value=value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"optimizer_fraction": 0.5},
            "ZeroConfig.offload.optimizer_fraction=0.5 needs the optimizer offloaded: set "
            "ZeroConfig.offload.optimizer to 'cpu' or 'nvme', or drop it",
        ),
        (
            {"optimizer_fraction": "auto"},
            "ZeroConfig.offload.optimizer_fraction='auto' needs the optimizer offloaded: set "
            "ZeroConfig.offload.optimizer to 'cpu' or 'nvme', or drop it",
        ),
        (
            {"optimizer": "cpu", "gradients": "nvme", "path": "/x", "optimizer_fraction": 0.3},
            "ZeroConfig.offload.optimizer_fraction=0.3 keeps part of the optimizer step on the "
            "device, which reads its gradients there: set ZeroConfig.offload.gradients to "
            "'device', or the fraction to 1",
        ),
    ],
)
def test_partial_offload_rules(kwargs: dict[str, Any], message: str) -> None:
    assert _message(lambda: ZeroConfig(stage=3, offload=OffloadConfig(**kwargs))) == message


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("value", [0.25, 1, 1.0, "auto"])
def test_partial_offload_at_every_stage(stage: int, value: float | str) -> None:
    offload = OffloadConfig(optimizer="cpu", optimizer_fraction=value)
    config = ZeroConfig.from_dict(
        {"stage": stage, "offload": {"optimizer": "cpu", "optimizer_fraction": value}}
    )
    assert config.offload == offload
    assert ZeroConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("kwargs", "ring"),
    [
        ({"optimizer": "cpu"}, False),
        ({"optimizer": "nvme", "path": "/x"}, True),
        ({"optimizer": "cpu", "host_gradients": "ring"}, True),
        ({"optimizer": "nvme", "path": "/x", "host_gradients": "full"}, False),
        ({"optimizer": "cpu", "host_gradients": "full"}, False),
    ],
)
def test_host_gradients_resolve_by_tier(kwargs: dict[str, Any], ring: bool) -> None:
    assert OffloadConfig(**kwargs).host_gradient_ring is ring
    plan = resolve(ZeroConfig(stage=2, offload=OffloadConfig(**kwargs)))
    assert plan.offload_grad_ring is ring


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"host_gradients": "ring"},
            "ZeroConfig.offload.host_gradients='ring' is only used by the offloaded step, but "
            "ZeroConfig.offload.optimizer='none': drop it or offload the optimizer",
        ),
        (
            {"optimizer": "cpu", "host_gradients": "half"},
            "ZeroConfig.offload.host_gradients must be one of 'auto', 'full', 'ring'; got 'half'",
        ),
    ],
)
def test_host_gradients_rules(kwargs: dict[str, Any], message: str) -> None:
    assert _message(lambda: OffloadConfig(**kwargs)) == message


def test_valid_offload_configs() -> None:
    assert OffloadConfig() == OffloadConfig(
        optimizer="none", params="none", gradients="device", path=None, ring_buckets=4
    )
    assert not OffloadConfig().optimizer_offloaded and not OffloadConfig().params_offloaded
    cpu = OffloadConfig(optimizer="cpu", ring_buckets=1)
    assert cpu.optimizer_offloaded and not cpu.params_offloaded
    # nvme for either one takes the path; the other may then be on any tier.
    mixed = OffloadConfig(optimizer="cpu", params="nvme", path="/x")
    assert mixed.optimizer_offloaded and mixed.params_offloaded and mixed.path == "/x"


def test_offload_has_no_shorthand() -> None:
    not_a_policy: Any = "cpu"
    assert _message(lambda: ZeroConfig(offload=not_a_policy)) == (
        "ZeroConfig.offload must be a OffloadConfig; got 'cpu'"
    )


# -- the stage rules (check_offload_stage, called by ZeroConfig) ---------------------------------

OPTIMIZER_AT_STAGE_0 = (
    "ZeroConfig.offload.optimizer={tier!r} needs stage 1, 2 or 3 (stage 0 keeps the whole "
    "optimizer state on every rank): set stage >= 1"
)
PARAMS_BELOW_STAGE_3 = (
    "ZeroConfig.offload.params={tier!r} needs stage 3 (only stage 3 shards the parameters); "
    "got stage {stage}"
)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_optimizer_offload_needs_stage_1_to_3(tier: str) -> None:
    path = "/x" if tier == "nvme" else None
    offload = OffloadConfig(optimizer=tier, path=path)
    expected = OPTIMIZER_AT_STAGE_0.format(tier=tier)
    assert _message(lambda: ZeroConfig(stage=0, offload=offload)) == expected
    assert _message(lambda: check_offload_stage(offload, 0)) == expected
    for stage in (1, 2, 3):
        check_offload_stage(offload, stage)
        assert ZeroConfig(stage=stage, offload=offload).offload is offload


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_params_offload_needs_stage_3(tier: str) -> None:
    path = "/x" if tier == "nvme" else None
    offload = OffloadConfig(optimizer="cpu", params=tier, path=path)
    for stage in (1, 2):  # stage 0 names the optimizer first (the test below)
        expected = PARAMS_BELOW_STAGE_3.format(tier=tier, stage=stage)
        assert _message(partial(ZeroConfig, stage=stage, offload=offload)) == expected
        assert _message(partial(check_offload_stage, offload, stage)) == expected
    check_offload_stage(offload, 3)
    assert ZeroConfig(stage=3, offload=offload).offload is offload


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_params_offload_needs_the_optimizer_offloaded(tier: str) -> None:
    """After the stage rules (stage 2 names the stage), at any stage."""
    path = "/x" if tier == "nvme" else None
    alone = OffloadConfig(params=tier, path=path)
    expected = (
        f"ZeroConfig.offload.params={tier!r} needs the optimizer offloaded too: set "
        "ZeroConfig.offload.optimizer to 'cpu' or 'nvme' (the step writes the updates into the "
        "shards' home; fp32 masters on the device would also take more memory than the "
        "parameters offloaded)"
    )
    assert _message(partial(ZeroConfig, stage=3, offload=alone)) == expected
    plain = {"params": tier, **({"path": path} if path else {})}
    assert _message(lambda: ZeroConfig.from_dict({"stage": 3, "offload": plain})) == expected
    assert _message(partial(check_offload_stage, alone, 2)) == PARAMS_BELOW_STAGE_3.format(
        tier=tier, stage=2
    )
    for optimizer in ("cpu", "nvme"):
        nvme = "nvme" in (optimizer, tier)
        both = OffloadConfig(optimizer=optimizer, params=tier, path="/x" if nvme else None)
        assert ZeroConfig(stage=3, offload=both).offload is both


GRADIENTS_BELOW_STAGE_3 = (
    "ZeroConfig.offload.gradients='nvme' needs stage 3 (stages 1-2 keep their gradients where "
    "the backward writes them); got stage {stage}"
)
GRADIENTS_ALONE = (
    "ZeroConfig.offload.gradients='nvme' needs the optimizer offloaded too: set "
    "ZeroConfig.offload.optimizer to 'cpu' or 'nvme' (the offloaded step is what reads the "
    "gradients back from the files)"
)


def test_gradients_on_nvme_need_stage_3_and_the_optimizer_offloaded() -> None:
    for optimizer in ("cpu", "nvme"):
        offload = OffloadConfig(optimizer=optimizer, gradients="nvme", path="/x")
        assert offload.gradients_offloaded and not OffloadConfig().gradients_offloaded
        for stage in (1, 2):
            expected = GRADIENTS_BELOW_STAGE_3.format(stage=stage)
            assert _message(partial(ZeroConfig, stage=stage, offload=offload)) == expected
        assert ZeroConfig(stage=3, offload=offload).offload is offload
    alone = OffloadConfig(gradients="nvme", path="/x")
    assert _message(partial(ZeroConfig, stage=3, offload=alone)) == GRADIENTS_ALONE
    plain = {"gradients": "nvme", "path": "/x"}
    assert _message(lambda: ZeroConfig.from_dict({"stage": 3, "offload": plain})) == GRADIENTS_ALONE


def test_optimizer_rule_is_checked_before_the_params_rule() -> None:
    both = OffloadConfig(optimizer="cpu", params="cpu")
    assert _message(lambda: check_offload_stage(both, 0)) == OPTIMIZER_AT_STAGE_0.format(tier="cpu")
    assert _message(lambda: check_offload_stage(both, 1)) == PARAMS_BELOW_STAGE_3.format(
        tier="cpu", stage=1
    )


def test_without_offload_every_stage_is_accepted() -> None:
    for stage in (0, 1, 2, 3):
        check_offload_stage(OffloadConfig(), stage)
        assert ZeroConfig(stage=stage).offload == OffloadConfig()


# -- the dict and JSON form ---------------------------------------------------------------------

NVME = {"optimizer": "nvme", "params": "nvme", "gradients": "nvme", "path": "/x"}


def test_from_dict_nested_offload_and_round_trip(tmp_path: Path) -> None:
    config = ZeroConfig.from_dict({"stage": 3, "offload": dict(NVME)})
    assert config.stage == 3
    assert config.offload == OffloadConfig(
        optimizer="nvme", params="nvme", gradients="nvme", path="/x", ring_buckets=4
    )
    d = config.to_dict()
    assert d["offload"] == {
        **NVME,
        "ring_buckets": 4,
        "optimizer_fraction": 1.0,
        "host_gradients": "auto",
    }
    assert ZeroConfig.from_dict(d) == config
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(d), encoding="utf-8")
    assert ZeroConfig.from_json(path) == config


def test_partial_offload_dict_keeps_the_other_defaults() -> None:
    config = ZeroConfig.from_dict({"stage": 1, "offload": {"optimizer": "cpu"}})
    assert config.offload == OffloadConfig(optimizer="cpu")
    assert ZeroConfig.from_dict({}).offload == OffloadConfig()


def test_unknown_offload_field_is_refused() -> None:
    values = {"stage": 2, "offload": {"optimiser": "cpu", "pin_memory": True}}
    assert _message(lambda: ZeroConfig.from_dict(values)) == (
        "ZeroConfig.offload got unknown field(s) ['optimiser', 'pin_memory']; allowed fields: "
        "['gradients', 'host_gradients', 'optimizer', 'optimizer_fraction', 'params', 'path', "
        "'ring_buckets']"
    )


def test_offload_dict_is_validated_like_the_constructor() -> None:
    assert _message(lambda: ZeroConfig.from_dict({"offload": "cpu"})) == (
        "ZeroConfig.offload must be a OffloadConfig; got 'cpu'"
    )
    assert _message(
        lambda: ZeroConfig.from_dict({"stage": 2, "offload": {"params": "cpu"}})
    ) == PARAMS_BELOW_STAGE_3.format(tier="cpu", stage=2)
    assert _message(lambda: ZeroConfig.from_dict({"offload": {"params": "nvme"}})) == (
        "ZeroConfig.offload.path is required by the 'nvme' tier: give a directory on a local "
        "disk for the offloaded state"
    )
