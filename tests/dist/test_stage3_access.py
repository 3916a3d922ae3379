"""Stage 3 with harder structures (weight reuse, tied weights across units, parameters read
outside their module, nested units, structured outputs), access to full parameters outside
forward (``zerodp.full_parameters``, ``state_dict``, inference) and sharded construction."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from stage3_models import (
    Features,
    GatedStack,
    Nested,
    Reuse,
    Stack,
    Structured,
    TiedHead,
)
from torch import nn
from zerotest import adamw_two_groups, assert_close, batches, make_pair, rank_world, sgd_momentum

import zerodp

TIMEOUT = 90.0


def _train(pair, loss: Callable[[nn.Module, int, int], torch.Tensor], steps: int) -> float:
    rank, world = rank_world()
    worst = 0.0
    for step in range(steps):
        total = sum(loss(pair.ref, r, step) for r in range(world)) / world
        total.backward()
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        loss(pair.model, rank, step).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"step {step}"))
    return worst


def _vector_loss(d_in: int, d_out: int) -> Callable[[nn.Module, int, int], torch.Tensor]:
    def loss(m: nn.Module, r: int, step: int) -> torch.Tensor:
        x, y = batches(step, rank_world()[1], 3, [(d_in,), (d_out,)])[r]
        return F.mse_loss(m(x), y)

    return loss


def _token_loss(m: nn.Module, r: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 11, (rank_world()[1], 4), generator=g)
    return F.cross_entropy(m(idx[r]), idx[r].roll(1))


def _outside_loss(m: nn.Module, r: int, step: int) -> torch.Tensor:
    x, y = batches(step, rank_world()[1], 3, [(6,), (3,)])[r]
    return F.mse_loss(F.linear(m(x), m.head.weight, m.head.bias), y)  # head read outside forward


def _gated_loss(m: nn.Module, r: int, step: int) -> torch.Tensor:
    x, y = batches(step, rank_world()[1], 3, [(5,), (2,)])[r]
    return F.mse_loss(m(x, branch=(r == 0)), y)  # rank 0's micro-batch uses `extra`


def _two_forwards_loss(m: nn.Module, r: int, step: int) -> torch.Tensor:
    x1, x2, y = batches(step, rank_world()[1], 3, [(8,), (8,), (8,)])[r]
    return F.mse_loss(m(x1) * m(x2), y)  # two forwards, one backward


def _structured_loss(m: nn.Module, r: int, step: int) -> torch.Tensor:
    x, y = batches(step, rank_world()[1], 3, [(5,), ()])[r]
    return F.mse_loss(m(x), y)


CASES = {
    # name: (factory, unit classes, loss)
    "weight reuse": (Reuse, ("Linear",), _vector_loss(4, 3)),
    "tied head in another unit": (TiedHead, ("Linear", "Embedding"), _token_loss),
    "head read in the loss": (Features, ("Block",), _outside_loss),
    "nested units": (Nested, ("Outer", "Inner"), _vector_loss(6, 6)),
    "unused on some ranks inside a unit": (GatedStack, ("Gated",), _gated_loss),
    "two forwards, one backward": (Stack, ("Block",), _two_forwards_loss),
    "tuple, dict, dataclass outputs": (
        Structured,
        ("TupleUnit", "DictUnit", "DataclassUnit"),
        _structured_loss,
    ),
}


def case_structures() -> dict[str, float]:
    out = {}
    for name, (factory, units, loss) in CASES.items():
        cfg = zerodp.ZeroConfig(stage=3, stage3=zerodp.Stage3(unit_classes=units))
        pair = make_pair(factory, adamw_two_groups, cfg)
        out[name] = _train(pair, loss, 3)
        sharded = pair.opt.engine.params
        if name == "tied head in another unit":  # the shared weight goes to the common unit
            root = sharded.units[0]
            assert [n for s in root.segments for n in s.names] == ["emb.weight"], "tied weight"
        if name == "nested units":  # the bound counts the enclosing unit
            sharded.gatherer.reset_peak()  # comparing with the reference gathered everything
            rank = rank_world()[0]
            loss(pair.model, rank, 3).backward()
            report = pair.opt.memory_report()
            assert report.gathered_peak <= report.gathered_bound, report
            assert report.gathered_bound == 2 * report.largest_unit + max(
                u.full_nbytes for u in sharded.units[1:] if u.spec.parent == 0
            ), report
            pair.opt.zero_grad()
            assert [u.label for u in sharded.units][:3] == [
                "<root Nested>",
                "layers.0",
                "layers.0.inner",
            ]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_structures_match_reference(world, world_size):
    for result in world(world_size).run(case_structures, timeout=TIMEOUT):
        assert set(result) == set(CASES)
        assert max(result.values()) <= 1e-6, result


def case_state_dict_inside_a_forward() -> float:
    """``state_dict`` called from inside a unit's forward pins that unit while the schedule
    holds it gathered, so its parameters turn to the full buffer and its forward saves views of
    the buffer's own chunk; the unit is released after its forward (no unit kept) and gathered
    again for its backward, into memory another unit of the same size used. That gather must
    refill the whole slice ([Note: parameters that view the shard])."""
    cfg = zerodp.ZeroConfig(
        stage=3, stage3=zerodp.Stage3(unit_classes=("Block",), keep_last_units=0)
    )
    pair = make_pair(partial(Stack, hiddens=(16, 16, 16, 16)), adamw_two_groups, cfg)

    def pin_every_unit(*_: object) -> None:
        pair.model.state_dict()

    hook = pair.model.blocks[2].register_forward_pre_hook(pin_every_unit)
    worst = _train(pair, _vector_loss(8, 8), 3)
    hook.remove()
    return worst


def test_state_dict_inside_a_forward_trains_like_the_reference(world):
    for worst in world(2).run(case_state_dict_inside_a_forward, timeout=TIMEOUT):
        assert worst <= 1e-6


def case_read_released() -> list[str]:
    """A parameter of a unit (not the root) read outside its unit: a clear error, on every rank
    at the same point (so no rank is left waiting)."""
    cfg = zerodp.ZeroConfig(stage=3, stage3=zerodp.Stage3(unit_classes=("Block", "Linear")))
    pair = make_pair(Features, sgd_momentum, cfg)
    messages = []
    try:
        _outside_loss(pair.model, rank_world()[0], 0).backward()
    except RuntimeError as exc:
        messages.append(str(exc))
    messages.append(repr(pair.model.head.weight))
    try:
        copy.deepcopy(pair.model)
    except RuntimeError as exc:
        messages.append(str(exc))
    pair.opt.zero_grad()
    return messages


def test_reading_a_released_parameter_raises(world):
    for loss_error, shown, copy_error in world(2).run(case_read_released, timeout=TIMEOUT):
        assert loss_error.startswith(
            "zerodp stage 3: parameter 'head.weight' was read (linear) while its unit 'head' is "
            "released"
        ), loss_error
        assert "zerodp.full_parameters" in loss_error, loss_error
        assert shown == (
            "ShardedParameter('head.weight', shape=(3, 6), dtype=torch.float32, released: unit "
            "'head' is not gathered; read it inside `with zerodp.full_parameters(model):`)"
        ), shown
        assert "was read (copy.deepcopy) while its unit" in copy_error, copy_error


# -- full parameters outside forward -----------------------------------------------------------


def _stack_loss(m: nn.Module, r: int, step: int) -> torch.Tensor:
    x, y = batches(step, rank_world()[1], 3, [(8,), (8,)])[r]
    return F.mse_loss(m(x), y)


def case_full_parameters() -> dict:
    rank, _ = rank_world()
    cfg = zerodp.ZeroConfig(stage=3, stage3=zerodp.Stage3(unit_min_numel=1))
    pair = make_pair(Stack, adamw_two_groups, cfg)
    _train(pair, _stack_loss, 2)
    model, ref = pair.model, pair.ref
    # Weight surgery on rank 0 only, written back from rank 0 to every rank's shard.
    with zerodp.full_parameters(model, [model.blocks[1]], rank=0):
        assert model.blocks[1].fc.weight.shape == (20, 8), "not the full parameter"
        if rank == 0:
            with torch.no_grad():
                model.blocks[1].fc.weight[3].fill_(0.25)
    with torch.no_grad():
        ref.blocks[1].fc.weight[3].fill_(0.25)
    worst = assert_close(model, ref, what="after surgery")
    # state_dict: full tensors under the plain model's keys, equal to the reference's.
    sd, want = model.state_dict(), ref.state_dict()
    assert list(sd) == list(want), (list(sd), list(want))
    for key, value in sd.items():
        assert value.shape == want[key].shape and bool(torch.isfinite(value).all()), key
        assert torch.allclose(value, want[key], rtol=1e-6, atol=1e-7), key
    # Training goes on from the edited weights.
    worst = max(worst, _train(pair, _stack_loss, 2))
    # Inference: eval mode and no_grad gather and release, with no gradient work.
    model.eval()
    ref.eval()
    x = torch.randn(4, 8)
    ledger = pair.opt.engine.comm.ledger
    before = dict(ledger.current().elements)
    sharded = pair.opt.engine.params
    sharded.trace.events = []
    with torch.no_grad():
        y = model(x)
    events, sharded.trace.events = sharded.trace.events, None
    assert torch.allclose(y, ref(x), rtol=1e-5, atol=1e-6), "inference output differs"
    after = ledger.current().elements
    assert after.get("reduce_scatter", 0) == before.get("reduce_scatter", 0), after
    assert not [e for e in events if e[0] in ("reduce", "backward")], events
    assert sharded.gatherer.gathered_bytes == 0, "units left gathered after inference"
    return {"worst": worst, "events": events}


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_parameters_state_dict_and_inference(world, world_size):
    for o in world(world_size).run(case_full_parameters, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6
        gathers = [u for e, u in o["events"] if e == "gather"]
        assert gathers == [f"blocks.{k}" for k in range(4)], o["events"]


def case_mixed_writeback(gathered: bool) -> dict:
    """bf16: an element edited inside full_parameters reaches the fp32 master as its bf16
    value; every other master keeps its full fp32 value. ``gathered``: the unit is gathered by
    the schedule when the pin finds it, with ``proj.bias`` (wholly in rank 1's slice) viewing
    rank 1's shard ([Note: parameters that view the shard])."""
    rank, _ = rank_world()
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = zerodp.ZeroConfig(stage=3, stage3=zerodp.Stage3(unit_min_numel=1), precision="bf16")
    model, opt = zerodp.initialize(model, opt, cfg)
    masters = [op.tensor.detach().clone() for op in opt.engine.pieces]
    sharded = opt.engine.params
    unit = next(u for u in sharded.units if u.module is model.blocks[2])
    if gathered:
        sharded.gatherer.unshard(unit)
    bias = model.blocks[2].proj.bias
    seg = unit.segments[0]
    views_shard = bias.untyped_storage().data_ptr() == seg.shard.untyped_storage().data_ptr()
    with zerodp.full_parameters(model, rank=1):
        if rank == 1:
            with torch.no_grad():
                model.blocks[2].proj.bias[5] = 3.0
    if gathered:
        sharded.gatherer.release(unit)
    changed = []
    for op, old in zip(opt.engine.pieces, masters, strict=True):
        diff = (op.tensor != old).nonzero().flatten().tolist()
        changed += [(op.name, op.piece.param_range.start + i, op.tensor[i].item()) for i in diff]
    with zerodp.full_parameters(model, writeback=False):
        value = model.blocks[2].proj.bias[5].item()
    return {"changed": changed, "value": value, "views_shard": views_shard}


@pytest.mark.parametrize("gathered", [False, True])
def test_mixed_precision_writeback_touches_only_edited_elements(world, gathered):
    out = world(2).run(case_mixed_writeback, gathered, timeout=TIMEOUT)
    assert [c for o in out for c in o["changed"]] == [("blocks.2.proj.bias", 5, 3.0)], out
    assert all(o["value"] == 3.0 for o in out), out
    assert [o["views_shard"] for o in out] == [False, gathered], out


# -- sharded construction ------------------------------------------------------------------------


def _rss_peak() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process, in bytes."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


def _fixed_mmap_threshold() -> None:
    """glibc serves a freed block below its *dynamic* mmap threshold from the heap next time,
    and the heap does not shrink: after the first large free, the threshold rises and each
    unit's freed flat buffer can stay in RSS (measured: the growth is bimodal, 52 MB or 64-73 MB
    for the same run, at this test's start commit too). A fixed threshold keeps every buffer of
    1 MiB or more in its own mapping, returned on free, so RSS measures what the engine holds."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    m_mmap_threshold = -3
    ctypes.CDLL(name).mallopt(m_mmap_threshold, 1 << 20)


def case_sharded_construction(limit_fraction: float) -> dict:
    from zerodp.apps.models.gpt import GPT, GPTConfig, num_parameters

    _fixed_mmap_threshold()

    # Warm-up: the first use of these code paths in a process imports modules (~90 MB of RSS
    # that has nothing to do with the model).
    with zerodp.sharded_init():
        tiny = GPT(GPTConfig(vocab_size=8, seq_len=4, n_layer=1, n_head=1, n_embd=4))
    zerodp.initialize(tiny, torch.optim.AdamW(tiny.parameters()), zerodp.ZeroConfig(stage=3))
    tiny.zero_engine.remove()
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=12, n_head=4, n_embd=384)
    with zerodp.sharded_init():
        shape_only = GPT(cfg)
    full_bytes = 4 * num_parameters(shape_only)
    limit = int(limit_fraction * full_bytes)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM to the current RSS
    _, rss_before = _rss_peak()
    torch.manual_seed(1234)  # the same seed on every rank: identical values, nothing broadcast
    with zerodp.sharded_init():
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zerodp.initialize(model, opt, zerodp.ZeroConfig(stage=3))
    peak, _ = _rss_peak()
    grown = peak - rss_before
    own = opt.engine.params.construction_peak
    assert grown < limit, f"RSS grew by {grown} bytes, over the limit {limit} ({full_bytes} full)"
    assert own < limit, f"construction held {own} bytes at once, over the limit {limit}"
    # The same model built normally under the same seed, compared unit by unit.
    torch.manual_seed(1234)
    ref = GPT(cfg)
    groups = [[model.wte, model.wpe, model.ln_f], *[[b] for b in model.blocks]]
    refs = dict(ref.named_parameters())
    for modules in groups:
        with zerodp.full_parameters(model, modules, writeback=False):
            for m in modules:
                prefix = next(n for n, x in model.named_modules() if x is m)
                for n, p in m.named_parameters():
                    assert torch.equal(p, refs[f"{prefix}.{n}"]), f"{prefix}.{n} differs"
    x = torch.randint(0, 256, (2, 17))
    _, loss = model(x[:, :-1], x[:, 1:])
    opt.backward(loss)
    opt.step()
    return {"grown": grown, "own": own, "full": full_bytes, "limit": limit}


def test_sharded_construction_never_holds_the_full_model(world):
    """A 21M-parameter GPT (86 MB in fp32) built on 2 ranks under a per-rank limit of 80% of
    that: the peak RSS growth over construction and initialize stays under it (it is about this
    rank's half plus one block, ~58%), as does the engine's own count of bytes it held at once;
    the result equals the model built normally under the same seed."""
    out = world(2).run(case_sharded_construction, 0.8, timeout=120)
    for o in out:
        assert o["grown"] < o["limit"] < o["full"], o
        print(f"sharded construction: {o}")


def _sharded_gpt(tied: bool, leaf_min: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from zerodp.apps.models.gpt import GPT, get_config

    torch.manual_seed(7)
    with zerodp.sharded_init():
        model = GPT(get_config("tiny", tie_embeddings=tied))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stage3 = zerodp.Stage3(leaf_unit_min_numel=leaf_min)
    return zerodp.initialize(model, opt, zerodp.ZeroConfig(stage=3, stage3=stage3))


def case_sharded_construction_attached(tied: bool) -> list[str]:
    """Attached units (wte, the untied head) are materialised with the root and initialised by
    its init_weights: the same numbers as without them (and, tied, as a normal build)."""
    from zerodp.apps.models.gpt import GPT, get_config

    model, opt = _sharded_gpt(tied, 2**14)
    plain, _ = _sharded_gpt(tied, 2**30)
    torch.manual_seed(7)
    normal = GPT(get_config("tiny", tie_embeddings=tied))
    with zerodp.full_parameters(plain, writeback=False):
        ref = {n: p.detach().clone() for n, p in plain.named_parameters()}
    if tied:
        for n, p in normal.named_parameters():
            assert torch.equal(p, ref[n]), f"{n} differs from a normal build"
    with zerodp.full_parameters(model, writeback=False):
        for n, p in model.named_parameters():
            assert torch.equal(p, ref[n]), f"{n} differs"
    x = torch.randint(0, 256, (2, 17))
    _, loss = model(x[:, :-1], x[:, 1:])
    opt.backward(loss)
    opt.step()
    return [u.label for u in opt.engine.params.units if u.spec.attached]


@pytest.mark.parametrize("tied", [True, False])
def test_sharded_construction_with_attached_units(world, tied):
    for labels in world(2).run(case_sharded_construction_attached, tied, timeout=TIMEOUT):
        assert labels == (["wte"] if tied else ["wte", "lm_head"])
