"""Stage 3 on real gloo ranks: traffic (3x the units), bytes held and gathered, prefetch event
order, changed and skipped unit orders, and ranks that run different units.

The core parity cases (optimizers, odd sizes, tied, unused, frozen, accumulation, clipping,
schedulers, state dicts, buffers, mixed precision) run at stage 3 in test_stages.py,
test_features.py and test_precision.py; more structures are in test_stage3_access.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from stage3_models import Stack
from torch import nn
from zerotest import (
    Branchy,
    adamw_two_groups,
    assert_close,
    batches,
    make_pair,
    rank_world,
    reference_step,
    sgd_momentum,
)

import zerodp
from zerodp import Stage3

TIMEOUT = 90.0
HIDDENS = (12, 20, 16, 9)


def _cfg(precision: str = "fp32", **stage3) -> zerodp.ZeroConfig:
    """``stage3``: fields of ``Stage3``."""
    stage3.setdefault("unit_min_numel", 1)  # every block of the tiny Stack is a unit
    return zerodp.ZeroConfig(stage=3, precision=precision, stage3=Stage3(**stage3))


def _mse(data, **fwd):
    def loss(m: nn.Module, r: int) -> torch.Tensor:
        x, y = data[r]
        return F.mse_loss(m(x, **fwd), y)

    return loss


def _train(pair, steps: range, world: int, rank: int, check: bool = True, **fwd) -> float:
    """Train ``pair`` and its reference; compare them after every step (``check``: comparing
    gathers the whole model, which the gathered-bytes peak then includes)."""
    worst = 0.0
    for step in steps:
        data = batches(step, world, 3, [(8,), (8,)])
        reference_step(pair, _mse(data, **fwd), world)
        _mse(data, **fwd)(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        if check:
            worst = max(worst, assert_close(pair.model, pair.ref, what=f"step {step} {fwd}"))
    return worst


# -- traffic and memory --------------------------------------------------------------------------


def case_accounting(depth: int, persist: int, keep: int = 1) -> dict:
    rank, world = rank_world()
    cfg = _cfg(prefetch_depth=depth, persist_numel=persist, keep_last_units=keep)
    pair = make_pair(Stack, adamw_two_groups, cfg)
    _train(pair, range(3), world, rank, check=False)
    report = pair.opt.memory_report().to_dict()
    worst = assert_close(pair.model, pair.ref, what="after 3 steps")
    eng = pair.opt.engine
    sharded = eng.params
    assert sharded is not None
    stats = pair.opt.comm_stats()
    assert stats is not None
    return {
        "worst": worst,
        "elements": stats.elements,
        "units": [sum(s.layout.padded_numel for s in u.segments) for u in sharded.units],
        "persistent": sum(eng.segments[i].layout.padded_numel for i in sharded.persistent_seg_ids),
        "report": report,
        "owned": sum(op.piece.param_range.numel for op in eng.pieces),
        "pieces": len(eng.pieces),
    }


def case_bf16_memory() -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zerodp.initialize(model, opt, _cfg(precision="bf16"))
    for step in range(2):
        x, y = batches(step, world, 3, [(8,), (8,)])[rank]
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    eng = opt.engine
    return {
        "report": opt.memory_report().to_dict(),
        "owned": sum(op.piece.param_range.numel for op in eng.pieces),
        "pieces": len(eng.pieces),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_precision_memory_is_16_psi_over_n(world, world_size):
    """bf16 AdamW at stage 3: 2 Psi/N parameters + 2 Psi/N gradients + 12 Psi/N (fp32 masters,
    momentum, variance) = 16 Psi/N (paper, K = 12), up to padding."""
    n = world_size
    psi = sum(17 * h + 8 for h in HIDDENS)
    for o in world(n).run(case_bf16_memory, timeout=TIMEOUT):
        r = o["report"]
        shard = r["padded_numel"] // n
        assert r["precision"] == "bf16" and r["stage"] == 3
        assert r["parameters"] == 2 * shard
        assert r["gradients"] == 2 * shard
        assert r["master_parameters"] == 4 * shard
        assert r["optimizer_state"] == 4 * shard + 8 * o["owned"] + 4 * o["pieces"]
        theory = r["theory"]
        total = theory["parameters"] + theory["gradients"] + theory["optimizer_state"]
        assert total == 16 * psi / n
        measured = r["model_states"] - r["optimizer_scalar_bytes"]
        assert abs(measured - 16 * psi / n) <= 16 * (r["padded_numel"] - psi) / n + 16


@pytest.mark.parametrize("world_size", [2, 3])
def test_traffic_is_three_times_the_units_and_memory_is_bounded(world, world_size):
    n = world_size
    psi = sum(17 * h + 8 for h in HIDDENS)
    cases = [(1, 0, 2), (2, 0, 3), (1, 8, 2), (1, 0, 0), (1, 0, 1), (0, 0, 2)]
    for depth, persist, keep in cases:
        out = world(n).run(case_accounting, depth, persist, keep, timeout=TIMEOUT)
        for o in out:
            units, pers = o["units"], o["persistent"]
            # Per step: all-gather every unit in forward and again in backward, reduce-scatter
            # it once: 3x the (padded) units; persistent parameters: reduce-scatter + all-gather.
            # The last min(keep, depth + 1) units of the forward (the root owns nothing, the
            # blocks run in order) stay gathered into the backward: 3 Psi - Psi_kept.
            kept = sum(units[len(units) - min(keep, depth + 1) :])
            assert o["elements"] == {
                "all_gather": 2 * sum(units) + pers - kept,
                "reduce_scatter": sum(units) + pers,
            }, (depth, persist, keep, o["elements"], units, pers)
            r = o["report"]
            assert r["num_params"] == psi
            if persist == 0:
                assert units[0] == 0 and pers == 0  # the root owns nothing: exactly 3 Psi
                # fp32 AdamW at stage 3: 4 Psi/N + 4 Psi/N + 8 Psi/N, up to padding.
                padded = r["padded_numel"]
                assert r["parameters"] == 4 * padded // n
                assert r["gradients"] == 4 * padded // n
                assert r["optimizer_state"] == 8 * o["owned"] + 4 * o["pieces"]
                theory = r["theory"]
                assert theory["parameters"] + theory["gradients"] + theory["optimizer_state"] == (
                    16 * psi / n
                )
                measured = r["model_states"] - r["optimizer_scalar_bytes"]
                assert abs(measured - 16 * psi / n) <= 16 * (padded - psi) / n + 16
            else:  # the biases (8 elements) stay replicated, counted apart
                assert r["persistent_parameters"] == 4 * pers > 0
            # Gathered parameters never exceed (depth + 1) x the largest unit (the root owns
            # nothing, so no enclosing unit adds to it), and prefetch did overlap units.
            largest = 4 * max(units)
            assert r["largest_unit"] == largest
            assert r["gathered_bound"] == (depth + 1) * largest
            assert r["gathered_peak"] <= r["gathered_bound"], r
            assert (largest < r["gathered_peak"]) == (depth > 0), r  # depth 0: one at a time
            assert r["gathered_now"] == 0
        # Optimizer state is sharded for persistent parameters too: the shards partition Psi.
        assert sum(o["owned"] for o in out) == psi


def case_gpt_traffic() -> dict:
    from zerodp.apps.models.gpt import GPT, get_config

    rank, world = rank_world()
    torch.manual_seed(0)
    ref = GPT(get_config("tiny"))
    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    # SGD: the key bias of attention has an exactly-zero true gradient (softmax ignores it),
    # which Adam would turn rounding noise of any summation order into full-size steps on.
    ref_opt = sgd_momentum(list(ref.parameters()))
    model, opt = zerodp.initialize(
        model, sgd_momentum(list(model.parameters())), zerodp.ZeroConfig(stage=3)
    )
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        tokens = torch.randint(0, 256, (world, 2, 17), generator=g)
        total = sum(ref(t[:, :-1], t[:, 1:])[1] for t in tokens) / world
        total.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _, loss = model(tokens[rank][:, :-1], tokens[rank][:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert_close(model, ref, what=f"GPT step {step}")
    sharded = opt.engine.params
    stats = opt.comm_stats()
    return {
        "labels": [u.label for u in sharded.units],
        "units": [sum(s.layout.padded_numel for s in u.segments) for u in sharded.units],
        "elements": stats.elements,
        "report": opt.memory_report().to_dict(),
    }


def test_gpt_default_units_traffic_and_bound(world):
    """Default policy on the GPT: the root unit (embeddings, tied head, final norm) plus one
    unit per block. The root stays gathered from forward to the end of backward (the tied head
    reads the embedding in the root's forward), so its backward all-gather is skipped, as are
    the last two blocks' (kept into the backward: ``keep_last_units``, at most depth + 1: here
    both blocks), and the bound on gathered bytes adds the root to (depth + 1) x the largest
    unit."""
    out = world(2).run(case_gpt_traffic, timeout=TIMEOUT)
    for o in out:
        root, *blocks = o["units"]
        assert o["labels"] == ["<root GPT>", "blocks.0", "blocks.1"]
        assert o["elements"] == {
            "all_gather": root + 2 * sum(blocks) - sum(blocks[-2:]),
            "reduce_scatter": root + sum(blocks),
        }
        r = o["report"]
        assert r["gathered_bound"] == 4 * root + 2 * 4 * max(blocks)
        assert r["gathered_peak"] <= r["gathered_bound"]


def _gpt_attached(tied: bool, width: int, bucket_bytes: int, steps: int) -> dict:
    """The tiny GPT with its 256 x width embedding (and untied head) as attached units, and
    reduce-scatters in bucket_bytes chunks; the loss also reads wte.weight outside any forward."""
    from zerodp.apps.models.gpt import GPT, get_config
    from zerodp.params.reduce import chunk_plan

    rank, world = rank_world()
    gcfg = get_config("tiny", tie_embeddings=tied, n_embd=width)
    torch.manual_seed(0)
    ref = GPT(gcfg)
    torch.manual_seed(0)
    model = GPT(gcfg)
    ref_opt = sgd_momentum(list(ref.parameters()))  # SGD: see case_gpt_traffic
    units = Stage3(leaf_unit_min_numel=256 * width)
    cfg = zerodp.ZeroConfig(stage=3, stage3=units, bucket_bytes=bucket_bytes)
    model, opt = zerodp.initialize(model, sgd_momentum(list(model.parameters())), cfg)

    def loss_of(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return m(t[:, :-1], t[:, 1:])[1] + 1e-2 * m.wte.weight.square().mean()

    sharded = opt.engine.params
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(steps):
        tokens = torch.randint(0, 256, (world, 2, 17), generator=g)
        (sum(loss_of(ref, t) for t in tokens) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        sharded.trace.events = []
        loss_of(model, tokens[rank]).backward()
        events, sharded.trace.events = sharded.trace.events, None
        opt.step()
        opt.zero_grad()
        report = opt.memory_report().to_dict()  # before the comparison gathers everything
        worst = max(worst, assert_close(model, ref, what=f"GPT step {step}"))
        sharded.gatherer.reset_peak()
    stats = opt.comm_stats()
    bucket = sharded.plan.bucket_numel(torch.float32)
    return {
        "worst": worst,
        "labels": [u.label for u in sharded.units],
        "attached": [u.spec.attached for u in sharded.units],
        "units": [sum(s.layout.padded_numel for s in u.segments) for u in sharded.units],
        "runs": sum(len(chunk_plan(s.layout, bucket)) for u in sharded.units for s in u.segments),
        "elements": stats.elements,
        "calls": stats.calls,
        "report": report,
        "events": events,
    }


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_attached_units_and_reduce_chunks(world, tied):
    """Attached units (the embedding, the untied head) and bucket-sized reduce-scatter chunks:
    the same training as an unsharded model. The head (read in the root's forward) and wte
    (read in the loss) are gathered on demand and held to the end of backward, like the root:
    one all-gather each in backward less; so are the last two blocks, kept into the backward
    (the head is read on demand, not a unit forward the record sees). The reduce-scatters move
    exactly the units, in
    runs of at most one bucket, so the staging pool is 2 buckets, not 2 x the largest unit."""
    out = world(2).run(_gpt_attached, tied, 64, 4096, 2, timeout=TIMEOUT)
    for o in out:
        assert o["worst"] <= 1e-6
        heads = [] if tied else ["lm_head"]
        assert o["labels"] == ["<root GPT>", "wte", "blocks.0", "blocks.1", *heads]
        assert o["attached"] == [False, True, False, False] + [True] * len(heads)
        root, wte, *rest = o["units"]
        blocks, head = rest[:2], sum(rest[2:])
        assert o["elements"] == {
            "all_gather": root + 2 * wte + head + 2 * sum(blocks) - sum(blocks[-2:]),
            "reduce_scatter": sum(o["units"]),
        }
        assert o["calls"]["reduce_scatter"] == o["runs"] > len(o["units"])  # units > a bucket
        r = o["report"]
        # Two staging buffers of one bucket, each with the half its point-to-point
        # reduce-scatter receives into (gloo on CPU, 2 ranks).
        assert r["comm_buffers"] == 2 * (4096 + 2048)
        assert min(blocks) * 4 > 4096
        ev = o["events"]
        # wte: its own forward, then read on demand (the tied head in the root's forward, or
        # the loss) and held until its gradient is complete (its embedding backward comes last:
        # the input is token ids, so no post-backward callback; every parameter's
        # AccumulateGrad has run): reduced and released then, before the end of backward.
        assert ev.index(("release", "wte")) < ev.index(("read", "wte"))
        assert ev.index(("read", "wte")) < ev.index(("backward", "blocks.1"))
        assert ev[-3:] == [("reduce", "wte"), ("release", "wte"), ("release", "<root GPT>")]
        assert ev.count(("reduce", "wte")) == 1
        if not tied:  # the head is read only (F.linear in the root's forward): reduced and
            # released as soon as its gradient is accumulated, before the blocks' backward ends
            assert ev.index(("read", "lm_head")) < ev.index(("forward_end", "<root GPT>"))
            assert ev.index(("release", "lm_head")) < ev.index(("reduce", "blocks.1"))
        # The bound counts the attached units (held when read outside their forward).
        assert r["gathered_bound"] == 4 * (2 * max(o["units"]) + root + wte + head)
        assert 4 * (root + wte + head) < r["gathered_peak"] <= r["gathered_bound"]


def test_staging_does_not_grow_with_the_model(world):
    """ZeRO-R's constant-size buffers: 4x the parameters per unit, the same staging bytes."""
    small, large = (
        world(2).run(_gpt_attached, False, w, 4096, 1, timeout=TIMEOUT) for w in (32, 64)
    )
    for a, b in zip(small, large, strict=True):
        assert 4 * a["units"][2] <= b["units"][2]  # a block: ~4x
        assert a["report"]["comm_buffers"] == b["report"]["comm_buffers"] == 2 * (4096 + 2048)


# -- prefetch ------------------------------------------------------------------------------------


def case_events(depth: int) -> list[tuple[str, str]]:
    rank, world = rank_world()
    pair = make_pair(Stack, sgd_momentum, _cfg(prefetch_depth=depth))
    _train(pair, range(1), world, rank)  # step 0 records the order
    trace = pair.opt.engine.params.trace
    trace.events = []
    _train(pair, range(1, 2), world, rank, check=False)
    events, trace.events = trace.events, None
    return events


def test_prefetch_event_order(world):
    events = world(2).run(case_events, 1, timeout=TIMEOUT)
    assert events[0] == events[1], "ranks saw different schedules"
    ev = events[0]
    at = {e: i for i, e in enumerate(ev)}  # last occurrence of each event
    first = {}
    for i, e in enumerate(ev):
        first.setdefault(e, i)
    b = [f"blocks.{k}" for k in range(4)]
    # Forward: the gather of block k+1 is issued after block k started and before it ended,
    # i.e. it is in flight while block k computes; block k is released before block k+2 is
    # gathered (at most 2 units gathered at depth 1).
    for k in range(3):
        assert first[("forward", b[k])] < first[("gather", b[k + 1])], ev
        assert first[("gather", b[k + 1])] < first[("forward_end", b[k])], ev
    for k in range(2):
        assert first[("release", b[k])] < first[("gather", b[k + 2])], ev
    # Backward: the same in reverse; each block is gathered exactly once per pass, but the last
    # two (depth + 1), kept gathered from their forward into their backward (keep_last_units).
    for k in range(2, 0, -1):
        assert at[("backward", b[k])] < at[("gather", b[k - 1])] < at[("reduce", b[k])], ev
    for name in b:
        gathers = 1 if name in b[2:] else 2
        assert ev.count(("gather", name)) == gathers and ev.count(("reduce", name)) == 1, ev
    for k in (2, 3):  # released once, after its backward
        assert ev.count(("release", b[k])) == 1, ev
        assert at[("backward", b[k])] < at[("release", b[k])], ev
    # The exact schedule of the forward pass, for the record.
    forward = ev[: first[("forward_end", "<root Stack>")] + 1]
    assert forward == [
        ("forward", "<root Stack>"),
        ("gather", b[0]),
        ("ready", b[0]),
        ("forward", b[0]),
        ("gather", b[1]),
        ("forward_end", b[0]),
        ("release", b[0]),
        ("ready", b[1]),
        ("forward", b[1]),
        ("gather", b[2]),
        ("forward_end", b[1]),
        ("release", b[1]),
        ("ready", b[2]),
        ("forward", b[2]),
        ("gather", b[3]),
        ("forward_end", b[2]),
        ("ready", b[3]),
        ("forward", b[3]),
        ("forward_end", b[3]),
        ("forward_end", "<root Stack>"),
    ], forward


def case_order_changes() -> dict:
    """Blocks reordered, then one skipped (on every rank): correct results, no hang; the
    mispredicted units are gathered on demand."""
    rank, world = rank_world()
    pair = make_pair(Stack, adamw_two_groups, _cfg(prefetch_depth=2))
    _train(pair, range(2), world, rank, check=False)
    _train(pair, range(2, 3), world, rank, check=False, order=[0, 2, 1, 3])
    _train(pair, range(3, 4), world, rank, check=False, order=[0, 1, 3])
    _train(pair, range(4, 6), world, rank, check=False)
    report = pair.opt.memory_report()
    assert report.gathered_peak <= report.gathered_bound, report
    return {"worst": assert_close(pair.model, pair.ref, what="after reordering")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_changed_and_skipped_unit_order(world, world_size):
    out = world(world_size).run(case_order_changes, timeout=TIMEOUT)
    assert max(o["worst"] for o in out) <= 1e-6


# -- ranks that run different units ----------------------------------------------------------------


def case_uneven_backwards() -> str:
    """Rank 1 runs one more backward than rank 0 before the step: its collectives have no
    partner (rank 0 is at the step), which no merged plan can fix; it is found at the start
    of that backward, whose agreement on the skipped gathers is a barrier (the first unit's
    backward reads no parameter). A unit that runs on some ranks only is fine
    (test_stage3_moe.py)."""
    rank, world = rank_world()
    pair = make_pair(Branchy, adamw_two_groups, _cfg(unit_classes=("Linear",)))
    try:
        for step in range(2):
            data = batches(step, world, 2, [(4,), (4,)])
            x, y = data[rank]
            for _ in range(1 + rank):
                F.mse_loss(pair.model(x, use_branch=True), y).backward()
            pair.opt.step()
            pair.opt.zero_grad()
    except RuntimeError as exc:
        return str(exc)
    return "finished"


@pytest.mark.parametrize("world_size", [2, 3])
def test_unmergeable_divergence_raises_everywhere(world, world_size):
    messages = world(world_size).run(case_uneven_backwards, timeout=TIMEOUT)
    for msg in messages:
        assert msg.startswith("zerodp stage 3: ranks diverged at a parameter collective"), msg
        assert "rank 0 is at the step; rank 1 starts a backward" in msg, msg
    assert len(set(messages)) == 1, messages


def case_rank_dependent_policy() -> str:
    rank, _ = rank_world()
    model = Stack()
    try:
        zerodp.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            zerodp.ZeroConfig(stage=3),
            unit_policy=lambda name, m: name == f"blocks.{rank}",
        )
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_units_that_differ_across_ranks_are_refused(world):
    for msg in world(2).run(case_rank_dependent_policy, timeout=TIMEOUT):
        assert msg.startswith("zerodp.initialize: rank 1 chose other stage-3 units than rank 0"), (
            msg
        )


def case_order_check_exchanges(order: bool | str) -> list[tuple[int, int]]:
    """Exchanges of the unit-order check per step: (blocking, committed)."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = Stack()
    cfg = _cfg(check_unit_order=order)
    model, opt = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    check = opt.engine.params.check
    per_step = []
    for step in range(4):
        calls, committed = check.calls, check.committed
        x, y = batches(step, world, 3, [(8,), (8,)])[rank]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        per_step.append((check.calls - calls, check.committed - committed))
    return per_step


def test_order_check_agrees_on_each_backward_hook_once(world):
    """4 block units, depth 1. Forward: one exchange per unit (its gather, then each prefetch).
    Backward of the first step (nothing kept yet): the last block's gather with the prefetch of
    the one before it; then at each block's hook the reduce-scatter of the block after it with
    the next prefetch; the last reduce-scatters at the end of backward; then the step:
    4 + 5 + 1 = 10 (one exchange per collective would be 4 + 8 + 1 = 13). From the second step
    the last two blocks stay gathered into the backward ([Note: keeping the last units]): the
    last block's hook issues nothing, 4 + 4 + 1 = 9. ``check_unit_order="exchange"``: every one
    blocks. The first two backwards also agree once on the gathers they skip ([Note: backward
    without parameters]: none here, every block saves a weight), so no later backward does."""
    for per_step in world(2).run(case_order_check_exchanges, "exchange", timeout=TIMEOUT):
        assert per_step == [(11, 0), (10, 0), (9, 0), (9, 0)], per_step


def test_order_check_replays_a_step_that_ran_alike(world):
    """[Note: verified orders] The first step exchanges blocking (11, as above). The second
    parts from it, on every rank alike, where the last blocks stay gathered into the backward
    (the first step keeps none): its first 4 exchanges (the forward) are one committed row
    (``BLOCK`` = 4 exchanges per row), the rest block (6 with the agreement on skipped
    gathers). The third parts from the second where its backward agrees no more: 5 block.
    From the fourth on only the step blocks; the other 8 exchanges are 2 committed rows."""
    for per_step in world(2).run(case_order_check_exchanges, True, timeout=TIMEOUT):
        assert per_step == [(11, 0), (6, 1), (5, 1), (1, 2)], per_step


def case_backward_starts_elsewhere() -> float:
    """Same forward everywhere, but rank 1's loss reads block 1's output: its backward starts at
    another unit, and blocks 2 and 3 get no gradient there. The first backward hooks plan
    different collectives on the two ranks; the plans are merged ([Note: merged plans])."""
    rank, world = rank_world()
    pair = make_pair(Stack, adamw_two_groups, _cfg())
    mids: list[torch.Tensor] = []
    for m in (pair.model, pair.ref):
        m.blocks[1].register_forward_hook(lambda mod, a, out: mids.append(out))
    worst = 0.0
    for step in range(3):
        data = batches(step, world, 3, [(8,), (8,)])

        def loss(m: nn.Module, r: int, data=data) -> torch.Tensor:
            x, y = data[r]
            out = m(x)
            return F.mse_loss(out if r == 0 else mids[-1], y)

        reference_step(pair, loss, world)
        loss(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"step {step}"))
    return worst


def test_backward_starting_at_different_units(world):
    assert max(world(2).run(case_backward_starts_elsewhere, timeout=TIMEOUT)) <= 1e-6


def case_kept_units_without_backward() -> dict:
    """Two ordinary steps (the last two blocks are kept into the backward from the second),
    then a step whose loss reads block 1's output on every rank: blocks 2 and 3 were kept, and
    their backward never comes."""
    rank, world = rank_world()
    pair = make_pair(Stack, adamw_two_groups, _cfg())
    _train(pair, range(2), world, rank)
    mids: list[torch.Tensor] = []
    for m in (pair.model, pair.ref):
        m.blocks[1].register_forward_hook(lambda mod, a, out: mids.append(out))
    sharded = pair.opt.engine.params
    sharded.gatherer.reset_peak()
    sharded.trace.events = []
    data = batches(2, world, 3, [(8,), (8,)])

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        m(data[r][0])
        return F.mse_loss(mids[-1], data[r][1])

    reference_step(pair, loss, world)
    loss(pair.model, rank).backward()
    events, sharded.trace.events = sharded.trace.events, None
    pair.opt.step()
    pair.opt.zero_grad()
    report = pair.opt.memory_report()
    return {
        "worst": assert_close(pair.model, pair.ref, what="after the short backward"),
        "events": events,
        "peak": report.gathered_peak,
        "bound": report.gathered_bound,
        "units": [u.full_nbytes for u in sharded.units],
    }


def test_kept_units_whose_backward_never_comes_are_let_go(world):
    """[Note: keeping the last units]: the backward of block 1 expects block 0 next, so it lets
    go of the kept blocks 2 and 3 before it gathers block 1. Held on, blocks 1-3 (or all four,
    with block 0's prefetch) would exceed the bound of 2 x the largest unit."""
    for o in world(2).run(case_kept_units_without_backward, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6
        ev = o["events"]
        end = ev.index(("forward_end", "<root Stack>"))
        forward, backward = ev[:end], ev[end:]
        assert backward.index(("gather", "blocks.1")) < backward.index(("backward", "blocks.1"))
        for k in (2, 3):
            assert ("release", f"blocks.{k}") not in forward, ev  # kept from its forward
            # let go of before block 1 is gathered for its backward
            released = backward.index(("release", f"blocks.{k}"))
            assert released < backward.index(("gather", "blocks.1")), ev
        assert sum(o["units"]) > o["bound"] == 2 * max(o["units"])
        assert o["peak"] <= o["bound"], o
