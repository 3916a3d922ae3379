"""ZeroConfig and its nested policies: validation naming each field by its path, the dict/JSON
form, the ``precision`` shorthand, and the deprecated flat names of 0.1 ([Note: flat names])."""

from __future__ import annotations

import ast
import dataclasses
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from config_0_1 import saved_by_0_1

import zerodp
from zerodp import Activations, LossScaling, OffloadConfig, Precision, Stage3, ZeroConfig
from zerodp.config.legacy import FLAT_NAMES, nest_saved_config
from zerodp.config.nesting import Policy, policy_fields


@contextmanager
def no_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "ZeroConfig.stage must be one of 0, 1, 2, 3; got 4"),
        ({"stage": True}, "ZeroConfig.stage must be one of 0, 1, 2, 3; got True"),
        ({"bucket_bytes": 0}, "ZeroConfig.bucket_bytes must be a positive integer; got 0"),
        ({"bucket_bytes": -5}, "ZeroConfig.bucket_bytes must be a positive integer; got -5"),
        ({"bucket_bytes": True}, "ZeroConfig.bucket_bytes must be a positive integer; got True"),
        ({"broadcast_buffers": 1}, "ZeroConfig.broadcast_buffers must be True or False; got 1"),
        ({"watchdog_s": 0}, "ZeroConfig.watchdog_s must be a positive number; got 0"),
        ({"watchdog_s": float("nan")}, "ZeroConfig.watchdog_s must be a positive number; got nan"),
        (
            {"step_without_backward": "skip"},
            "ZeroConfig.step_without_backward must be one of 'warn', 'raise', 'ignore'; got 'skip'",
        ),
        (
            {"precision": "fp8"},
            "ZeroConfig.precision.compute must be one of 'fp32', 'bf16', 'fp16'; got 'fp8'",
        ),
        (
            {"precision": 16},
            "ZeroConfig.precision must be a Precision or a string (short for "
            "Precision(compute=...)); got 16",
        ),
        ({"stage3": {"prefetch_depth": 2}}, "ZeroConfig.stage3 must be a Stage3; got {"),
        ({"precision": Stage3()}, "ZeroConfig.precision must be a Precision or a string"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        ZeroConfig(**kwargs)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Precision(reduce="fp8"),
            "ZeroConfig.precision.reduce must be one of 'fp32', 'bf16', 'fp16'; got 'fp8'",
        ),
        (
            lambda: Precision(nonfinite="warn"),
            "ZeroConfig.precision.nonfinite must be one of 'raise', 'skip', 'ignore'; got 'warn'",
        ),
        (
            lambda: Precision(loss_scaling=8.0),
            "ZeroConfig.precision.loss_scaling must be a LossScaling; got 8.0",
        ),
        (
            lambda: Precision(compute="bf16", loss_scaling=LossScaling(fixed=8.0)),
            "ZeroConfig.precision.loss_scaling.fixed is only used with compute 'fp16'; got "
            "ZeroConfig.precision.compute='bf16'",
        ),
        (
            lambda: LossScaling(fixed=0.0),
            "ZeroConfig.precision.loss_scaling.fixed must be a positive number; got 0.0",
        ),
        (
            lambda: LossScaling(initial=True),
            "ZeroConfig.precision.loss_scaling.initial must be a positive number; got True",
        ),
        (
            lambda: LossScaling(growth_factor=1.0),
            "ZeroConfig.precision.loss_scaling.growth_factor must be > 1.0; got 1.0",
        ),
        (
            lambda: LossScaling(backoff_factor=1.5),
            "ZeroConfig.precision.loss_scaling.backoff_factor must be in (0, 1); got 1.5",
        ),
        (
            lambda: LossScaling(growth_interval=True),
            "ZeroConfig.precision.loss_scaling.growth_interval must be a positive integer",
        ),
        (
            lambda: LossScaling(hysteresis=0),
            "ZeroConfig.precision.loss_scaling.hysteresis must be a positive integer; got 0",
        ),
        (
            lambda: LossScaling(min_scale=-1.0),
            "ZeroConfig.precision.loss_scaling.min_scale must be a positive number; got -1.0",
        ),
        (
            lambda: Stage3(unit_classes="Block"),
            "ZeroConfig.stage3.unit_classes must be a tuple of module class names",
        ),
        (
            lambda: Stage3(prefetch_depth=-1),
            "ZeroConfig.stage3.prefetch_depth must be a non-negative integer; got -1",
        ),
        (
            lambda: Stage3(keep_last_units=-1),
            "ZeroConfig.stage3.keep_last_units must be a non-negative integer; got -1",
        ),
        (
            lambda: Stage3(skip_backward_gathers=1),
            "ZeroConfig.stage3.skip_backward_gathers must be True or False; got 1",
        ),
        (
            lambda: Stage3(persist_numel=False),
            "ZeroConfig.stage3.persist_numel must be a non-negative integer; got False",
        ),
        (
            lambda: Activations(checkpoint="Block"),
            "ZeroConfig.activations.checkpoint must be a tuple of module class names; got 'Block'",
        ),
        (
            lambda: Activations(checkpoint=("Block",), offload="disk"),
            "ZeroConfig.activations.offload must be one of 'none', 'cpu'; got 'disk'",
        ),
        (
            lambda: Stage3(check_unit_order=1),
            "ZeroConfig.stage3.check_unit_order must be True, False or 'exchange'; got 1",
        ),
    ],
)
def test_policies_check_their_fields_at_construction(make: Any, message: str) -> None:
    """A policy is checked where it is built, and names its field by the path ZeroConfig
    holds it at."""
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value).startswith(message)


