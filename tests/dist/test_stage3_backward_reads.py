"""Stage 3 skips the backward all-gather of units whose backward reads none of their parameters
([Note: backward without parameters] in zerodp/params/saved.py), measured from what the forward
left referenced, not from module types: traffic exact, training equal to an unsharded model's,
on our models, the GPT and a Hugging Face Llama."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hf_models import build, build_checkpointed, global_batches, hf_loss
from stage3_models import Hooked, Packed, Parts, Switch, gpt_loss, untied_gpt
from torch import nn
from zerotest import (
    NONFINITE_RAISE,
    assert_close,
    make_pair,
    rank_world,
    reference_step,
    sgd_momentum,
)

import zerodp
from zerodp import Stage3
from zerodp.params.saved import QUIET_AGREEMENTS

TIMEOUT = 120.0
STEPS = 3

Loss = Callable[[nn.Module, int], torch.Tensor]


def _train(
    factory: Callable[[], nn.Module],
    units: tuple[str, ...],
    losses: Callable[[int, int], Loss],
    around: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
    *,
    steps: int = STEPS,
    **stage3: object,
) -> dict:
    """``steps`` SGD-momentum steps against the unsharded reference; each step's trace and
    traffic (model data, and control calls), the worst relative error and every unit's padded
    size by label. ``stage3``: more fields of ``Stage3``."""
    rank, world = rank_world()
    cfg = zerodp.ZeroConfig(stage=3, stage3=Stage3(unit_classes=units, **stage3))
    pair = make_pair(factory, sgd_momentum, cfg)
    sharded = pair.opt.engine.params
    assert sharded is not None
    traces, elements, control, worst = [], [], [], 0.0
    for step in range(steps):
        loss = losses(step, world)
        reference_step(pair, loss, world)
        sharded.trace.events = []
        with around():
            out = loss(pair.model, rank)
        out.backward()
        traces.append(sharded.trace.events)
        sharded.trace.events = None
        pair.opt.step()
        stats = pair.opt.comm_stats()
        assert stats is not None
        elements.append(stats.elements)
        control.append(stats.control_calls)
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"step {step}"))
    return {
        "worst": worst,
        "traces": traces,
        "elements": elements,
        "control_calls": control,
        "merges": sharded.check.merges,
        "units": {u.label: sum(s.layout.padded_numel for s in u.segments) for u in sharded.units},
    }


def _parts_loss(step: int, world: int) -> Loss:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 13, (world, 3, 5), generator=g)
    targets = torch.randint(0, 13, (world, 3, 5), generator=g)

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        return F.cross_entropy(m(ids[r]).flatten(0, 1), targets[r].flatten())

    return loss


def _backward_events(trace: list[tuple[str, str]]) -> list[tuple[str, str]]:
    end = trace.index(("forward_end", "<root Parts>"))
    kinds = ("gather", "read", "backward", "backward_skip")
    return [e for e in trace[end:] if e[0] in kinds and e[1] != "<root Parts>"]


def test_units_whose_backward_reads_no_parameter_are_not_gathered(world):
    """The embedding (saves the indices) and the shift (``add`` saves nothing) are never
    gathered in the backward; the scale (``mul`` saves the parameter itself) and the block
    (``linear`` saves views) are. The linear checkpointed inside ``inner`` left nothing, so the
    first backward skips it, and its recompute reads the parameters: gathered on demand there,
    and in every later backward as usual. Traffic over 3 steps: every unit once per forward,
    scale once per backward, inner and the block in the first backward only (then, the last
    two units, kept into the backward from their forward, Stage3.keep_last_units); every unit
    reduce-scattered once."""
    for o in world(2).run(_train, Parts, Parts.UNITS, _parts_loss, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6
        u = o["units"]
        assert list(u) == ["<root Parts>", "emb", "shift", "scale", "inner", "block"]
        every = sum(u.values())
        again = u["scale"] + u["inner"]
        assert o["elements"] == [
            {"all_gather": every + again + u["block"], "reduce_scatter": every},
            *[{"all_gather": every + u["scale"], "reduce_scatter": every}] * (STEPS - 1),
        ]
        first, *later = (_backward_events(t) for t in o["traces"])
        assert first == [
            ("gather", "block"),
            ("backward", "block"),
            ("gather", "scale"),  # prefetched: inner is not in the backward's order
            ("backward_skip", "inner"),
            ("gather", "inner"),
            ("read", "inner"),
            ("backward", "scale"),
            ("backward_skip", "shift"),
            ("backward_skip", "emb"),
        ], first
        for trace in later:
            assert trace == [
                ("backward", "block"),
                ("backward", "inner"),
                ("gather", "scale"),
                ("backward", "scale"),
                ("backward_skip", "shift"),
                ("backward_skip", "emb"),
            ], trace


def test_saved_tensor_hooks_keep_every_backward_gather(world):
    """Under saved-tensor hooks (``save_on_cpu``, which on the CPU keeps the tensors as they
    are) whatever the forward saves may be read through them: every unit is gathered in the
    backward, and training still matches."""
    hooks = torch.autograd.graph.save_on_cpu
    for o in world(2).run(_train, Parts, Parts.UNITS, _parts_loss, hooks, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6
        u = o["units"]
        again = u["emb"] + u["shift"] + u["scale"] + u["inner"]
        gathers = [e["all_gather"] for e in o["elements"]]
        every = sum(u.values()) + again
        assert gathers == [every + u["block"]] + [every - u["inner"]] * (STEPS - 1)
        for trace in o["traces"]:
            assert not [e for e in trace if e[0] == "backward_skip"], trace


def test_saved_tensor_hooks_inside_a_unit_are_caught_when_the_backward_reads(world):
    """``save_on_cpu`` pushed inside a unit's forward packs the parameter object itself (CPU):
    no reference count shows it, so the first backward skips the unit's gather, but the
    backward reads the parameter through that object, which gathers the unit on demand (once,
    blocking); from then on the unit counts as read. Training matches the unsharded model. (Its
    later backward gathers nothing: the unit is the last of the forward, kept into it.)"""
    for o in world(2).run(_train, Packed, Packed.UNITS, _parts_loss, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6
        u = o["units"]
        every = sum(u.values())
        gathers = [e["all_gather"] for e in o["elements"]]
        assert gathers == [every + u["scale"]] + [every] * (STEPS - 1)
        first, *later = ([e for e in t if e[1] == "scale"] for t in o["traces"])
        skip = first.index(("backward_skip", "scale"))
        assert first[skip + 1 :][:3] == [("gather", "scale"), ("ready", "scale"), ("read", "scale")]
        for trace in later:
            assert ("backward", "scale") in trace and ("read", "scale") not in trace, trace


def _train_or_error(*args: object, **stage3: object) -> dict | str:
    try:
        return _train(*args, **stage3)  # type: ignore[arg-type]
    except RuntimeError as exc:
        return str(exc)


def test_a_backward_read_no_reference_shows_is_refused_as_nonfinite(world):
    """Saved-tensor hooks inside a unit that hand the parameter object back untouched: nothing
    shows the read, the backward computes on the released placeholder and the gradients are
    NaN. Not silent: the step refuses them (``nonfinite='raise'``), with the message of any NaN
    gradient (nothing tells this read from a diverged run). With
    ``skip_backward_gathers=False`` training matches the unsharded model."""
    run = (Hooked, Hooked.UNITS, _parts_loss)
    for message in world(2).run(_train_or_error, *run, timeout=TIMEOUT):
        assert message == NONFINITE_RAISE.format(step=1, what="gradients")
    for o in world(2).run(_train, *run, skip_backward_gathers=False, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_embeddings_as_units_skip_the_backward_gather(world, model):
    """Token (and position) embeddings made units of their own: gathered once per step, in
    the forward; the blocks twice in the first step, then once: the last two units, kept into
    the backward. Training matches the unsharded model."""
    if model == "gpt":
        run = (untied_gpt, ("Embedding", "Block"), gpt_loss)
        embeddings = ["wte", "wpe"]
    else:
        pytest.importorskip("transformers")
        run = (partial(build, "llama"), ("Embedding", "LlamaDecoderLayer"), _hf_loss)
        embeddings = ["model.embed_tokens"]
    for o in world(2).run(_train, *run, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6
        u = o["units"]
        blocks = [n for n in u if n not in embeddings and not n.startswith("<root")]
        assert len(blocks) == 2 and all(n in u for n in embeddings)
        every = sum(u.values()) + sum(u[n] for n in blocks)
        gathers = [e["all_gather"] for e in o["elements"]]
        assert gathers == [every] + [every - sum(u[n] for n in blocks)] * (STEPS - 1)
        for trace in o["traces"]:
            for name in embeddings:
                assert trace.count(("backward_skip", name)) == 1, trace
                assert trace.count(("gather", name)) == 1, trace


def _hf_loss(step: int, world: int) -> Loss:
    return hf_loss(global_batches("llama", step, world))


def _switch_loss(step: int, world: int) -> Loss:
    """Rank 0 takes the scaled branch, the other ranks do not."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 13, (world, 3, 5), generator=g)
    targets = torch.randint(0, 13, (world, 3, 5), generator=g)

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        return F.cross_entropy(m(ids[r], scaled=r == 0).flatten(0, 1), targets[r].flatten())

    return loss


