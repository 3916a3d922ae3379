"""Stage-3 pure logic: unit selection and parameter placement, pass-order prediction, config."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from zerodp import Stage3, ZeroConfig
from zerodp.apps.models.gpt import GPT, get_config
from zerodp.params.policy import plan_units
from zerodp.params.prefetch import PassOrder
from zerodp.params.reduce import chunk_plan
from zerodp.partition.layout import ParamSpec, build_layout


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


def _labels_and_owners(model: nn.Module, **kw) -> tuple[list[str], dict[str, str]]:
    plan = plan_units(model, (), 2**14, **kw)
    labels = [u.label for u in plan.units]
    owners = {n: labels[plan.param_unit[id(p)]] for n, p in model.named_parameters()}
    return labels, owners


def test_large_leaf_modules_of_the_root_get_attached_units_by_default():
    with torch.device("meta"):
        untied = GPT(get_config("tiny", tie_embeddings=False))  # wte, lm_head: 256 x 64
    labels, owners = _labels_and_owners(untied, leaf_min_numel=2**14)
    assert labels == ["<root GPT>", "wte", "blocks.0", "blocks.1", "lm_head"]
    plan = plan_units(untied, (), 2**14, leaf_min_numel=2**14)
    assert [u.attached for u in plan.units] == [False, True, False, False, True]
    assert owners["wte.weight"] == "wte" and owners["lm_head.weight"] == "lm_head"
    assert owners["wpe.weight"] == owners["ln_f.weight"] == "<root GPT>"  # below the threshold
    # Tied (the head reads wte.weight in the root's forward): wte is still its own unit; the
    # read gathers it on demand (hooks.py). Above the threshold, or without one: the root.
    labels, owners = _labels_and_owners(_gpt(), leaf_min_numel=2**14)
    assert labels == ["<root GPT>", "wte", "blocks.0", "blocks.1"]
    assert _labels_and_owners(_gpt(), leaf_min_numel=2**14 + 1)[0][:2] == ["<root GPT>", "blocks.0"]
    assert _labels_and_owners(_gpt())[1]["wte.weight"] == "<root GPT>"
    # Only the default policy attaches leaves; named classes and policies decide alone.
    assert len(plan_units(untied, ("Block",), 0, leaf_min_numel=1).units) == 3
    assert len(plan_units(untied, (), 0, lambda n, m: False, leaf_min_numel=1).units) == 1


class _TiedLeaves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight
        self.proj = nn.Linear(8, 50)


def test_a_tied_leaf_weight_stays_in_the_root():
    """A weight registered by two leaves is owned by neither: they are not units for it."""
    model = _TiedLeaves()
    labels, owners = _labels_and_owners(model, leaf_min_numel=400)
    assert labels == ["<root _TiedLeaves>", "proj"]
    assert owners["emb.weight"] == "<root _TiedLeaves>"
    assert owners["proj.weight"] == owners["proj.bias"] == "proj"


def test_config_default_attaches_leaves_of_a_million_elements():
    assert ZeroConfig().stage3.leaf_unit_min_numel == 2**20
    match = r"ZeroConfig\.stage3\.leaf_unit_min_numel must be a non-neg"
    with pytest.raises(ValueError, match=match):
        ZeroConfig(stage=3, stage3=Stage3(leaf_unit_min_numel=-1))


def test_reduce_chunks_partition_each_bucket_into_bounded_runs():
    """[Note: stage-3 reduce chunks]: runs of at most chunk / N elements per rank, aligned,
    covering every rank's slice of every bucket exactly once."""
    layout = build_layout([ParamSpec("w", (1000,)), ParamSpec("b", (7,))], 4, 10**9, 4)
    size = layout.shard_numel  # one bucket: 1008 padded / 4 = 252 per rank
    assert chunk_plan(layout, None) == [(0, 0, size)]
    plan = chunk_plan(layout, 200)  # 200 // (4 * 4) * 4 = 48 per rank
    assert plan == [(0, off, min(48, size - off)) for off in range(0, size, 48)]
    assert sum(n for _, _, n in plan) == size and plan[-1] == (0, 240, 12)
    assert chunk_plan(layout, 1) == [(0, off, 4) for off in range(0, size, 4)]  # >= alignment
    multi = build_layout([ParamSpec("w", (1000,))], 2, 256, 4)  # stage-2 style buckets
    runs = chunk_plan(multi, 64)
    assert {b for b, _, _ in runs} == set(range(len(multi.buckets)))
    assert sum(n for _, _, n in runs) == multi.shard_numel and max(n for *_, n in runs) == 32


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
        ({"unit_classes": "Block"}, "ZeroConfig.stage3.unit_classes must be a tuple of module "),
        ({"unit_classes": ("",)}, "ZeroConfig.stage3.unit_classes must be a tuple of module "),
        ({"prefetch_depth": -1}, "ZeroConfig.stage3.prefetch_depth must be a non-negative int"),
        ({"persist_numel": 1.5}, "ZeroConfig.stage3.persist_numel must be a non-negative int"),
        (
            {"check_unit_order": 1},
            "ZeroConfig.stage3.check_unit_order must be True, False or 'exchange'",
        ),
    ],
)
def test_invalid_stage3_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(stage=3, stage3=Stage3(**kwargs))


def test_unit_classes_round_trip_through_json(tmp_path):
    cfg = ZeroConfig(stage=3, stage3=Stage3(unit_classes=("Block",), prefetch_depth=2))
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert ZeroConfig.from_json(path) == cfg
