"""Stage 3's replayed unit order ([Note: verified orders] in params/replay.py): once a step ran
alike on every rank, the next ones check their order without blocking. Ranks that part from it,
in the forward, in the backward or by the kind of forward, raise the same clear error on every
rank, quickly, with nothing left in flight (a fresh model trains in parity right after); ranks
that all change their order together go on, in parity."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hf_models import MODELS, build, global_batches, hf_loss
from stage3_models import Stack, gpt_loss, untied_gpt
from zerotest import (
    adamw_two_groups,
    assert_close,
    batches,
    make_pair,
    rank_world,
    reference_step,
    sgd_momentum,
    synced_step,
)

import zerodp
from zerodp import Stage3

TIMEOUT = 120.0
FAST = 20.0  # seconds: far below the watchdog's timeout, so nothing waited for a late rank
EVEN = (16, 16, 16, 16)  # blocks of one size: a swapped gather would complete and mix data
UNEVEN = (12, 20, 16, 9)
# Eight blocks: the forward's exchanges make two blocks of replayed exchanges (``BLOCK`` 4), so
# a rank can part inside a block whose row it committed.
LONG = (16,) * 8
SWAP_LATE = [0, 1, 2, 3, 5, 4, 6, 7]
SWAP_EARLIER = [0, 1, 2, 4, 3, 5, 6, 7]  # parts one exchange before SWAP_LATE does


class Partly(Stack):
    """``detach``: the backward stops before the last two blocks' backward (the first two
    get no gradient)."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, order: list[int] | None = None, detach: bool = False
    ) -> torch.Tensor:
        if detach:
            x = self.blocks[1](self.blocks[0](x)).detach()
            order = [2, 3]
        return super().forward(x, order)


def _cfg(order: bool | str = True, depth: int = 1) -> zerodp.ZeroConfig:
    stage3 = Stage3(unit_min_numel=1, prefetch_depth=depth, check_unit_order=order)
    return zerodp.ZeroConfig(stage=3, stage3=stage3)


def _step(pair, step: int, world: int, rank: int, odd: dict | None = None) -> None:
    """One step of ``pair`` and its reference; the last rank's forward takes ``odd``."""
    data = batches(step, world, 3, [(8,), (8,)])

    def loss(m: torch.nn.Module, r: int) -> torch.Tensor:
        x, y = data[r]
        return F.mse_loss(m(x, **(odd if odd and r == world - 1 else {})), y)

    synced_step(pair, loss, world, rank)


def _odd_step(pair, kind: str, world: int, rank: int) -> None:
    last = rank == world - 1
    if kind == "eval":  # the last rank evaluates while the others train
        x, y = batches(3, world, 3, [(8,), (8,)])[rank]
        if last:
            with torch.no_grad():
                pair.model(x)
        else:
            F.mse_loss(pair.model(x), y).backward()
        return
    odd = {
        # Two blocks the forward keeps into the backward ([Note: keeping the last units]):
        # both ranks gather the same units in the forward; the backward parts.
        "swap": {"order": [0, 2, 1, 3]},
        "swap_first": {"order": [1, 0, 2, 3]},
        "skip": {"order": [0, 1, 3]},
        # Parts inside a block of replayed exchanges: in the forward, in the backward.
        "swap_late": {"order": SWAP_LATE},
        "skip_late": {"order": [0, 1, 2, 3, 4, 6, 7]},
        "detach": {"detach": True},
    }[kind]
    _step(pair, 3, world, rank, odd)


def case_late_divergence(kind: str, hiddens: tuple[int, ...], order: bool | str) -> dict:
    rank, world = rank_world()
    pair = make_pair(lambda: Partly(hiddens=hiddens), adamw_two_groups, _cfg(order))
    for step in range(3):  # the third replays the second
        _step(pair, step, world, rank)
    check = pair.opt.engine.params.check
    replaying = check.replay.predicted(check.replay.position) is not None
    start = time.monotonic()
    try:
        _odd_step(pair, kind, world, rank)
        message = "finished"
        worst = assert_close(pair.model, pair.ref, what=kind)
    except RuntimeError as e:
        message, worst = str(e), -1.0
    took = time.monotonic() - start
    # Nothing in flight: a fresh model's collectives pair up on every rank.
    fresh = make_pair(lambda: Stack(hiddens=hiddens), adamw_two_groups, _cfg(order))
    for step in range(3):
        _step(fresh, step, world, rank)
    after = assert_close(fresh.model, fresh.ref, what="fresh model after the error")
    return {
        "message": message,
        "took": took,
        "replayed": replaying,
        "worst": worst,
        "after": after,
    }


_PREFIX = "zerodp stage 3: ranks diverged at a parameter collective: "
_HINT = (
    "(Found against the order of the previous step, which every rank had run alike: a model "
    "whose ranks run different units only now and then needs "
    "ZeroConfig.stage3.check_unit_order='exchange', which merges them at any step.)"
)


