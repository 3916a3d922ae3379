"""Scenarios from PyTorch FSDP2's test suite (``test_fully_shard_{training,autograd,frozen,
clip_grad_norm_,comm,init,ignore_params}.py``), rewritten with zerodp's public API: 2 gloo
ranks, fp32, every step compared with unsharded training on the same global batch (relative
error per parameter <= 1e-6 with SGD, <= 1e-5 with Adam/AdamW). FSDP2's training loops call
``zero_grad(set_to_none=(iter_idx % 2 == 0))``; so do these. docs/peer-tests-fsdp2.part.md maps
each FSDP2 test to the function here. Each test runs all its cases in one ``world(2).run``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fsdp2_models import (
    ADAM_TOL,
    CONTAINERS,
    SGD_TOL,
    STAGES,
    DoubleLinear,
    MLPBlock,
    Stack,
    adam,
    adamw,
    cfg,
    container_model,
    lm_loss,
    mlp_stack,
    pair,
    sgd,
    token_batches,
)
from torch import nn
from zerotest import assert_close, batches, full, mse, rank_world, reference_step

import zerodp

TIMEOUT = 120.0


def _train(p, losses_for_step, steps: int, tol: float, what: str, start: int = 0) -> float:
    """FSDP2's loop: zero_grad(set_to_none alternating), forward/backward, step; parity after
    every step."""
    rank, world = rank_world()
    worst = 0.0
    for step in range(start, start + steps):
        none = step % 2 == 0
        p.ref_opt.zero_grad(set_to_none=none)
        p.opt.zero_grad(set_to_none=none)
        losses = losses_for_step(step)
        reference_step(p, losses, world, step=False)
        p.ref_opt.step()
        losses(p.model, rank).backward()
        p.opt.step()
        worst = max(worst, assert_close(p.model, p.ref, tol, f"{what} step {step}"))
    return worst


def _mse_steps(d_in: int, d_out: int, per_rank: int = 2):
    _, world = rank_world()
    return lambda step: mse(batches(step, world, per_rank, [(d_in,), (d_out,)]))


def _lm_steps(step: int):
    return lm_loss(token_batches(step, rank_world()[1]))


# -- test_fully_shard_training.py --------------------------------------------------------------

SHAPES = [((16, 15), (15, 8)), ((7, 15), (15, 3)), ((16, 17), (17, 8))]


def case_single_group() -> dict:
    out = {}
    for stage in STAGES:
        for a, b in SHAPES:

            def factory(a=a, b=b) -> nn.Module:
                return nn.Sequential(nn.Linear(*a), nn.ReLU(), nn.Linear(*b))

            p = pair(factory, adam, cfg(stage))  # one group: the root unit at stage 3
            out[(stage, a)] = _train(p, _mse_steps(a[0], b[1]), 3, ADAM_TOL, f"{stage} {a}")
    return out


def test_train_parity_single_group(world):
    """``test_train_parity_single_group_shard_dim0``: odd shapes, one communication group."""
    world(2).run(case_single_group, timeout=TIMEOUT)


def case_multi_group() -> list:
    """Per-block units with prefetch 0/1/2 (FSDP2's reshard_after_forward and explicit
    prefetching variants), untied and tied head (``test_train_parity_with_shared_params``)."""
    runs = [(s, 1, False) for s in (0, 1, 2)] + [(3, d, t) for d in (0, 1, 2) for t in (0, 1)]
    for stage, depth, tie in runs:
        p = pair(
            lambda tie=tie: Stack(tie=bool(tie)),
            adamw,
            cfg(stage, ("Block",), prefetch_depth=depth),
        )
        if tie:
            assert p.model.head.weight is p.model.tok.weight, "tying broken by initialize"
        _train(p, _lm_steps, 3, ADAM_TOL, f"stage {stage} prefetch {depth} tie {tie}")
    return runs


def test_train_parity_multi_group_and_prefetch(world):
    world(2).run(case_multi_group, timeout=TIMEOUT)


class TiedUneven(nn.Module):
    """``test_train_shared_params_uneven_shard``: vocab 9 rows is not divisible by 2."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(9, 16)
        self.output = nn.Linear(16, 9, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(self.tok_embeddings(ids))


def case_tied_uneven() -> None:
    rank, world = rank_world()
    for stage in STAGES:
        # Stage 3: embedding and head in different unit classes (FSDP2 raises "already
        # managed by another" for that); zerodp puts the shared weight in their common unit.
        p = pair(TiedUneven, adamw, cfg(stage, ("Embedding", "Linear")))
        with full(p.model):
            before = p.model.tok_embeddings.weight.detach().clone()
        for step in range(4):
            p.opt.zero_grad()
            p.ref_opt.zero_grad()
            g = torch.Generator().manual_seed(step)
            ids = torch.arange(18).reshape(world, 9) % 9  # every row used on every rank
            ids = ids[:, torch.randperm(9, generator=g)]

            def loss(m: nn.Module, r: int, ids=ids) -> torch.Tensor:
                return F.cross_entropy(m(ids[r]).float(), ids[r])

            reference_step(p, loss, world, step=False)
            p.ref_opt.step()
            loss(p.model, rank).backward()
            p.opt.step()
            assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} step {step}")
        with full(p.model):
            after = p.model.tok_embeddings.weight.detach()
            stale = [r for r in range(9) if torch.equal(after[r], before[r])]
        assert not stale, f"stage {stage}: rows {stale} never updated"


