"""DeepSpeed ZeRO-3 scenarios (leaf modules, parameter access, zero.Init, GatheredParameters,
config) rewritten with zerodp's public API: world size 2, gloo, against unsharded training or
exact error messages. docs/peer-tests-deepspeed.part.md maps each to its DeepSpeed test.
"""

from __future__ import annotations

import pytest
import torch
from ds_models import (
    ChooseByCounter,
    ChooseByRank,
    ConvNet,
    DanglingContainer,
    ExtLinear,
    FineGrained,
    Layers,
    ParentInitialisesChild,
    Scale,
    ValueInConstructor,
    WithAttrs,
)
from hf_models import build as build_hf
from hf_models import global_batches, hf_loss
from test_deepspeed_scenarios import ADAM, adamw, cfg, labelled, train
from torch import nn
from zerotest import Pair, batches, build, make_pair, mse, rank_world

import zerodp

TIMEOUT = 120.0
RELEASED = "zerodp stage 3: parameter 'linear1.weight' was read (linear) while its unit 'linear1' "


# -- test_zero_leaf_module ------------------------------------------------------------------------


def case_leaf_modules() -> str:
    _, world = rank_world()
    for units in [("Linear",), ()]:  # a unit per layer (one skipped per step) / one unit
        for x_grad in (False, True):  # DeepSpeed refuses inputs without grad for leaf modules
            pair = make_pair(ChooseByCounter, adamw, cfg(3, units))

            def losses_at(step: int, x_grad=x_grad, ref=pair.ref):
                data = labelled(step, world, 2, 8)

                def loss(m, r):
                    x, y = data[r]
                    if m is ref and r > 0:  # one reference forward per step counts
                        m.counter -= 1
                    return m(x.clone().requires_grad_(x_grad), y)

                return loss

            train(pair, losses_at, 4, ADAM, f"counter units={units} x_grad={x_grad}")
    # Each rank runs another layer: with one unit for the whole model, and with a unit per
    # layer (each rank gathers the other's layer as an extra: [Note: merged plans]).
    for units in [(), ("Linear",)]:
        pair = make_pair(ChooseByRank, adamw, cfg(3, units))

        def by_rank(step: int):
            data = labelled(step, world, 2, 8)
            return lambda m, r: m(*data[r], r)

        train(pair, by_rank, 3, ADAM, f"by rank, units={units}")
    return "finished"


def test_leaf_modules_choose_layer_by_counter_or_rank(world):
    """A layer chosen per step or per rank trains like unsharded training, with one unit or a
    unit per layer (DeepSpeed needs its leaf-module API for the latter)."""
    assert world(2).run(case_leaf_modules, timeout=TIMEOUT) == ["finished", "finished"]


