"""Overlap of communication with computation (issue 5).

Stages 1-2: the parameter all-gather deferred into the next forward ([Note: deferred parameter
gather]): identical results, waits per module, reads wait. Stages 0-2: gradient buckets launched
in the order backward completes them ([Note: launch order])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zerotest import assert_close, batches, build, make_pair, mse, rank_world, synced_step

import zerodp

TIMEOUT = 90.0
WIDTH = 8
LAYERS = 6


def _deep() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _config(stage: int, overlap: bool, precision: str = "fp32") -> zerodp.ZeroConfig:
    # 72 parameter elements per layer: with 64-element buckets every layer spans buckets.
    return zerodp.ZeroConfig(
        stage=stage, bucket_bytes=256, overlap_param_gather=overlap, precision=precision
    )


def _train(model: nn.Module, opt: zerodp.ZeroOptimizer, steps: int, check: bool) -> None:
    rank, world = rank_world()
    engine = opt.engine
    for step in range(steps):
        x, y = batches(step, world, 4, [(WIDTH,), (WIDTH,)])[rank]
        loss = F.mse_loss(model(x).float(), y)
        assert not engine.param_gather.pending, "the forward waited for every bucket"
        loss.backward()
        opt.step()
        if check:
            assert engine.param_gather.pending == engine.config.overlap_param_gather
        opt.zero_grad()


def case_same_result(stage: int, precision: str) -> None:
    """Deferred and blocking gathers give bitwise the same parameters after every step."""
    models = []
    for overlap in (True, False):
        model = build(_deep)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, zopt = zerodp.initialize(model, opt, _config(stage, overlap, precision))
        _train(model, zopt, 3, check=True)
        models.append(model)
    deferred, blocking = models
    for (name, p), (_, q) in zip(
        deferred.named_parameters(), blocking.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), f"{name} differs between deferred and blocking gathers"


def case_waits_per_module(stage: int) -> list[tuple[int, int]]:
    """When the first layer runs, only the buckets it needs (issued first) were waited for."""
    model = build(_deep)
    model, opt = zerodp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _config(stage, True)
    )
    _train(model, opt, 1, check=True)
    gather = opt.engine.param_gather
    seen: list[tuple[int, int]] = []

    def record(module: nn.Module, args: object) -> None:
        seen.append((gather._waited, len(gather._handles)))

    seq = model._modules  # not model[i]: indexing the model would itself wait for everything
    handles = [m.register_forward_pre_hook(record) for m in seq.values()]
    rank, world = rank_world()
    x, _ = batches(9, world, 4, [(WIDTH,), (WIDTH,)])[rank]
    model(x)
    for h in handles:
        h.remove()
    return seen


def case_reads_wait(stage: int) -> None:
    """Every read through the model after a step sees the gathered values, as a blocking
    gather would have given."""
    ref = build(_deep)
    ref_model, ref_opt = zerodp.initialize(
        ref, torch.optim.SGD(ref.parameters(), lr=0.1), _config(stage, False)
    )
    _train(ref_model, ref_opt, 2, check=False)
    expected = {k: v.clone() for k, v in ref_model.state_dict().items()}
    reads = {
        "attribute": lambda m: m[3].weight,
        "named_parameters": lambda m: dict(m.named_parameters())["3.weight"],
        "parameters": lambda m: list(m.parameters())[6],
        "state_dict": lambda m: m.state_dict()["3.weight"],
    }
    for how, read in reads.items():
        model = build(_deep)
        model, opt = zerodp.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), _config(stage, True)
        )
        _train(model, opt, 2, check=True)
        value = read(model).detach().clone()
        assert not opt.engine.param_gather.pending, how
        assert torch.equal(value, expected["3.weight"]), f"read by {how}: stale slices"
    model = build(_deep)
    model, opt = zerodp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _config(stage, True)
    )
    _train(model, opt, 2, check=True)
    with zerodp.full_parameters(model, writeback=False):
        assert not opt.engine.param_gather.pending
        assert torch.equal(model._modules["3"]._parameters["weight"], expected["3.weight"])
    opt.step()
    assert opt.engine.param_gather.pending
    opt.wait_params()
    assert not opt.engine.param_gather.pending
    opt.step()  # a step without a forward in between waits before writing the owned slices
    assert opt.engine.param_gather.pending


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deferred_gather_same_result(world, stage, precision):
    world(2).run(case_same_result, stage, precision, timeout=TIMEOUT)


@pytest.mark.parametrize("stage", [1, 2])
def test_forward_waits_bucket_by_bucket(world, stage):
    seen = world(2).run(case_waits_per_module, stage, timeout=TIMEOUT)[0]
    total = seen[0][1]
    assert total >= LAYERS  # every layer spans at least one bucket of its own
    # Buckets waited for once layer i's own pre-hook ran: layer 0 waited for its own buckets
    # only, each later layer for a few more, the last layer for the rest.
    waited = [w for w, _ in seen]
    assert 0 < waited[0] < total
    assert waited == sorted(set(waited)), waited
    assert waited[-1] == total


@pytest.mark.parametrize("stage", [1, 2])
def test_reads_through_the_model_wait(world, stage):
    world(2).run(case_reads_wait, stage, timeout=TIMEOUT)


class Backwards(nn.Module):
    """Layers registered 0..5 but run 5..0: reversed registration order (the first launch
    order) is exactly the reverse of the order backward produces gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def case_launch_order(stage: int) -> list[int]:
    """Per step, buckets launched when layer 4's gradient is ready (layer 5's, in the first
    buckets of the layout, comes last). Parity with an unsharded reference throughout."""
    rank, world = rank_world()
    pair = make_pair(
        Backwards,
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        zerodp.ZeroConfig(stage=stage, bucket_bytes=256),
    )
    reducer = pair.opt.engine.reducer
    launched: list[int] = []
    pair.model.layers[4].weight.register_post_accumulate_grad_hook(
        lambda p: launched.append(reducer._next)
    )
    for step in range(3):
        synced_step(pair, mse(batches(step, world, 4, [(WIDTH,), (WIDTH,)])), world, rank)
        assert_close(pair.model, pair.ref, what=f"stage {stage} step {step}")
    return launched


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_buckets_launch_in_recorded_order(world, stage):
    for launched in world(2).run(case_launch_order, stage, timeout=TIMEOUT):
        # Step 1: the layout's order waits for layer 5's bucket, so nothing has launched yet.
        # Then rank 0's recorded order: every bucket of layers 0-3 is out before layer 4's.
        assert launched[0] == 0
        assert launched[1] == launched[2] >= 3
