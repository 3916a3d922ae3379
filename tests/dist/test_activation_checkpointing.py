"""Activation checkpointing as a zerodp feature ([Note: activation checkpointing] in
activations/checkpointing.py, [Note: recompute] in params/hooks.py): parity at every stage with
the unsharded model trained without checkpointing, on the shipped GPT and a Hugging Face Llama;
at stage 3 exactly the all-gathers of the run without checkpointing (2 per unit per step, also
for units inside a checkpointed module), no unit's forward hooks run twice; the activations
autograd keeps shrink; misuse is refused before anything changes."""

from __future__ import annotations

import copy
import pickle
from functools import partial
from unittest import mock

import pytest
import torch
from hf_models import build, global_batches, hf_loss
from torch import nn
from zerotest import (
    adamw_two_groups,
    assert_close,
    make_pair,
    rank_world,
    sgd_momentum,
    synced_step,
)

import zerodp
from zerodp import api
from zerodp.activations import CheckpointOffload, is_checkpointed, offload_of
from zerodp.apps.models.gpt import GPT, GPTConfig
from zerodp.memory.saved import SavedForBackward
from zerodp.streams import make_streams

TIMEOUT = 240.0
GPT_SHAPE = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, n_embd=32)


def _gpt() -> nn.Module:
    return GPT(GPT_SHAPE)


def _gpt_batches(step: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 64, (world, 2, 16), generator=g)
    targets = torch.randint(0, 64, (world, 2, 16), generator=g)
    return [(ids[r], targets[r]) for r in range(world)]


def _gpt_loss(step: int, world: int):
    data = _gpt_batches(step, world)

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        return m(*data[r])[1]

    return loss


def _config(
    stage: int, checkpoint: tuple[str, ...], offload: str = "none", **stage3
) -> zerodp.ZeroConfig:
    activations = zerodp.Activations(checkpoint=checkpoint, offload=offload, on_device=1)
    return zerodp.ZeroConfig(stage=stage, activations=activations, stage3=zerodp.Stage3(**stage3))


def _train(pair, losses, steps: int, world: int, rank: int) -> float:
    worst = 0.0
    for step in range(steps):
        synced_step(pair, losses(step, world), world, rank)
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"step {step}"))
    return worst


def case_gpt(stage: int) -> dict:
    """Checkpointed blocks against the unsharded reference without checkpointing; at stage 3
    the ledger's all-gathers and the unit events of one step, with and without."""
    rank, world = rank_world()
    out: dict = {}
    for checkpoint, offload in (((), "none"), (("Block",), "none"), (("Block",), "cpu")):
        # SGD: AdamW's first steps turn last-bit differences of zero-initialised biases into
        # relative errors above 1e-6 even without checkpointing.
        cfg = _config(stage, checkpoint, offload, unit_min_numel=1)
        pair = make_pair(_gpt, sgd_momentum, cfg)
        worst = _train(pair, _gpt_loss, 2, world, rank)
        moved = _moved(pair.model)
        events = _one_step_events(pair, world, rank)
        stats = pair.opt.comm_stats()  # of that last step
        assert stats is not None
        out[checkpoint, offload] = {
            "worst": worst,
            "step": {"elements": dict(stats.elements), "calls": dict(stats.calls)},
            "events": events,
            "wrapped": [n for n, m in pair.model.named_modules() if is_checkpointed(m)],
            "keys": sorted(pair.model.state_dict()),
            "moved": _moved(pair.model, since=moved),
        }
    return out


def _moved(model: nn.Module, since: dict | None = None) -> dict:
    """The checkpoint offload's bytes out and back (since ``since``) and what it holds on the
    device after the last forward's store."""
    offload = offload_of(model.blocks[0])
    if offload is None:
        return {}
    base = since or {"stored": 0, "loaded": 0}
    return {
        "stored": offload.stored_bytes - base["stored"],
        "loaded": offload.loaded_bytes - base["loaded"],
        "peak_resident": offload.peak_resident,
        "host_buffers": offload.host_buffers,
    }