def test_train_shared_params_uneven_shard(world):
    world(2).run(case_tied_uneven, timeout=TIMEOUT)


class MultiForward(nn.Module):
    """``test_multi_forward_module``: ``inner`` runs twice on the same input."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


def case_multi_forward_module() -> None:
    for stage in STAGES:
        p = pair(MultiForward, adam, cfg(stage), unit_policy=lambda n, m: n == "inner")
        _train(p, _mse_steps(4, 5), 3, ADAM_TOL, f"stage {stage}")


def test_multi_forward_module(world):
    world(2).run(case_multi_forward_module, timeout=TIMEOUT)


def case_non_root_forward_backward() -> None:
    """``test_non_root_forward_backward``: a step through the root, then a step whose loss is
    a child's forward alone (``model[0](x)``)."""
    rank, world = rank_world()
    for stage in STAGES:
        p = pair(lambda: mlp_stack(8), adam, cfg(stage, ("MLPBlock",)))
        data = batches(0, world, 2, [(8,), (8,)])
        for step, sub in enumerate((lambda m: m, lambda m: m[0])):

            def loss(m: nn.Module, r: int, sub=sub, data=data) -> torch.Tensor:
                x, y = data[r]
                return F.mse_loss(sub(m)(x), y)

            reference_step(p, loss, world)
            loss(p.model, rank).backward()
            p.opt.step()
            p.opt.zero_grad()
            assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} step {step}")


def test_non_root_forward_backward(world):
    world(2).run(case_non_root_forward_backward, timeout=TIMEOUT)


def case_double_forward() -> None:
    """``test_double_forward_with_nested_fsdp_and_checkpoint`` (DPO): two forwards, one loss
    over both outputs, one backward; with and without activation checkpointing."""
    rank, world = rank_world()
    for stage in STAGES:
        for ckpt in (False, True):
            p = pair(lambda ckpt=ckpt: Stack(ckpt=ckpt), adamw, cfg(stage, ("Block",)))
            for step in range(2):
                a, b = token_batches(step, world), token_batches(100 + step, world)

                def loss(m: nn.Module, r: int, a=a, b=b) -> torch.Tensor:
                    chosen, rejected = m(a[r][0]).float(), m(b[r][0]).float()
                    return (chosen.mean() - rejected.mean()).pow(2) + chosen.pow(2).mean()

                reference_step(p, loss, world)
                loss(p.model, rank).backward()
                p.opt.step()
                p.opt.zero_grad()
                assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} ckpt {ckpt}")