def test_ranks_whose_backwards_read_differently_agree(world):
    """``maybe`` saves its scale on rank 0 only (the data decides): every rank gathers it for
    the backward (and keeps it from its forward, the last unit, from the second step), so the
    collectives match without merging plans and training is that of the unsharded model; the
    embedding, read by no rank's backward, is skipped on every rank."""
    out = world(2).run(_train, Switch, Switch.UNITS, _switch_loss, timeout=TIMEOUT)
    assert out[0]["elements"] == out[1]["elements"]
    for o in out:
        assert o["worst"] <= 1e-6
        assert o["merges"] == 0
        for trace in o["traces"]:
            assert trace.count(("backward", "maybe")) == 1, trace
            assert trace.count(("backward_skip", "emb")) == 1, trace
            assert not [e for e in trace if e == ("backward_skip", "maybe")], trace


def test_opt_out_and_the_cost_of_agreeing(world):
    """``Stage3.skip_backward_gathers=False`` gathers every unit for its backward. With it on,
    each backward first agrees (one blocking exchange, one all-reduce of a vote per unit: two
    control calls): on ``Parts`` every step; on the GPT, whose units all read their weights,
    the first two steps only (``QUIET_AGREEMENTS``), after which nothing is measured or
    agreed. The step after the last agreement parts from the replayed order of the one before
    (alike on every rank, [Note: verified orders]): exchanges from there on block, where with
    the opt-out they ride in committed rows, one per ``BLOCK`` exchanges (2 calls more); from
    the next step on the cost is the same."""
    on, off = (
        world(2).run(_train, Parts, Parts.UNITS, _parts_loss, skip_backward_gathers=s)
        for s in (True, False)
    )
    for a, b in zip(on, off, strict=True):
        assert b["worst"] <= 1e-6
        u = b["units"]
        every = sum(u.values())
        again = every - u["<root Parts>"]  # every unit but the root, then the last two kept
        gathers = [e["all_gather"] for e in b["elements"]]
        kept = u["block"] + u["inner"]
        assert gathers == [every + again] + [every + again - kept] * (STEPS - 1)
        for trace in b["traces"]:
            assert not [e for e in trace if e[0] == "backward_skip"], trace
        # The agreement, every step; in the first, the exchange of inner's gather on demand too.
        diff = [x - y for x, y in zip(a["control_calls"], b["control_calls"], strict=True)]
        assert diff == [3] + [2] * (STEPS - 1), diff
    on, off = (
        world(2).run(
            _train, untied_gpt, ("Block",), gpt_loss, steps=STEPS + 1, skip_backward_gathers=s
        )
        for s in (True, False)
    )
    for a, b in zip(on, off, strict=True):
        assert a["elements"] == b["elements"]
        diff = [x - y for x, y in zip(a["control_calls"], b["control_calls"], strict=True)]
        assert diff == [2] * (QUIET_AGREEMENTS + 1) + [0] * (STEPS - QUIET_AGREEMENTS), diff


def test_hugging_face_gradient_checkpointing_gathers_as_usual(world):
    """Llama with Hugging Face's gradient checkpointing (its layers checkpoint their own
    forward, inside the module hooks): the layers are gathered for their backward and
    prefetched from the first step (never skipped, then read on demand by the recompute); the
    embedding is skipped; training matches the unsharded (checkpointed) model."""
    pytest.importorskip("transformers")
    factory = partial(build_checkpointed, "llama", False)
    units = ("Embedding", "LlamaDecoderLayer")
    for o in world(2).run(_train, factory, units, _hf_loss, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6
        for trace in o["traces"]:
            skipped = [e for e in trace if e[0] in ("backward_skip", "read")]
            assert skipped == [("backward_skip", "model.embed_tokens")], trace