def _one_step_events(pair, world: int, rank: int) -> list[tuple[str, str]]:
    """One more step; the stage-3 unit events it traced."""
    sharded = pair.opt.engine.params
    if sharded is None:
        synced_step(pair, _gpt_loss(7, world), world, rank)
        return []
    sharded.trace.events = []
    synced_step(pair, _gpt_loss(7, world), world, rank)
    events, sharded.trace.events = sharded.trace.events, None
    return events


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_checkpointed_blocks(world, stage):
    for o in world(2).run(case_gpt, stage, timeout=TIMEOUT):
        plain, blocks = o[(), "none"], o[("Block",), "none"]
        assert plain["wrapped"] == [] and plain["moved"] == {}
        for ckpt in (blocks, o[("Block",), "cpu"]):
            assert plain["worst"] <= 1e-6 and ckpt["worst"] <= 1e-6, o
            assert ckpt["wrapped"] == ["blocks.0", "blocks.1", "blocks.2"]
            assert ckpt["keys"] == plain["keys"]  # the state_dict keys do not change
            assert ckpt["step"] == plain["step"], o  # the same collectives, the same sizes
            if stage == 3:
                # The root once (held to the end of backward), each block twice but the last
                # two (kept into the backward).
                assert plain["step"]["calls"]["all_gather"] == 1 + 2 * 3 - 2, plain
                # The checkpointed block's own hooks run once per forward: the same events.
                assert ckpt["events"] == plain["events"], (ckpt["events"], plain["events"])
        # [Note: checkpoint offload]: each block's [2, 16, 32] fp32 input (4096 bytes) goes to
        # the host; the newest one (on_device=1) stays, the other two come back; 3 steps in
        # all, one host buffer per block.
        assert o[("Block",), "cpu"]["moved"] == {
            "stored": 3 * 4096,
            "loaded": 2 * 4096,
            "peak_resident": 1,
            "host_buffers": 3,
        }, o