def test_double_forward_before_backward(world):
    world(2).run(case_double_forward, timeout=TIMEOUT)


def case_activation_checkpointing() -> None:
    for stage in STAGES:
        p = pair(lambda: Stack(tie=True, ckpt=True), adam, cfg(stage, ("Block",)))
        _train(p, _lm_steps, 3, ADAM_TOL, f"stage {stage}")


def test_train_parity_with_activation_checkpointing(world):
    """``test_train_parity_with_activation_checkpointing`` (torch.utils.checkpoint per block,
    tied embedding and head)."""
    world(2).run(case_activation_checkpointing, timeout=TIMEOUT)


class ParameterOnly(nn.Module):
    """``test_root_no_forward_inputs``: a forward without inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)

    def forward(self) -> torch.Tensor:
        return self.weight @ self.weight


def case_no_forward_inputs() -> None:
    rank, world = rank_world()
    for stage in STAGES:
        p = pair(ParameterOnly, sgd, cfg(stage))
        for step in range(2):
            target = batches(step, world, 4, [(4,)])

            def loss(m: nn.Module, r: int, t=target) -> torch.Tensor:
                return F.mse_loss(m(), t[r][0])

            reference_step(p, loss, world)
            loss(p.model, rank).backward()
            p.opt.step()
            p.opt.zero_grad()
            assert_close(p.model, p.ref, SGD_TOL, f"stage {stage} step {step}")


def test_root_no_forward_inputs(world):
    world(2).run(case_no_forward_inputs, timeout=TIMEOUT)


# -- gradient accumulation (test_fully_shard_training.py TestFullyShardGradientAccumulation) ----

MICRO = 3


def _reduced(stats) -> int:
    return stats.elements.get("all_reduce", 0) + stats.elements.get("reduce_scatter", 0)


def case_grad_accumulation() -> dict:
    """``test_gradient_accumulation``: 3 micro-batches, the first two under ``no_sync``; and
    ``test_1f1b_microbatching``: every forward first, then the backwards. Gradient traffic of an
    accumulating step equals that of a plain step (one reduction)."""
    rank, world = rank_world()
    out = {}
    for stage in STAGES:
        for schedule in ("interleaved", "1f1b"):
            p = pair(lambda: mlp_stack(8), adam, cfg(stage, ("MLPBlock",)))
            # A plain step first, on both: its gradient traffic is what one reduction moves.
            reference_step(p, mse(batches(0, world, 2, [(8,), (8,)])), world)
            mse(batches(0, world, 2, [(8,), (8,)]))(p.model, rank).backward()
            p.opt.step()
            plain = _reduced(p.opt.comm_stats())
            p.opt.zero_grad()
            for step in range(1, 4):
                none = step % 2 == 1
                micro = [batches(10 * step + k, world, 2, [(8,), (8,)]) for k in range(MICRO)]
                total = sum(mse(d)(p.ref, r) for d in micro for r in range(world))
                (total / (MICRO * world)).backward()
                p.ref_opt.step()
                p.ref_opt.zero_grad(set_to_none=none)
                if schedule == "interleaved":
                    for k, d in enumerate(micro):
                        loss = mse(d)(p.model, rank) / MICRO
                        if k < MICRO - 1:
                            with p.model.no_sync():
                                loss.backward()
                        else:
                            loss.backward()
                else:
                    losses = [mse(d)(p.model, rank) / MICRO for d in micro]
                    for k, loss in enumerate(losses):
                        if k < MICRO - 1:
                            with p.model.no_sync():
                                loss.backward()
                        else:
                            loss.backward()
                p.opt.step()
                p.opt.zero_grad(set_to_none=none)
                assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} {schedule} {step}")
                moved = _reduced(p.opt.comm_stats())
                assert moved == plain, f"stage {stage}: {moved} gradient elements != {plain}"
            out[(stage, schedule)] = plain
    return out


def test_gradient_accumulation_no_sync(world):
    out = world(2).run(case_grad_accumulation, timeout=TIMEOUT)[0]
    assert all(v > 0 for v in out.values()), out


# -- test_fully_shard_autograd.py --------------------------------------------------------------


def case_unused_forward_output() -> None:
    """``test_unused_forward_output``: both outputs in the loss for the first steps, then only
    the first; ``lin1`` a unit of its own and ``lin2`` in the root at stage 3."""
    rank, world = rank_world()
    for stage in STAGES:
        p = pair(DoubleLinear, adam, cfg(stage), unit_policy=lambda n, m: n == "lin1")
        for step in range(5):
            none = step % 2 == 1
            p.opt.zero_grad(set_to_none=none)
            p.ref_opt.zero_grad(set_to_none=none)
            data = batches(step, world, 2, [(8,)])

            def loss(m: nn.Module, r: int, data=data, both=step < 2) -> torch.Tensor:
                out1, out2 = m(data[r][0])
                return (out1 * out2).sum() if both else out1.sum()

            reference_step(p, loss, world, step=False)
            p.ref_opt.step()
            loss(p.model, rank).backward()
            p.opt.step()
            assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} step {step}")


def test_unused_forward_output(world):
    world(2).run(case_unused_forward_output, timeout=TIMEOUT)


def case_unused_forward_module() -> None:
    """``test_unused_forward_module``: ``lin2`` (its own unit at stage 3) never runs."""
    for stage in STAGES:
        p = pair(lambda: DoubleLinear(8, False), adam, cfg(stage, ("Linear",)))
        with full(p.model):
            before = p.model.lin2.weight.detach().clone()
        _train(p, _mse_steps(8, 8), 3, ADAM_TOL, f"stage {stage}")
        with full(p.model):
            assert torch.equal(p.model.lin2.weight, before), "an unused module was updated"


def test_unused_forward_module(world):
    world(2).run(case_unused_forward_module, timeout=TIMEOUT)


def case_nontensor_activations() -> list:
    """``test_nontensor_activations`` (list, tuple, namedtuple, dict) and the fp32 case of
    ``test_structured_input_output`` (dataclass, nested dataclass) between units."""
    done = []
    for kind in CONTAINERS:
        for stage in STAGES:
            p = pair(lambda k=kind: container_model(k), adam, cfg(stage, ("ContainerLayer",)))
            _train(p, _mse_steps(8, 8), 2, ADAM_TOL, f"{kind} stage {stage}")
            done.append((kind, stage))
    return done


def test_nontensor_activations(world):
    world(2).run(case_nontensor_activations, timeout=TIMEOUT)


def case_post_acc_grad_hook() -> dict:
    """``test_post_acc_grad_hook_runs``: a hook the user registers on every parameter runs
    once per parameter per backward."""
    out = {}
    for stage in STAGES:
        p = pair(lambda: MLPBlock(8), sgd, cfg(stage, ("Linear",)))
        counts: dict[str, int] = {}
        for name, param in p.model.named_parameters():
            param.register_post_accumulate_grad_hook(
                lambda _, name=name, counts=counts: counts.__setitem__(
                    name, counts.get(name, 0) + 1
                )
            )
        p.model(torch.randn(2, 8)).sum().backward()
        out[stage] = dict(counts)
        p.opt.step()
    return out


def test_post_acc_grad_hook_runs(world):
    out = world(2).run(case_post_acc_grad_hook, timeout=TIMEOUT)[0]
    names = ["in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias"]
    for stage in STAGES:
        assert out[stage] == dict.fromkeys(names, 1), (stage, out[stage])


# -- test_fully_shard_frozen.py ----------------------------------------------------------------


def _bitfit() -> nn.Module:
    m = mlp_stack(8)
    for name, param in m.named_parameters():
        if "bias" not in name:
            param.requires_grad_(False)
    return m


def case_frozen_per_group() -> dict:
    """``test_train_mixed_requires_grad_per_group`` (BitFit: biases only, frozen at
    initialize), plain and checkpointed blocks; only the biases are reduced and gathered."""
    out = {}
    for stage in STAGES:
        p = pair(_bitfit, adam, cfg(stage, ("MLPBlock",)))
        with full(p.model):
            frozen = {
                n: q.detach().clone() for n, q in p.model.named_parameters() if "bias" not in n
            }
        _train(p, _mse_steps(8, 8), 3, ADAM_TOL, f"stage {stage}")
        with full(p.model):
            for n, q in p.model.named_parameters():
                if n in frozen:
                    assert torch.equal(q, frozen[n]), f"stage {stage}: frozen {n} changed"
        out[stage] = dict(p.opt.comm_stats().elements)
    return out


def test_train_mixed_requires_grad_per_group(world):
    out = world(2).run(case_frozen_per_group, timeout=TIMEOUT)[0]
    biases = 3 * (16 + 8)  # 72 trainable elements (multiples of 8: no padding with 2 ranks)
    assert out[0] == {"all_reduce": biases}, out[0]
    assert out[1] == {"reduce_scatter": biases, "all_gather": biases}, out[1]
    assert out[2] == {"reduce_scatter": biases, "all_gather": biases}, out[2]
    # Stage 3: gathered in forward and again in backward (the root unit owns nothing).
    assert out[3] == {"reduce_scatter": biases, "all_gather": 2 * biases}, out[3]


def _interleaved_frozen() -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(6):
        lin = nn.Linear(8, 8)
        lin.requires_grad_(i % 2 == 1)  # frozen, trainable, frozen, ...
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers)


def case_frozen_across_groups() -> None:
    """``test_train_mixed_requires_grad_across_groups``: frozen and trainable Linear units
    interleaved; the middle iteration is a forward under ``torch.no_grad()`` only."""
    rank, world = rank_world()
    for stage in STAGES:
        p = pair(_interleaved_frozen, adam, cfg(stage, ("Linear",)))
        for step in range(3):
            data = batches(step, world, 4, [(8,), (8,)])
            if step == 1:
                with torch.no_grad():
                    got = F.mse_loss(p.model(data[rank][0]), data[rank][1])
                    want = F.mse_loss(p.ref(data[rank][0]), data[rank][1])
                assert torch.allclose(got, want, rtol=1e-6), f"stage {stage}: no_grad loss"
                continue
            reference_step(p, mse(data), world)
            mse(data)(p.model, rank).backward()
            p.opt.step()
            p.opt.zero_grad(set_to_none=step % 2 == 0)
            assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} step {step}")


def test_train_mixed_requires_grad_across_groups(world):
    world(2).run(case_frozen_across_groups, timeout=TIMEOUT)


def case_unfreeze_after_init() -> list:
    """The ``unfreeze_params=True`` variant: unfreezing after initialize is refused."""
    msgs = []
    for stage in STAGES:
        p = pair(_interleaved_frozen, adam, cfg(stage, ("Linear",)))
        p.model[0].requires_grad_(True)
        p.model(torch.randn(2, 8)).sum().backward()
        try:
            p.opt.step()
        except RuntimeError as exc:
            msgs.append(str(exc))
        else:
            raise AssertionError(f"stage {stage}: unfreezing after initialize was accepted")
    return msgs


def test_unfreeze_after_initialize_is_refused(world):
    for msgs in world(2).run(case_unfreeze_after_init, timeout=TIMEOUT):
        for msg in msgs:
            assert msg == (
                "requires_grad of a parameter changed after zerodp.initialize ('0.weight' was "
                "unfrozen); freezing or unfreezing after initialize is not supported: set "
                "requires_grad before zerodp.initialize and re-initialize"
            ), msg


class MultiForwardFrozen(nn.Module):
    """``test_multi_forward_mixed_requires_grad``: a trainable and a frozen layer applied three
    times, the trainable one once more under ``torch.no_grad()`` each time."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():  # in place, as FSDP2's test: x keeps its autograd history
                x += F.relu(self.layer_with_grad(x))
        return x