def test_fixed_loss_scale_with_fp16() -> None:
    config = ZeroConfig(precision=Precision(compute="fp16", loss_scaling=LossScaling(fixed=8.0)))
    assert config.precision.loss_scaling.fixed == 8.0


def test_paths_are_where_zero_config_holds_each_policy() -> None:
    """``Policy.PATH`` (used in every message) agrees with the nesting, for every policy."""

    def walk(cls: type[Policy], path: str) -> Iterator[tuple[type[Policy], str]]:
        yield cls, path
        for name, sub in policy_fields(cls).items():
            yield from walk(sub, f"{path}.{name}")

    found = dict(walk(ZeroConfig, "ZeroConfig"))
    assert found == {
        ZeroConfig: "ZeroConfig",
        Precision: "ZeroConfig.precision",
        LossScaling: "ZeroConfig.precision.loss_scaling",
        Stage3: "ZeroConfig.stage3",
        OffloadConfig: "ZeroConfig.offload",
        Activations: "ZeroConfig.activations",
    }
    assert all(path == cls.PATH for cls, path in found.items())


def test_type_checkers_see_the_fields() -> None:
    """ZeroConfig's ``if TYPE_CHECKING`` ``__init__`` (for the precision shorthand) lists
    exactly its fields, in order."""
    source = Path(zerodp.config.zero.__file__).read_text(encoding="utf-8")
    inits = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    ]
    assert len(inits) == 1
    params = [a.arg for a in inits[0].args.kwonlyargs]
    assert params == [f.name for f in dataclasses.fields(ZeroConfig)]


# -- the precision shorthand --------------------------------------------------------------------


def test_precision_string_is_short_for_the_policy() -> None:
    with no_warnings():
        short = ZeroConfig(precision="bf16")
        from_dict = ZeroConfig.from_dict({"precision": "bf16"})
    assert short == from_dict == ZeroConfig(precision=Precision(compute="bf16"))
    assert isinstance(short.precision, Precision) and short.precision.compute == "bf16"
    assert short.to_dict()["precision"] == dataclasses.asdict(Precision(compute="bf16"))


def test_defaults_are_policies() -> None:
    config = ZeroConfig()
    assert config.precision == Precision() and config.stage3 == Stage3()
    assert config.precision.loss_scaling == LossScaling()


# -- the dict and JSON form ---------------------------------------------------------------------

NON_DEFAULT = ZeroConfig(
    stage=3,
    bucket_bytes=1024,
    broadcast_buffers=False,
    overlap_param_gather=False,
    watchdog_s=None,
    step_without_backward="raise",
    precision=Precision(
        compute="fp16",
        reduce="bf16",
        nonfinite="skip",
        loss_scaling=LossScaling(
            fixed=128.0,
            initial=8.0,
            growth_factor=3.0,
            backoff_factor=0.25,
            growth_interval=7,
            hysteresis=3,
            min_scale=0.5,
        ),
    ),
    stage3=Stage3(
        unit_classes=("Block", "Embedding"),
        unit_min_numel=5,
        leaf_unit_min_numel=6,
        prefetch_depth=2,
        keep_last_units=3,
        skip_backward_gathers=False,
        persist_numel=100,
        check_unit_order=False,
    ),
    offload=OffloadConfig(
        optimizer="nvme",
        params="nvme",
        gradients="nvme",
        path="/tmp/zerodp",
        ring_buckets=2,
        host_gradients="full",
    ),
    activations=Activations(checkpoint=("Block",), offload="cpu", on_device=3),
)
# Partial offload keeps gradients on the device, and partitioned checkpoints stay on it: their
# fields are set in a second configuration.
PARTIAL = dataclasses.replace(
    NON_DEFAULT,
    offload=OffloadConfig(
        optimizer="nvme", params="nvme", optimizer_fraction="auto", path="/tmp/zerodp"
    ),
    activations=Activations(checkpoint=("Block",), partition=True, on_device=3),
)