class Layer(nn.Module):
    """Two units (``fc``, ``proj``: ``unit_classes=("Linear",)``) inside one checkpointed
    module that is no unit."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 48)
        self.proj = nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _nested_loss(step: int, world: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(world, 3, 16, generator=g), torch.randn(world, 3, 16, generator=g)

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(x[r]), y[r])

    return loss


def case_nested(depth: int) -> dict:
    """Units inside a checkpointed module run again in the recompute: gathered there and held
    into their backward, so the all-gathers are those of the run without checkpointing, but
    for the first unit: without checkpointing its input needs no gradient, so its backward
    reads no parameter and skips its all-gather ([Note: backward without parameters]); the
    recompute reads them."""
    rank, world = rank_world()
    out: dict = {}
    for checkpoint in ((), ("Layer",)):
        cfg = _config(3, checkpoint, unit_classes=("Linear",), prefetch_depth=depth)
        pair = make_pair(Nested, adamw_two_groups, cfg)
        worst = _train(pair, _nested_loss, 3, world, rank)
        stats = pair.opt.comm_stats()
        assert stats is not None
        units = [u.label for u in pair.opt.engine.params.units]
        first = pair.opt.engine.params.units[units.index("layers.0.fc")]
        report = pair.opt.memory_report()
        out[checkpoint] = {
            "first": sum(s.layout.padded_numel for s in first.segments),
            "worst": worst,
            "gathers": stats.calls["all_gather"],
            "gathered_elements": stats.elements["all_gather"],
            "units": units,
            "peak": report.gathered_peak,
            "now": report.gathered_now,
        }
    return out


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_units_inside_a_checkpointed_module(world, depth):
    for o in world(2).run(case_nested, depth, timeout=TIMEOUT):
        plain, ckpt = o[()], o[("Layer",)]
        assert "layers.0.fc" in plain["units"] and "layers.0.proj" in plain["units"], plain
        assert ckpt["worst"] <= 1e-6 and plain["worst"] <= 1e-6, o
        # No third gather per unit; the first unit's backward gather only when checkpointed.
        assert ckpt["gathers"] == plain["gathers"] + 1, o
        assert ckpt["gathered_elements"] == plain["gathered_elements"] + plain["first"], o
        assert ckpt["now"] == 0, o  # nothing held after the step


def case_llama(stage: int, offload: str) -> float:
    rank, world = rank_world()
    cfg = _config(stage, ("LlamaDecoderLayer",), offload, unit_min_numel=1)
    pair = make_pair(partial(build, "llama"), adamw_two_groups, cfg)

    def losses(step: int, world: int):
        return hf_loss(global_batches("llama", step, world))

    return _train(pair, losses, 2, world, rank)


@pytest.mark.parametrize(("stage", "offload"), [(2, "none"), (3, "none"), (3, "cpu")])
def test_hf_llama_decoder_layers_checkpointed(world, stage, offload):
    assert max(world(2).run(case_llama, stage, offload, timeout=TIMEOUT)) <= 1e-6


def test_saved_activations_shrink():
    """What autograd keeps from one forward of the GPT: with every block checkpointed, each
    block keeps only its input (one [2, 16, 32] fp32 tensor, 4096 bytes)."""
    saved = {}
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = _gpt()
        if checkpoint:
            for block in model.blocks:
                zerodp.checkpoint_wrapper(block)
        meter = SavedForBackward(model.parameters())
        ids, targets = _gpt_batches(0, 1)[0]
        with meter:
            loss = model(ids, targets)[1]
        loss.backward()
        saved[checkpoint] = meter.nbytes
    per_block_input = 2 * 16 * 32 * 4
    outside_blocks = saved[True] - GPT_SHAPE.n_layer * per_block_input
    assert outside_blocks > 0 and saved[False] > saved[True], saved
    # Without checkpointing every block keeps far more than its input.
    assert saved[False] - outside_blocks > 10 * GPT_SHAPE.n_layer * per_block_input, saved


def test_checkpoint_wrapper_keeps_the_module():
    torch.manual_seed(0)
    model = _gpt()
    keys = sorted(model.state_dict())
    block = model.blocks[0]
    assert zerodp.checkpoint_wrapper(block) is block and is_checkpointed(block)
    assert sorted(model.state_dict()) == keys and type(block).__name__ == "Block"
    with pytest.raises(ValueError, match="Block is checkpointed already"):
        zerodp.checkpoint_wrapper(block)


def test_unknown_class_is_refused():
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as err:
        zerodp.initialize(model, opt, _config(2, ("Blok",)))
    assert str(err.value).startswith(
        "ZeroConfig.activations.checkpoint names ['Blok'], which no module of the model is; "
        "its module classes are ['Block', 'CausalSelfAttention', 'Dropout', 'Embedding', 'GELU', "
    ), err.value
    assert not any(is_checkpointed(m) for m in model.modules())


def test_offload_needs_checkpointed_modules():
    with pytest.raises(ValueError) as err:
        zerodp.Activations(offload="cpu")
    assert str(err.value) == (
        "ZeroConfig.activations.offload='cpu' moves the inputs of checkpointed modules: name "
        "their classes in ZeroConfig.activations.checkpoint"
    )
    with pytest.raises(ValueError) as err:
        zerodp.Activations(checkpoint=("Block",), offload="cpu", on_device=0)
    assert str(err.value) == "ZeroConfig.activations.on_device must be a positive integer; got 0"


def test_checkpointed_twice_is_refused():
    model = _gpt()
    zerodp.checkpoint_wrapper(model.blocks[1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as err:
        zerodp.initialize(model, opt, _config(2, ("Block",)))
    assert str(err.value) == (
        "ZeroConfig.activations.checkpoint would checkpoint ['blocks.1'] again: they are "
        "checkpointed already (zerodp.checkpoint_wrapper); do one or the other"
    )
    assert [is_checkpointed(b) for b in model.blocks] == [False, True, False]


def case_failed_initialize() -> list[bool]:
    """[Note: initialize is all or nothing]: the forwards are replaced last, after everything
    that can fail; a failure before leaves none replaced."""
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    injected = mock.patch.object(api, "attach", side_effect=RuntimeError("injected"))
    with injected, pytest.raises(RuntimeError, match="injected"):
        zerodp.initialize(model, opt, _config(2, ("Block",)))
    return [is_checkpointed(m) for m in model.modules()]


def test_failed_initialize_checkpoints_nothing(world):
    for flags in world(2).run(case_failed_initialize, timeout=TIMEOUT):
        assert flags and not any(flags)


class Passing(nn.Module):
    """Returns a view of its input beside its result: the caller holds storage the offload
    must not free."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.fc(x)), x[:, :2]