def case_multi_forward_frozen() -> None:
    for stage in STAGES:
        p = pair(MultiForwardFrozen, adam, cfg(stage, ("Linear",)))
        _train(p, _mse_steps(5, 5), 3, ADAM_TOL, f"stage {stage}")


def test_multi_forward_mixed_requires_grad(world):
    world(2).run(case_multi_forward_frozen, timeout=TIMEOUT)


# -- test_fully_shard_clip_grad_norm_.py -------------------------------------------------------


def case_clip_grad_norm() -> dict:
    """``test_clip_grad_norm_1d``: norm types 2, 1, inf; the returned total norm equals torch's
    on the unsharded gradients and every step clips (SGD: the update is the clipped gradient)."""
    rank, world = rank_world()
    out = {}
    for stage in STAGES:
        for norm_type in (2.0, 1.0, float("inf")):
            p = pair(Stack, sgd, cfg(stage, ("Block",)))
            for step in range(2):
                losses = lm_loss(token_batches(step, world))
                reference_step(p, losses, world, step=False)
                want = torch.nn.utils.clip_grad_norm_(p.ref.parameters(), 0.1, norm_type)
                assert want.item() > 0.1, "the test must actually clip"
                p.ref_opt.step()
                p.ref_opt.zero_grad()
                losses(p.model, rank).backward()
                got = p.opt.clip_grad_norm_(0.1, norm_type)
                rel = abs(got.item() - want.item()) / want.item()
                assert rel <= SGD_TOL, f"stage {stage} {norm_type}: {got.item()} vs {want.item()}"
                p.opt.step()
                p.opt.zero_grad()
                assert_close(p.model, p.ref, SGD_TOL, f"stage {stage} norm {norm_type}")
                assert p.opt.last_step.grad_norm == got.item()
            out[(stage, norm_type)] = got.item()
    return out