@pytest.mark.parametrize(
    ("kind", "hiddens", "story"),
    [
        ("swap_first", EVEN, "rank 0 all-gathers 'blocks.0'; rank 1 all-gathers 'blocks.1'."),
        ("swap_first", UNEVEN, "rank 0 all-gathers 'blocks.0'; rank 1 all-gathers 'blocks.1'."),
        ("swap", EVEN, "rank 0 reduce-scatters 'blocks.3'; rank 1 all-gathers 'blocks.1'."),
        ("skip", UNEVEN, "rank 0 reduce-scatters 'blocks.3'; rank 1 all-gathers 'blocks.2'."),
        ("swap_late", LONG, "rank 0 all-gathers 'blocks.7'; rank 1 all-gathers 'blocks.4'."),
        ("skip_late", LONG, "rank 0 issues nothing more; rank 1 all-gathers 'blocks.3'."),
        ("detach", EVEN, "rank 0 all-gathers 'blocks.0'; rank 1 issues nothing more."),
        (
            "eval",
            EVEN,
            "rank 0 starts a training forward; rank 1 starts a forward without gradients "
            "(eval / no_grad).",
        ),
    ],
)
def test_ranks_that_part_from_the_replayed_order_raise_everywhere(world, kind, hiddens, story):
    out = world(2).run(case_late_divergence, kind, hiddens, True, timeout=TIMEOUT)
    for o in out:
        assert o["message"].startswith(_PREFIX + story), o
        assert (_HINT in o["message"]) == (kind != "eval"), o
        assert o["replayed"] and o["took"] < FAST and o["after"] <= 1e-6, o
    assert len({o["message"] for o in out}) == 1, out


def test_three_ranks_one_parts(world):
    out = world(3).run(case_late_divergence, "skip", UNEVEN, True, timeout=TIMEOUT)
    for o in out:
        assert o["message"].startswith(_PREFIX), o
        assert o["replayed"] and o["took"] < FAST and o["after"] <= 1e-6, o
    assert len({o["message"] for o in out}) == 1, out


def test_exchange_merges_a_late_skip(world):
    """``check_unit_order="exchange"``: the layer skipped on one rank at step 4 is merged, as
    at any step (the replay hint's promise)."""
    for o in world(2).run(case_late_divergence, "skip", UNEVEN, "exchange", timeout=TIMEOUT):
        assert o["message"] == "finished" and not o["replayed"], o  # never replays
        assert o["worst"] <= 1e-6 and o["after"] <= 1e-6, o


def case_unanimous_changes(tmp: str) -> dict:
    """Every rank alike: two micro-batches in step 4, a checkpoint after step 5, then single
    steps again: parity, no error, and the last step replays again."""
    rank, world = rank_world()
    pair = make_pair(Stack, adamw_two_groups, _cfg())
    check = pair.opt.engine.params.check
    for step in range(8):
        committed = check.committed
        data = batches(step, world, 3, [(8,), (8,)])
        micro = 2 if step == 3 else 1
        for k in range(micro):

            def loss(
                m: torch.nn.Module, r: int, k: int = k, data: list = data, micro: int = micro
            ) -> torch.Tensor:
                x, y = data[r]
                return F.mse_loss(m(x * (k + 1)), y) / micro

            reference_step(pair, loss, world, step=False)
            loss(pair.model, rank).backward()
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        pair.opt.step()
        pair.opt.zero_grad()
        if step == 4:
            zerodp.save_checkpoint(f"{tmp}/ckpt", pair.model, pair.opt)
    return {
        "worst": assert_close(pair.model, pair.ref, what="after the changes"),
        "merges": check.merges,
        "last_step_committed": check.committed - committed,
    }


def test_ranks_that_change_their_order_together_go_on(world, tmp_path):
    for o in world(2).run(case_unanimous_changes, str(tmp_path), timeout=TIMEOUT):
        assert o["worst"] <= 1e-6 and o["merges"] == 0, o
        # As test_stage3's Stack: the 8 exchanges but the step's, in rows of BLOCK.
        assert o["last_step_committed"] == 2, o


def case_two_part_apart() -> dict:
    """Rank 1 parts at the 7th exchange of step 4 (blocks 3 and 4 swapped), rank 2 at the 8th
    (blocks 4 and 5), both inside the block of exchanges 5-8 whose row they committed; rank 0
    follows the order."""
    rank, world = rank_world()
    pair = make_pair(lambda: Stack(hiddens=LONG), adamw_two_groups, _cfg())
    orders = {1: SWAP_EARLIER, 2: SWAP_LATE}
    start, message = 0.0, "finished"
    for step in range(4):
        data = batches(step, world, 3, [(8,), (8,)])

        def loss(m: torch.nn.Module, r: int, data: list = data, step: int = step) -> torch.Tensor:
            x, y = data[r]
            return F.mse_loss(m(x, orders.get(r) if step == 3 else None), y)

        if step == 3:
            start = time.monotonic()
        try:
            synced_step(pair, loss, world, rank)
        except RuntimeError as e:
            message = str(e)
    took = time.monotonic() - start
    fresh = make_pair(lambda: Stack(hiddens=LONG), adamw_two_groups, _cfg())
    for step in range(3):
        _step(fresh, step, world, rank)
    after = assert_close(fresh.model, fresh.ref, what="fresh model after the error")
    return {"message": message, "took": took, "after": after}