def _offloaded_chain(seed: int) -> tuple[nn.ModuleList, CheckpointOffload]:
    torch.manual_seed(seed)
    chain = nn.ModuleList(Passing() for _ in range(3))
    offload = CheckpointOffload(make_streams("cpu"), on_device=1)
    for m in chain:
        zerodp.checkpoint_wrapper(m, offload)
    return chain, offload


def _run_chain(chain: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    views = []
    for m in chain:
        x, view = m(x)
        views.append(view)
    return x, views


def test_offload_keeps_inputs_an_output_shares():
    chain, offload = _offloaded_chain(0)
    torch.manual_seed(0)
    plain = nn.ModuleList(Passing() for _ in range(3))
    x = torch.randn(4, 8, requires_grad=True)
    out, views = _run_chain(chain, x)
    ref_out, ref_views = _run_chain(plain, x)
    # Every input is shared with an output: none is moved, every view still reads its values.
    assert offload.stored_bytes == 0
    for v, r in zip(views, ref_views, strict=True):
        assert v.untyped_storage().nbytes() > 0 and torch.equal(v, r)
    (out.sum() + sum(v.sum() for v in views)).backward()
    grads = [p.grad for p in chain.parameters()]
    plain_grads = []
    x.grad = None
    (ref_out.sum() + sum(v.sum() for v in ref_views)).backward()
    plain_grads = [p.grad for p in plain.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))


def test_a_copied_model_gets_an_offload_of_its_own():
    """deepcopy (an EMA copy) and pickling (torch.save of the model) work with offload: the
    copy has its own offload, and trains alike."""
    model = _gpt()
    offload = CheckpointOffload(make_streams("cpu"), on_device=1)
    for block in model.blocks:
        zerodp.checkpoint_wrapper(block, offload)
    twin = copy.deepcopy(model)
    again = pickle.loads(pickle.dumps(model))
    ids, targets = _gpt_batches(0, 1)[0]
    losses = []
    for m in (model, twin, again):
        theirs = offload_of(m.blocks[0])
        assert theirs is not None and (theirs is offload) == (m is model)
        assert all(offload_of(b) is theirs for b in m.blocks)
        loss = m(ids, targets)[1]
        loss.backward()
        losses.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
        assert theirs.stored_bytes == 3 * 2 * 16 * 32 * 4
    for loss, grads in losses[1:]:
        assert loss == losses[0][0]
        assert all(torch.equal(a, b) for a, b in zip(grads, losses[0][1], strict=True))


def test_forwards_without_backward_reuse_host_buffers():
    """Evaluation with gradients on (no backward): each forward's host buffers come back when
    its graph is dropped, so repeated forwards allocate no more."""
    model = _gpt()
    offload = CheckpointOffload(make_streams("cpu"), on_device=1)
    for block in model.blocks:
        zerodp.checkpoint_wrapper(block, offload)
    ids, targets = _gpt_batches(0, 1)[0]
    counts = []
    for _ in range(4):
        loss = model(ids, targets)[1]
        del loss
        counts.append(offload.host_buffers)
    # 3 blocks: one pass's worth, plus one for the newest checkpoint (on_device=1), which
    # stays pending (its graph alive) until the next forward's first store.
    assert counts == [3, 4, 4, 4], counts