def test_clip_grad_norm(world):
    a, b = world(2).run(case_clip_grad_norm, timeout=TIMEOUT)
    assert a == b, "ranks disagree on the total norm"


# -- test_fully_shard_comm.py ------------------------------------------------------------------


class Uniform(nn.Module):
    """3 blocks of Linear(16, 16) (272 elements each: no padding) and a root Linear(16, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def case_comm_counts() -> dict:
    """``test_fully_shard_communication_count``: collectives and elements of one step."""
    out = {}
    for stage in STAGES:
        for depth in (0, 1, 2) if stage == 3 else (1,):
            p = pair(
                Uniform,
                sgd,
                cfg(stage, bucket_bytes=1 << 20, prefetch_depth=depth),
                unit_policy=lambda n, m: n.startswith("layers."),
            )
            _train(p, _mse_steps(16, 16), 2, SGD_TOL, f"stage {stage} prefetch {depth}")
            s = p.opt.comm_stats()
            out[(stage, depth)] = (dict(s.elements), dict(s.calls))
    return out


def test_communication_count(world):
    out = world(2).run(case_comm_counts, timeout=TIMEOUT)[0]
    psi, unit = 4 * 272, 272
    assert out[(0, 1)] == ({"all_reduce": psi}, {"all_reduce": 1}), out[(0, 1)]
    for stage in (1, 2):  # one bucket: one reduce-scatter, one all-gather
        assert out[(stage, 1)] == (
            {"reduce_scatter": psi, "all_gather": psi},
            {"reduce_scatter": 1, "all_gather": 1},
        ), out[(stage, 1)]
    for depth in (0, 1, 2):
        # Forward gathers the root and 3 blocks; backward re-gathers the blocks (the root
        # stays gathered to the end of backward); one reduce-scatter per unit.
        assert out[(3, depth)] == (
            {"all_gather": psi + 3 * unit, "reduce_scatter": psi},
            {"all_gather": 7, "reduce_scatter": 4},
        ), (depth, out[(3, depth)])


# -- test_fully_shard_init.py / test_fully_shard_state_dict.py ---------------------------------


def case_rank0_broadcast_and_full_parameters() -> None:
    """``test_rank0_broadcast_meta_device_init`` / ``test_hsdp_broadcast_across_replicas``:
    ranks build different weights, initialize makes every rank hold rank 0's;
    ``test_unshard_without_lazy_init`` / ``test_param_registration_after_forward``: the full
    parameters read before the first forward and after a forward equal the unsharded ones."""
    rank, _ = rank_world()
    for stage in STAGES:
        torch.manual_seed(0)
        ref = mlp_stack(8)
        torch.manual_seed(rank)  # rank 1's weights differ
        model = mlp_stack(8)
        model, _ = zerodp.initialize(model, adam(list(model.parameters())), cfg(stage))
        with full(model):  # before any forward
            for (n, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(a, b), f"stage {stage}: {n} is not rank 0's"
        x = torch.randn(2, 8)
        assert torch.allclose(model(x), ref(x), rtol=1e-6, atol=1e-7), f"stage {stage}: forward"
        with full(model):  # after a forward, before backward
            for (n, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(a, b), f"stage {stage}: {n} after forward"


def test_rank0_weights_and_full_parameters(world):
    world(2).run(case_rank0_broadcast_and_full_parameters, timeout=TIMEOUT)


class IgnoreC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class IgnoreB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_b = nn.Linear(8, 8)
        self.module_c = IgnoreC()
        self.subtrahend = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.module_c(x)) - self.subtrahend


class IgnoreA(nn.Module):
    """FSDP2 ``test_fully_shard_ignore_params``'s A(B(C)) model."""

    def __init__(self) -> None:
        super().__init__()
        self.module_b = IgnoreB()
        self.addend = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.module_b(x) + self.addend).pow(2).mean()