def test_every_field_of_the_round_trip_config_is_not_its_default() -> None:
    def leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    given, default = leaves(NON_DEFAULT.to_dict()), leaves(ZeroConfig().to_dict())
    partial = leaves(PARTIAL.to_dict())
    assert given.keys() == default.keys() == partial.keys()
    assert [k for k in given if given[k] == default[k] and partial[k] == default[k]] == []
    assert [k for k in given if given[k] == default[k]] == [
        "offload.optimizer_fraction",
        "activations.partition",
    ]


@pytest.mark.parametrize("config", [NON_DEFAULT, PARTIAL], ids=["all", "partial"])
def test_to_dict_is_nested_and_round_trips(tmp_path: Path, config: ZeroConfig) -> None:
    d = config.to_dict()
    assert d["precision"]["loss_scaling"]["hysteresis"] == 3
    assert d["stage3"]["prefetch_depth"] == 2
    with no_warnings():
        assert ZeroConfig.from_dict(d) == config
        path = tmp_path / "zero.json"
        path.write_text(json.dumps(d))  # tuples become lists
        assert ZeroConfig.from_json(path) == config


def test_frozen() -> None:
    config = ZeroConfig(stage=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.precision.compute = "bf16"  # type: ignore[misc]


def test_partial_nested_dicts_keep_the_other_defaults() -> None:
    config = ZeroConfig.from_dict({"precision": {"loss_scaling": {"hysteresis": 1}}})
    assert config == ZeroConfig(precision=Precision(loss_scaling=LossScaling(hysteresis=1)))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"stag": 2}, "ZeroConfig got unknown field(s) ['stag']; allowed fields: ['activations"),
        (
            {"precision": {"compute": "bf16", "reduce_dtype": "fp32"}},
            "ZeroConfig.precision got unknown field(s) ['reduce_dtype']; allowed fields: "
            "['compute', 'loss_scaling', 'nonfinite', 'reduce']",
        ),
        (
            {"precision": {"loss_scaling": {"scale": 2.0}}},
            "ZeroConfig.precision.loss_scaling got unknown field(s) ['scale']; allowed fields: "
            "['backoff_factor', 'fixed', 'growth_factor', 'growth_interval', 'hysteresis', "
            "'initial', 'min_scale']",
        ),
        (
            {"stage3": {"prefetch": 2}},
            "ZeroConfig.stage3 got unknown field(s) ['prefetch']; allowed fields: "
            "['check_unit_order', 'keep_last_units', 'leaf_unit_min_numel', 'persist_numel', "
            "'prefetch_depth', 'skip_backward_gathers', "
            "'unit_classes', 'unit_min_numel']",
        ),
        ({"stage3": 2}, "ZeroConfig.stage3 must be a Stage3; got 2"),
        (
            {"precision": {"reduce": "fp8"}},
            "ZeroConfig.precision.reduce must be one of 'fp32', 'bf16', 'fp16'; got 'fp8'",
        ),
    ],
)
def test_from_dict_rejects_unknown_keys_and_bad_values_at_every_level(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_dict(values)
    assert str(err.value).startswith(message)


def test_unknown_top_level_keys_list_the_new_names_only() -> None:
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_dict({"stag": 2})
    allowed = sorted(ZeroConfig().to_dict())
    assert str(err.value) == f"ZeroConfig got unknown field(s) ['stag']; allowed fields: {allowed}"
    assert "precision" in allowed and "reduce_dtype" not in allowed


# -- the flat names of 0.1 ----------------------------------------------------------------------

# flat name, a value, the same config spelt nested, the new spelling the warning gives
FLAT = [
    ("reduce_dtype", "bf16", {"precision": Precision(reduce="bf16")}, "Precision(reduce=...)"),
    ("nonfinite", "skip", {"precision": Precision(nonfinite="skip")}, "Precision(nonfinite=...)"),
    (
        "initial_scale",
        8.0,
        {"precision": Precision(loss_scaling=LossScaling(initial=8.0))},
        "Precision(loss_scaling=LossScaling(initial=...))",
    ),
    (
        "growth_factor",
        4.0,
        {"precision": Precision(loss_scaling=LossScaling(growth_factor=4.0))},
        "LossScaling(growth_factor=...)",
    ),
    (
        "backoff_factor",
        0.25,
        {"precision": Precision(loss_scaling=LossScaling(backoff_factor=0.25))},
        "LossScaling(backoff_factor=...)",
    ),
    (
        "growth_interval",
        10,
        {"precision": Precision(loss_scaling=LossScaling(growth_interval=10))},
        "LossScaling(growth_interval=...)",
    ),
    (
        "hysteresis",
        1,
        {"precision": Precision(loss_scaling=LossScaling(hysteresis=1))},
        "LossScaling(hysteresis=...)",
    ),
    (
        "min_loss_scale",
        0.5,
        {"precision": Precision(loss_scaling=LossScaling(min_scale=0.5))},
        "LossScaling(min_scale=...)",
    ),
    ("unit_classes", ("Block",), {"stage3": Stage3(unit_classes=("Block",))}, "Stage3("),
    ("unit_min_numel", 7, {"stage3": Stage3(unit_min_numel=7)}, "Stage3(unit_min_numel=...)"),
    (
        "leaf_unit_min_numel",
        8,
        {"stage3": Stage3(leaf_unit_min_numel=8)},
        "Stage3(leaf_unit_min_numel=...)",
    ),
    ("prefetch_depth", 2, {"stage3": Stage3(prefetch_depth=2)}, "Stage3(prefetch_depth=...)"),
    ("persist_numel", 9, {"stage3": Stage3(persist_numel=9)}, "Stage3(persist_numel=...)"),
    (
        "check_unit_order",
        False,
        {"stage3": Stage3(check_unit_order=False)},
        "Stage3(check_unit_order=...)",
    ),
]


def test_the_table_covers_every_flat_name() -> None:
    assert sorted(name for name, *_ in FLAT) == sorted(set(FLAT_NAMES) - {"loss_scale"})


@pytest.mark.parametrize(("name", "value", "nested", "spelling"), FLAT)
def test_flat_name_in_the_constructor(name: str, value: Any, nested: Any, spelling: str) -> None:
    with pytest.warns(DeprecationWarning) as record:
        config = ZeroConfig(stage=3, **{name: value})
    assert config == ZeroConfig(stage=3, **nested)
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith(
        f"ZeroConfig({name}=...) is deprecated and will be removed in the next release; "
        f"use ZeroConfig({next(iter(nested))}="
    )
    assert spelling in message
    assert record[0].filename == __file__  # the warning points at the caller


@pytest.mark.parametrize(("name", "value", "nested", "spelling"), FLAT)
def test_flat_name_in_from_dict(name: str, value: Any, nested: Any, spelling: str) -> None:
    with pytest.warns(DeprecationWarning) as record:
        config = ZeroConfig.from_dict({"stage": 3, name: value})
    assert config == ZeroConfig(stage=3, **nested)
    assert len(record) == 1
    assert str(record[0].message).startswith(
        f'ZeroConfig key "{name}" is deprecated and will be removed in the next release; '
        f'use {{"{FLAT_NAMES[name][0]}": {{"'
    )
    assert record[0].filename == __file__


@pytest.mark.parametrize(("name", "value", "nested", "spelling"), FLAT)
def test_reading_a_flat_name(name: str, value: Any, nested: Any, spelling: str) -> None:
    config = ZeroConfig(stage=3, **nested)
    with pytest.warns(DeprecationWarning) as record:
        assert getattr(config, name) == value
    path = ".".join(FLAT_NAMES[name])
    assert [str(r.message) for r in record] == [
        f"ZeroConfig.{name} is deprecated and will be removed in the next release; "
        f"read ZeroConfig.{path}"
    ]
    with pytest.raises(AttributeError, match="'ZeroConfig' object has no attribute 'reduce'"):
        config.reduce  # type: ignore[attr-defined]  # noqa: B018


def test_flat_loss_scale_with_the_precision_string() -> None:
    """The 0.1 way: ``precision`` as a string plus flat precision names, one warning each."""
    with pytest.warns(DeprecationWarning) as record:
        config = ZeroConfig(precision="fp16", loss_scale=8.0, hysteresis=1, prefetch_depth=0)
    assert [str(r.message).split(" is ")[0] for r in record] == [
        "ZeroConfig(loss_scale=...)",
        "ZeroConfig(hysteresis=...)",
        "ZeroConfig(prefetch_depth=...)",
    ]
    assert "use ZeroConfig(precision=Precision(loss_scaling=LossScaling(fixed=...)))" in str(
        record[0].message
    )
    assert config == ZeroConfig(
        precision=Precision(compute="fp16", loss_scaling=LossScaling(fixed=8.0, hysteresis=1)),
        stage3=Stage3(prefetch_depth=0),
    )
    with pytest.warns(DeprecationWarning, match=r"ZeroConfig key \"loss_scale\" is dep"):
        assert ZeroConfig.from_dict({"precision": "fp16", "loss_scale": 8.0}) == ZeroConfig(
            precision=Precision(compute="fp16", loss_scaling=LossScaling(fixed=8.0))
        )
    with pytest.warns(DeprecationWarning, match="read ZeroConfig.precision.loss_scaling.fixed"):
        assert config.loss_scale == 8.0
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError) as err:
        ZeroConfig(loss_scale=8.0)  # fp32: as in 0.1, a fixed scale needs fp16
    assert "ZeroConfig.precision.loss_scaling.fixed is only used with compute 'fp16'" in str(
        err.value
    )