def test_two_ranks_that_part_at_different_points_of_a_block(world):
    """The error names what each rank was about to do where the first one parted: rank 2,
    which parted later, was about to issue what rank 0 issues there."""
    story = (
        "rank 0 all-gathers 'blocks.6'; rank 1 all-gathers 'blocks.3'; "
        "rank 2 all-gathers 'blocks.6'."
    )
    out = world(3).run(case_two_part_apart, timeout=TIMEOUT)
    for o in out:
        assert o["message"].startswith(_PREFIX + story), o
        assert _HINT in o["message"] and o["took"] < FAST and o["after"] <= 1e-6, o
    assert len({o["message"] for o in out}) == 1, out


def case_all_part_alike() -> dict:
    """Every rank swaps blocks 4 and 5 in step 6's forward: each parts from the replayed order
    inside a block whose row it committed, stands in for the rest of the block, and the
    exchange that follows finds every rank parted at the same point."""
    rank, world = rank_world()
    pair = make_pair(lambda: Stack(hiddens=LONG), adamw_two_groups, _cfg())
    check = pair.opt.engine.params.check
    per_step = []
    for step in range(9):
        calls, committed = check.calls, check.committed
        data = batches(step, world, 3, [(8,), (8,)])
        order = SWAP_LATE if step == 5 else None

        def loss(m: torch.nn.Module, r: int, data: list = data, order=order) -> torch.Tensor:
            x, y = data[r]
            return F.mse_loss(m(x, order), y)

        synced_step(pair, loss, world, rank)
        per_step.append((check.calls - calls, check.committed - committed))
    worst = assert_close(pair.model, pair.ref, what="after every rank parted alike")
    return {"worst": worst, "merges": check.merges, "per_step": per_step}


def test_ranks_that_part_inside_a_block_together_go_on(world):
    """Exchanges per step (blocking, committed). Steps 1-3 settle the order (the units kept
    into the backward, the agreement on skipped gathers: test_order_check_replays_a_step_that_
    ran_alike in test_stage3.py tells it for 4 blocks). Steps 4 and 5 replay: 16 exchanges in
    4 committed rows, then the step. Step 6 commits the rows of exchanges 1 and 5, parts at the
    8th (the forward's last), stands in for it and exchanges the rest blocking, in parity.
    Step 6 is recorded without its stand-ins (what every rank's program did), so step 7
    replays it: it commits its first block and parts at the 5th exchange, where step 6 had
    gathered block 5 before block 4 (16 block). Step 8 parts from step 7 at the same place
    (step 7 still prefetched in the order step 6 ran); step 9 replays again."""
    for o in world(2).run(case_all_part_alike, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6 and o["merges"] == 0, o
        assert o["per_step"] == [
            (19, 0),
            (10, 2),
            (9, 2),
            (1, 4),
            (1, 4),
            (13, 2),
            (16, 1),
            (13, 1),
            (1, 4),
        ], o


def _hf_loss(name: str, step: int, world: int):  # a loss for synced_step
    return hf_loss(global_batches(name, step, world))


def case_replayed_training(name: str) -> dict:
    """Eight SGD steps of ``name`` (our GPT or a Hugging Face model) at stage 3 with one unit
    per block, against the unsharded reference after every step; the order check's exchanges
    per step (blocking, committed)."""
    rank, world = rank_world()
    if name == "gpt":
        factory, losses, units = untied_gpt, gpt_loss, ("Block",)
    else:
        factory, losses = partial(build, name), partial(_hf_loss, name)
        units = (MODELS[name].block,)
    cfg = zerodp.ZeroConfig(stage=3, stage3=Stage3(unit_classes=units))
    pair = make_pair(factory, sgd_momentum, cfg)
    check = pair.opt.engine.params.check
    per_step, worst = [], 0.0
    for step in range(8):
        calls, committed = check.calls, check.committed
        synced_step(pair, losses(step, world), world, rank)
        per_step.append((check.calls - calls, check.committed - committed))
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"{name} step {step}"))
    return {"per_step": per_step, "worst": worst, "merges": check.merges}


# Exchanges per step once the order settled (blocking, committed): the step blocks, and llama
# also broadcasts its buffers (the rotary inv_freq) before each training forward, a barrier.
SETTLED = {"gpt": (1, 1), "llama": (2, 2), "t5": (1, 2)}


@pytest.mark.parametrize("name", ["gpt", "llama", "t5"])
def test_replayed_steps_train_in_parity(world, name):
    """Our GPT and two Hugging Face models: from the fourth step on, only the barriers block,
    every other exchange rides in a committed row of ``BLOCK`` exchanges, and training matches
    the unsharded reference after every step."""
    for o in world(2).run(case_replayed_training, name, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6 and o["merges"] == 0, o
        assert o["per_step"][3:] == [SETTLED[name]] * 5, o
