"""State dict and checkpoint scenarios from PyTorch FSDP2's ``test_fully_shard_state_dict.py``
and ``test_fully_shard_init.py``, and FSDP2's training loop on a tiny Hugging Face GPT-2, with
zerodp's public API: 2 gloo ranks, fp32, stages 0-3, against unsharded training (Adam/AdamW:
1e-5 relative per parameter); a save/load or state_dict round trip in the same configuration
must continue **bitwise** like the uninterrupted run (docs/checkpoints.md, "Exact resume").
"""

from __future__ import annotations

import copy
import os

import torch
from fsdp2_models import ADAM_TOL, STAGES, Stack, adam, cfg, lm_loss, pair, token_batches
from hf_models import build as build_hf
from hf_models import global_batches, hf_loss
from safetensors.torch import load_file
from torch import nn
from zerotest import Pair, assert_close, full, rank_world, reference_step

import zerodp

TIMEOUT = 120.0


def _step(p, step: int, zero_none: bool = True) -> None:
    rank, world = rank_world()
    losses = lm_loss(token_batches(step, world))
    reference_step(p, losses, world, step=False)
    p.ref_opt.step()
    p.ref_opt.zero_grad(set_to_none=zero_none)
    losses(p.model, rank).backward()
    p.opt.step()
    p.opt.zero_grad(set_to_none=zero_none)


def _full_params(model) -> dict[str, torch.Tensor]:
    with full(model):
        return {n: q.detach().clone() for n, q in model.named_parameters()}


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def case_state_dict_round_trip() -> None:
    """``test_dp_state_dict_save_load`` (+ ``reshard_after_forward=False`` before and after a
    forward): ``model.state_dict()`` holds the full values under the plain keys; loading new
    values writes them to every shard; a forward without backward does not change what
    ``state_dict()`` returns, and training goes on; ``opt.state_dict()`` round trip."""
    rank, world = rank_world()
    for stage in STAGES:
        p = pair(lambda: Stack(tie=True), adam, cfg(stage, ("Block",)))
        for step in range(2):
            _step(p, step, step % 2 == 0)
        sd = p.model.state_dict()
        assert list(sd) == list(p.ref.state_dict()), f"stage {stage}: keys"
        _same({k: sd[k] for k in _full_params(p.model)}, _full_params(p.model), f"{stage} sd")

        # Load new values (every rank the same), as FSDP2 fills then loads.
        new = {k: torch.full_like(v, 0.01 * (i + 1)) for i, (k, v) in enumerate(sd.items())}
        new["head.weight"] = new["tok.weight"]  # one tied Parameter: one value
        p.model.load_state_dict(new)
        p.ref.load_state_dict(new)
        _same(dict(p.model.state_dict()), new, f"stage {stage}: after load_state_dict")

        # A forward with grad enabled and no backward, then state_dict and training.
        x = token_batches(9, world)[rank][0]
        p.model(x)
        _same(dict(p.model.state_dict()), new, f"stage {stage}: after a forward")
        for step in range(2, 4):
            _step(p, step)
            assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} step {step}")

        # Optimizer + model state_dict round trip: continues bitwise.
        saved_opt = copy.deepcopy(p.opt.state_dict())
        saved_model = {k: v.clone() for k, v in p.model.state_dict().items()}
        snapshot = copy.deepcopy(p.ref.state_dict()), copy.deepcopy(p.ref_opt.state_dict())
        for step in range(4, 6):
            _step(p, step)
        straight = _full_params(p.model)
        p.model.load_state_dict(saved_model)
        p.opt.load_state_dict(saved_opt)
        p.ref.load_state_dict(snapshot[0])
        p.ref_opt.load_state_dict(snapshot[1])
        for step in range(4, 6):
            _step(p, step)
        _same(_full_params(p.model), straight, f"stage {stage}: opt.state_dict round trip")


def test_state_dict_round_trip(world):
    world(2).run(case_state_dict_round_trip, timeout=TIMEOUT)