def test_flat_values_are_checked_at_their_new_path() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError) as err:
        ZeroConfig(reduce_dtype="fp8")
    assert str(err.value).startswith("ZeroConfig.precision.reduce must be one of")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"reduce_dtype": "bf16", "precision": Precision(compute="bf16")},
            "ZeroConfig got both reduce_dtype (deprecated) and precision, which holds it: give "
            "only precision, with the value of reduce_dtype in it: "
            "ZeroConfig(precision=Precision(reduce=...))",
        ),
        (
            {"precision": Precision(), "min_loss_scale": 2.0},
            "ZeroConfig got both min_loss_scale (deprecated) and precision",
        ),
        (
            {"stage3": Stage3(), "prefetch_depth": 2},
            "ZeroConfig got both prefetch_depth (deprecated) and stage3, which holds it",
        ),
    ],
)
def test_flat_name_with_its_policy_is_refused(given: dict[str, Any], message: str) -> None:
    with no_warnings(), pytest.raises(ValueError) as err:  # refused before any warning
        ZeroConfig(**given)
    assert str(err.value).startswith(message)


def test_flat_name_with_its_nested_dict_is_refused() -> None:
    values = {"precision": {"compute": "bf16"}, "reduce_dtype": "bf16"}
    with no_warnings(), pytest.raises(ValueError) as err:
        ZeroConfig.from_dict(values)
    assert str(err.value) == (
        "ZeroConfig got both reduce_dtype (deprecated) and precision, which holds it: give only "
        'precision, with the value of reduce_dtype in it: {"precision": {"reduce": ...}}'
    )