def case_granularity() -> list[list[float]]:
    """``TestZ3LeafOptimization``: the unit granularity changes nothing in the numbers."""
    rank, world = rank_world()
    runs = []
    for stage, units in [
        (0, ()),
        (3, ()),
        (3, ("FineGrainedBlock",)),
        (3, ("MLPBlock",)),
        (3, ("Linear",)),
        (3, ("MLPBlock", "FineGrainedBlock")),
    ]:
        torch.manual_seed(0)
        model = FineGrained()
        model, opt = zerodp.initialize(model, adamw(list(model.parameters())), cfg(stage, units))
        losses = []
        for step in range(3):
            loss = model(*labelled(step, world, 2, 8)[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append(losses)
    return runs


def test_unit_granularity_gives_identical_losses(world):
    for runs in world(2).run(case_granularity, timeout=TIMEOUT):
        assert all(r == runs[0] for r in runs), runs


# -- test_zero_context: external parameter use, GatheredParameters -----------------------------


def case_external_param() -> str:
    rank, world = rank_world()

    def losses(step: int):
        data = batches(step, world, 2, [(16,), (16,)])
        return mse(data)

    # linear1 in the root unit (default policy), or attached (its own unit, gathered on demand).
    for kw in [{}, {"leaf_unit_min_numel": 0}]:
        pair = make_pair(ExtLinear, adamw, cfg(3, **kw))
        train(pair, losses, 3, ADAM, f"external use {kw}")
    # A unit of its own that is not attached: the read is refused.
    pair = make_pair(ExtLinear, adamw, cfg(3, ("Linear",)))
    try:
        losses(0)(pair.model, rank)
    except RuntimeError as exc:
        return str(exc)
    return "finished"


def test_parameter_used_outside_its_module(world):
    for msg in world(2).run(case_external_param, timeout=TIMEOUT):
        assert msg.startswith(RELEASED + "is released"), msg


def case_returned_param() -> str:
    rank, world = rank_world()
    losses = lambda s: mse(batches(s, world, 2, [(16,), (16,)]))  # noqa: E731
    pair = make_pair(DanglingContainer, adamw, cfg(3, ()))  # one unit: allowed
    train(pair, losses, 3, ADAM, "dangling, one unit")
    pair = make_pair(DanglingContainer, adamw, cfg(3, ("DanglingBias",)))
    try:
        losses(0)(pair.model, rank)
    except RuntimeError as exc:
        return str(exc)
    return "finished"


def test_unit_returning_its_own_parameter(world):
    """``test_zero_context_return``: a unit returns its bias and the parent adds it. DeepSpeed
    tracks such "external" parameters; zerodp trains it when the parent's unit holds the bias
    and refuses the read (clear error) when the bias's unit was released."""
    for msg in world(2).run(case_returned_param, timeout=TIMEOUT):
        prefix = "zerodp stage 3: parameter 'dangler.bias' was read (add) while its unit "
        assert msg.startswith(prefix + "'dangler' is released"), msg


def case_modifier_rank(stage: int) -> str:
    """``TestGatherUpdate`` (GatheredParameters(modifier_rank=1)) and
    ``TestZeroGatheredParametersFree``: rank 1's edit reaches every rank and the masters."""
    rank, world = rank_world()
    pair = make_pair(Layers, adamw, cfg(stage, ("Linear",)))
    with zerodp.full_parameters(pair.model, rank=1):
        if rank == 1:
            with torch.no_grad():
                pair.model.linears[1].weight.zero_()
    with torch.no_grad():
        pair.ref.linears[1].weight.zero_()
    with zerodp.full_parameters(pair.model, writeback=False):
        assert torch.equal(pair.model.linears[1].weight, torch.zeros(6, 6)), "edit lost"
    train(pair, lambda s: mse(batches(s, world, 3, [(6,), (3,)])), 2, ADAM, "after edit")
    try:
        pair.model.linears[1].weight.sum()
    except RuntimeError as exc:
        return str(exc)
    return "readable"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_parameters_edit_by_one_rank(world, stage):
    msgs = world(2).run(case_modifier_rank, stage, timeout=TIMEOUT)
    for msg in msgs:
        if stage == 3:  # released again after the block
            prefix = "zerodp stage 3: parameter 'linears.1.weight' was read"
            assert msg.startswith(prefix) and "'linears.1' is released" in msg, msg
        else:
            assert msg == "readable", msg


# -- TestZero3SwitchModes, TestZero3ClientModuleID / TestDSInitWZinit ---------------------------


def case_switch_modes(depth: int) -> float:
    rank, world = rank_world()
    pair = make_pair(Layers, adamw, cfg(3, ("Linear",), prefetch_depth=depth))
    for epoch in range(2):
        pair.model.train()
        data = [batches(10 * epoch + s, world, 2, [(6,), (3,)]) for s in range(2)]
        train(pair, lambda s, data=data: mse(data[s]), 2, ADAM, f"train {epoch}")
        pair.model.eval()
        with torch.no_grad():
            for step in range(2):
                x = batches(100 + step, world, 2, [(6,)])[rank][0]
                assert torch.allclose(pair.model(x), pair.ref(x), rtol=1e-5, atol=1e-6), "eval"
    return 0.0


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_train_eval_switch(world, depth):
    world(2).run(case_switch_modes, depth, timeout=TIMEOUT)


def case_attributes(stage: int) -> tuple:
    model = build(WithAttrs)
    model, _ = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg(stage))
    return model.id, model.magic(), isinstance(model, WithAttrs)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_user_attributes_and_methods_survive(world, stage):
    assert world(2).run(case_attributes, stage, timeout=TIMEOUT) == [(3, 42, True)] * 2


# -- zero.Init (test_zero_context*, test_zero_nesting_init, test_zero_dynamic_class) ------------


def case_sharded_init(units: tuple[str, ...]) -> float:
    _, world = rank_world()
    eager = build(Layers)
    torch.manual_seed(0)
    with zerodp.sharded_init(), zerodp.sharded_init():  # nested, as DeepSpeed's nesting tests

        class Local(Layers):  # a class declared inside the context
            pass

        model = Local()
    model, opt = zerodp.initialize(model, adamw(list(model.parameters())), cfg(3, units))
    with zerodp.full_parameters(model, writeback=False):
        for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
            assert torch.equal(p.detach(), q.detach()), f"{n} differs from the eager build"
    pair = Pair(model, opt, eager, adamw(list(eager.parameters())))
    return train(pair, lambda s: mse(batches(s, world, 2, [(6,), (3,)])), 2, ADAM, "sharded")


@pytest.mark.parametrize("units", [(), ("Linear",)])
def test_sharded_init_equals_eager_build(world, units):
    world(2).run(case_sharded_init, units, timeout=TIMEOUT)


REFUSED = {"value": ValueInConstructor, "parent": ParentInitialisesChild}


def case_sharded_init_refused(kind: str) -> str:
    with zerodp.sharded_init():
        model = REFUSED[kind]()
    try:
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg(3))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_sharded_init_parameter_without_initialiser_is_a_clear_error(world):
    """``TestSerialParamInit``: ``nn.Parameter(torch.ones(5) + 1)`` in ``__init__`` of a module
    without ``reset_parameters`` came out as zeros, silently; now refused with the fix."""
    want = (
        "zerodp.initialize: a model built under zerodp.sharded_init() has modules with "
        "parameters but no reset_parameters() (ValueInConstructor, in unit '<root "
        "ValueInConstructor>'), and the unit has no init_weights(): values set in __init__ are "
        "not kept on the meta device. Pass init_fn=<function initialising a unit's module> to "
        "zerodp.initialize, or give those modules a reset_parameters()"
    )
    assert world(2).run(case_sharded_init_refused, "value", timeout=TIMEOUT) == [want, want]