def case_checkpoint(root: str) -> None:
    """Save after 2 steps, continue 2 steps; a fresh model with other weights loads the
    checkpoint (same stage: bitwise continuation; next stage: resharded, parity); the
    consolidated file is the full state dict (``test_rank0_offload_full_state_dict``)."""
    rank, _ = rank_world()
    for stage in STAGES:
        path = os.path.join(root, f"stage{stage}")
        p = pair(Stack, adam, cfg(stage, ("Block",)))
        for step in range(2):
            _step(p, step)
        zerodp.save_checkpoint(path, p.model, p.opt)
        ref_at_save = copy.deepcopy(p.ref.state_dict()), copy.deepcopy(p.ref_opt.state_dict())
        for step in range(2, 4):
            _step(p, step)
            assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} step {step}")
        straight = _full_params(p.model)

        if rank == 0:
            out = os.path.join(root, f"stage{stage}.safetensors")
            zerodp.consolidate_checkpoint(path, out)
            plain = Stack()
            plain.load_state_dict(load_file(out), strict=True)
            p.ref.load_state_dict(ref_at_save[0])
            assert_close(plain, p.ref, ADAM_TOL, f"stage {stage}: consolidated")

        for load_stage in (stage, (stage + 1) % 4):
            q = pair(Stack, adam, cfg(load_stage, ("Block",)), seed=7)
            zerodp.load_checkpoint(path, q.model, q.opt)
            q.ref.load_state_dict(ref_at_save[0])
            q.ref_opt.load_state_dict(copy.deepcopy(ref_at_save[1]))  # torch aliases it
            for step in range(2, 4):
                _step(q, step)
            what = f"saved at stage {stage}, loaded at stage {load_stage}"
            if load_stage == stage:
                _same(_full_params(q.model), straight, what)
            else:
                assert_close(q.model, q.ref, ADAM_TOL, what)


def test_checkpoint_resume_and_reshard(world, tmp_path):
    world(2).run(case_checkpoint, str(tmp_path), timeout=TIMEOUT)


def case_load_model_state_dict() -> None:
    """``test_rank0_broadcast_meta_device_init`` / ``test_meta_device_1d_init``: a model built
    without materialising it (stage 3 ``zerodp.sharded_init``; stages 0-2 other random weights)
    loads a plain full state dict with ``zerodp.load_model_state_dict``, then trains as the
    unsharded model that holds those weights."""
    for stage in STAGES:
        torch.manual_seed(0)
        ref = Stack()
        torch.manual_seed(3)
        if stage == 3:
            with zerodp.sharded_init():
                model = Stack()
        else:
            model = Stack()
        model, opt = zerodp.initialize(model, adam(list(model.parameters())), cfg(stage))
        zerodp.load_model_state_dict(model, opt, ref.state_dict())
        p = Pair(model, opt, ref, adam(list(ref.parameters())))
        assert_close(p.model, p.ref, 0.0, f"stage {stage}: loaded")
        for step in range(3):
            _step(p, step)
            assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} step {step}")


def test_load_model_state_dict_into_fresh_model(world):
    world(2).run(case_load_model_state_dict, timeout=TIMEOUT)


# -- a tiny Hugging Face model in FSDP2's training loop ---------------------------------------


def _adam_hf(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    # eps=1e-6 as tests/dist/test_hf_models.py: GPT-2's key bias has an exact gradient of zero
    # and rounding noise of ~1e-10 that Adam with eps=1e-8 turns into lr-sized updates
    # (measured here: 4.5e-5 relative at stage 0 after two steps with eps=1e-8).
    return torch.optim.Adam(params, lr=1e-2, eps=1e-6)


def case_hf_gpt2() -> None:
    """FSDP2's loop (``zero_grad(set_to_none=iter % 2 == 0)``, 2 micro-batches with the first
    under ``no_sync``, ``clip_grad_norm_``) on GPT-2 (tied embedding and head), one unit per
    ``GPT2Block`` at stage 3; its ``state_dict`` is the plain model's."""
    rank, world = rank_world()
    for stage in STAGES:
        config = cfg(stage, ("GPT2Block",), bucket_bytes=4096)
        p = pair(lambda: build_hf("gpt2"), _adam_hf, config)
        for step in range(3):
            none = step % 2 == 0
            micro = [hf_loss(global_batches("gpt2", 10 * step + k, world)) for k in range(2)]
            total = sum(m(p.ref, r) for m in micro for r in range(world)) / (2 * world)
            total.backward()
            want = torch.nn.utils.clip_grad_norm_(p.ref.parameters(), 1.0)
            p.ref_opt.step()
            p.ref_opt.zero_grad(set_to_none=none)
            with p.model.no_sync():
                (micro[0](p.model, rank) / 2).backward()
            (micro[1](p.model, rank) / 2).backward()
            got = p.opt.clip_grad_norm_(1.0)
            assert abs(got.item() - want.item()) <= 1e-6 * want.item(), (got, want)
            p.opt.step()
            p.opt.zero_grad(set_to_none=none)
            assert_close(p.model, p.ref, ADAM_TOL, f"gpt2 stage {stage} step {step}")
        sd, ref_sd = p.model.state_dict(), p.ref.state_dict()
        assert list(sd) == list(ref_sd), f"stage {stage}: state_dict keys"


def test_hf_gpt2_training_loop(world):
    world(2).run(case_hf_gpt2, timeout=TIMEOUT)
