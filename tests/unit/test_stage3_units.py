"""Stage-3 pure logic: unit selection and parameter placement, pass-order prediction, config."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from zerodp import ZeroConfig
from zerodp.models.gpt import GPT, get_config
from zerodp.params.policy import plan_units
from zerodp.params.prefetch import PassOrder


def _gpt() -> nn.Module:
    with torch.device("meta"):
        return GPT(get_config("tiny"))


def test_default_policy_makes_each_transformer_block_a_unit():
    plan = plan_units(_gpt(), (), 2**14)
    assert [u.label for u in plan.units] == ["<root GPT>", "blocks.0", "blocks.1"]
    model = plan.units[0].module
    by_name = {n: plan.param_unit[id(p)] for n, p in model.named_parameters()}
    assert by_name["wte.weight"] == by_name["ln_f.bias"] == 0
    assert by_name["blocks.1.mlp.c_proj.weight"] == 2
    assert plan.ancestors(2) == [0]


def test_size_threshold_and_class_names():
    assert len(plan_units(_gpt(), (), 10**9).units) == 1  # blocks too small: root only
    plan = plan_units(_gpt(), ("Block", "MLP"), 10**9)  # named classes: any size, nested
    labels = [u.label for u in plan.units]
    assert labels == ["<root GPT>", "blocks.0", "blocks.0.mlp", "blocks.1", "blocks.1.mlp"]
    assert plan.units[2].parent == 1 and plan.ancestors(2) == [1, 0]


def test_a_policy_callable_overrides_the_config():
    plan = plan_units(_gpt(), ("Block",), 0, policy=lambda name, m: name == "wte")
    assert [u.label for u in plan.units] == ["<root GPT>", "wte"]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(5, 4), nn.Linear(4, 4), nn.Linear(4, 5)])
        self.layers[2].weight = self.layers[0].weight


def test_a_tied_parameter_goes_to_the_common_enclosing_unit():
    model = _Tied()
    plan = plan_units(model, (), 1)
    assert [u.label for u in plan.units] == ["<root _Tied>", "layers.0", "layers.1", "layers.2"]
    assert plan.param_unit[id(model.layers[0].weight)] == 0  # embedding and head: the root
    assert plan.param_unit[id(model.layers[1].weight)] == 2
    assert plan.param_unit[id(model.layers[2].bias)] == 3


def test_pass_order_predicts_from_the_previous_pass():
    order = PassOrder(depth=2)
    order.begin()
    assert [order.visit(u) for u in (1, 2, 3, 4)] == [[], [], [], []]  # nothing recorded yet
    order.end()
    order.begin()
    assert order.visit(1) == [2, 3]
    assert order.visit(3) == [4]  # 2 was skipped: the record is followed from where 3 is
    assert order.visit(2) == [3, 4]  # out of order: found behind the cursor
    order.end()
    assert order.last == [1, 3, 2]


def test_pass_order_follows_repeats_and_uses_a_guess():
    order = PassOrder(depth=1)
    order.begin(guess=[5, 6, 5, 7])
    assert [order.visit(u) for u in (5, 6, 5, 7)] == [[6], [5], [7], []]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"unit_classes": "Block"}, "ZeroConfig.unit_classes must be a tuple of module class"),
        ({"unit_classes": ("",)}, "ZeroConfig.unit_classes must be a tuple of module class"),
        ({"prefetch_depth": -1}, "ZeroConfig.prefetch_depth must be a non-negative integer"),
        ({"persist_numel": 1.5}, "ZeroConfig.persist_numel must be a non-negative integer"),
        ({"check_unit_order": 1}, "ZeroConfig.check_unit_order must be True or False"),
    ],
)
def test_invalid_stage3_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(stage=3, **kwargs)


def test_unit_classes_round_trip_through_json(tmp_path):
    cfg = ZeroConfig(stage=3, unit_classes=("Block",), prefetch_depth=2)
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert ZeroConfig.from_json(path) == cfg