def test_sharded_init_parent_initialising_its_child_is_a_clear_error(world):
    """``TestZero3InitForParentWeightInitialization``: the parent's ``fill_`` of its child's
    weight in ``__init__`` wrote nothing on the meta device, and the child's
    ``reset_parameters`` ran at ``initialize`` instead, silently; now refused, naming the
    parameter ([Note: values written in a constructor])."""
    want = (
        "zerodp.initialize: a constructor under zerodp.sharded_init() wrote parameter(s) "
        "['linear.weight'] outside reset_parameters()/init_weights(); the meta device keeps no "
        "values, so they would be lost. Write them in the module's reset_parameters() or "
        "init_weights(), or pass init_fn=... that does"
    )
    assert world(2).run(case_sharded_init_refused, "parent", timeout=TIMEOUT) == [want, want]


def case_legacy_constructor() -> str:
    torch.manual_seed(0)
    with zerodp.sharded_init():
        model = ConvNet()
        model.conv1.param_in = nn.Parameter(torch.FloatTensor(5).uniform_())  # legacy: on cpu
    try:
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg(3))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_sharded_init_subclass_parameter_from_legacy_constructor(world):
    """``ConvX``'s ``torch.FloatTensor(5).uniform_()`` escapes the meta device: refused."""
    for r, msg in enumerate(world(2).run(case_legacy_constructor, timeout=TIMEOUT)):
        line = (
            f"  rank {r}: the model's parameters are on several devices ['cpu', 'meta']: zerodp "
            "data parallelism needs the whole model on this rank's one device"
        )
        assert line in msg.splitlines(), msg


# -- TestZeroBf16Fp32GradAccum --------------------------------------------------------------------