def _without_c(params: list[nn.Parameter], model: nn.Module) -> torch.optim.Optimizer:
    ignored = {id(q) for q in model.module_b.module_c.parameters()}
    return adam([q for q in params if id(q) not in ignored])


def case_ignored_params() -> None:
    """``test_ddp_A_fsdp_B_ddp_C``: ``module_c``'s parameters left out of the optimizer (the
    zerodp counterpart of ignored parameters) stay as they were; the rest trains as unsharded."""
    rank, world = rank_world()
    for stage in STAGES:
        torch.manual_seed(0)
        ref, model = IgnoreA(), IgnoreA()
        model.load_state_dict(ref.state_dict())
        ref_opt = _without_c(list(ref.parameters()), ref)
        model, opt = zerodp.initialize(
            model, _without_c(list(model.parameters()), model), cfg(stage, ("IgnoreB",))
        )
        before = {k: v.clone() for k, v in ref.module_b.module_c.state_dict().items()}
        for step in range(3):
            data = batches(step, world, 8, [(8,)])
            (sum(ref(data[r][0]) for r in range(world)) / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            model(data[rank][0]).backward()
            opt.step()
            opt.zero_grad()
            assert_close(model, ref, ADAM_TOL, f"stage {stage} step {step}")
        sd = model.state_dict()
        for k, v in before.items():
            assert torch.equal(sd[f"module_b.module_c.{k}"], v), f"stage {stage}: {k} changed"


def test_ignored_params(world):
    world(2).run(case_ignored_params, timeout=TIMEOUT)