# A ZeroConfig.to_dict() of zerodp 0.1 (flat), as checkpoint manifests of 0.1 hold it.
SAVED_BY_0_1 = saved_by_0_1(
    stage=3,
    bucket_bytes=4096,
    precision="fp16",
    initial_scale=1024.0,
    unit_classes=["GPT2Block"],
)


def test_a_config_saved_by_0_1_reads_as_nested_without_warnings() -> None:
    expected = ZeroConfig(
        stage=3,
        bucket_bytes=4096,
        precision=Precision(compute="fp16", loss_scaling=LossScaling(initial=1024.0)),
        stage3=Stage3(unit_classes=("GPT2Block",)),
    )
    with no_warnings():
        nested = nest_saved_config(ZeroConfig, SAVED_BY_0_1)
        assert ZeroConfig.from_dict(nested) == expected
    later = {"offload", "activations"}  # policies added after 0.1: their defaults
    want = {k: v for k, v in expected.to_dict().items() if k not in later}
    for field in ("keep_last_units", "skip_backward_gathers"):  # added after 0.1: defaults
        want["stage3"].pop(field)
    assert json.loads(json.dumps(nested)) == json.loads(json.dumps(want))
    with pytest.warns(DeprecationWarning) as record:  # a user's flat dict: warned, name by name
        assert ZeroConfig.from_dict(SAVED_BY_0_1) == expected
    assert len(record) == len(SAVED_BY_0_1) - 7  # all but the 6 kept fields and precision