def case_bf16_fp32_reduce(stage: int) -> list[float]:
    """bf16 gradients 1.0 and 1.0078125 averaged in fp32: 1.00390625 (not a bf16 value), so SGD
    with lr 1 moves the fp32 master from 1 to exactly -0.00390625."""
    rank, _ = rank_world()
    model = Scale()
    config = cfg(stage, precision=zerodp.Precision(compute="bf16", reduce="fp32"))
    model, opt = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), config)
    x = torch.full((4,), 1.0 if rank == 0 else 1.0078125, dtype=torch.bfloat16)
    model(x).backward()
    opt.step()
    with zerodp.full_parameters(model, writeback=False):
        return model.weight.float().tolist()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_gradients_averaged_in_fp32_stored_in_bf16(world, stage):
    """DeepSpeed ``TestZeroBf16Fp32GradAccum`` expects the fp32 average 1.00390625 to reach the
    step (``grad_accum_dtype=fp32``). zerodp sums in fp32 and stores the average back in the
    compute dtype (docs/design.md, [Note: mixed precision]: 2 bytes of gradient per parameter,
    the paper's accounting), so the step sees bf16(1.00390625) = 1.0 and the weight lands on
    exactly 0.0: a documented difference, asserted exactly so that a change is noticed."""
    for w in world(2).run(case_bf16_fp32_reduce, stage, timeout=TIMEOUT):
        assert w == [0.0] * 4, w


# -- Hugging Face: frozen embeddings, one param group over every block --------------------------


def case_hf_frozen(stage: int) -> float:
    _, world = rank_world()

    def factory():
        m = build_hf("gpt2")
        m.transformer.wpe.requires_grad_(False)
        return m

    # eps 1e-6 as in tests/dist/test_hf_models.py: Adam amplifies rounding noise on tiny grads.
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-6)  # noqa: E731
    pair = make_pair(factory, opt, cfg(stage, ("GPT2Block",), bucket_bytes=4096))
    return train(pair, lambda s: hf_loss(global_batches("gpt2", s, world)), 2, ADAM, "gpt2")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hf_gpt2_frozen_position_embedding(world, stage):
    world(2).run(case_hf_frozen, stage, timeout=TIMEOUT)


# -- test_zero_config -------------------------------------------------------------------------


BAD_VALUES = [
    ({"bucket_bytes": 0}, "bucket_bytes", "must be a positive integer; got 0"),
    ({"stage": 4}, "stage", "must be one of 0, 1, 2, 3; got 4"),
    (
        {"stage3": {"prefetch_depth": -1}},
        "stage3.prefetch_depth",
        "must be a non-negative integer; got -1",
    ),
    (
        {"stage3": {"persist_numel": 1.5}},
        "stage3.persist_numel",
        "must be a non-negative integer; got 1.5",
    ),
    ({"precision": "fp8"}, "precision.compute", "must be one of 'fp32', 'bf16', 'fp16'; got 'fp8'"),
    ({"overlap_param_gather": 1}, "overlap_param_gather", "must be True or False; got 1"),
]


@pytest.mark.parametrize(("values", "field", "message"), BAD_VALUES)
def test_config_invalid_value_names_the_field(values, field, message):
    """``test_zero_config_reduce_bucket_size`` (0 refused) and other invalid values."""
    with pytest.raises(ValueError) as info:
        zerodp.ZeroConfig.from_dict(values)
    assert str(info.value) == f"ZeroConfig.{field} {message}"


def test_config_deepspeed_field_names_are_refused():
    """DeepSpeed's aliases and offload sections are not zerodp fields: refused, not ignored."""
    allowed = sorted(f for f in zerodp.ZeroConfig().to_dict())
    for key in ("stage3_prefetch_bucket_size", "offload_optimizer", "cpu_offload"):
        with pytest.raises(ValueError) as info:
            zerodp.ZeroConfig.from_dict({"stage": 3, key: 1})
        assert (
            str(info.value)
            == f"ZeroConfig got unknown field(s) ['{key}']; allowed fields: {allowed}"
        )
    assert zerodp.ZeroConfig(bucket_bytes=1).bucket_bytes == 1


def case_odd_bucket(bucket: int) -> float:
    _, world = rank_world()
    pair = make_pair(Layers, adamw, zerodp.ZeroConfig(stage=2, bucket_bytes=bucket))
    return train(pair, lambda s: mse(batches(s, world, 3, [(6,), (3,)])), 2, ADAM, f"{bucket}")


@pytest.mark.parametrize("bucket", [1, 1000, 1001])
def test_bucket_size_not_a_multiple_of_alignment(world, bucket):
    """``TestIncorectAllgatherBucketSize``: DeepSpeed refuses 1001; zerodp rounds and trains."""
    world(2).run(case_odd_bucket, bucket, timeout=TIMEOUT)
