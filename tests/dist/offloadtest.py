"""Shared by the offload tests (tests/dist/test_offload*.py): the tiny GPT, its batches, the
configuration they train with, and one clipped step."""

from __future__ import annotations

import warnings

import hf_models
import torch
import torch.distributed as dist
from zerotest import rank_world

import zerodp
from zerodp.apps.models.gpt import GPT, get_config

TIMEOUT = 240.0
STAGES = (1, 2, 3)


def offload_config(
    stage: int, precision: str, offload: str, persist: int = 0, **extra
) -> zerodp.ZeroConfig:
    """``persist``: stage 3's ``persist_numel`` (replicated small parameters, gathered in the
    step like stage 2's)."""
    blocks = ("Block", "GPT2Block", "LlamaDecoderLayer")
    units = zerodp.Stage3(unit_classes=blocks, persist_numel=persist)
    return zerodp.ZeroConfig(
        stage=stage,
        precision=precision,
        bucket_bytes=2048,  # several buckets per segment: a real pipeline
        stage3=units,
        offload=zerodp.OffloadConfig(optimizer=offload, **extra),
    )


def tiny_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(get_config("tiny", vocab_size=64, seq_len=16))


def gpt_batch(step: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (2 * world, 9), generator=g)[2 * rank : 2 * rank + 2]
    return {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}


def model_loss(kind: str, model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    if kind == "gpt":
        return model(**gpt_batch(step, rank, world))[1]
    return model(**hf_models.global_batches(kind, step, world)[rank]).loss.float()


def build_model(kind: str) -> torch.nn.Module:
    return tiny_gpt() if kind == "gpt" else hf_models.build(kind)


def fresh_run(stage: int, offload: str, precision: str = "bf16"):  # type: ignore[no-untyped-def]
    model = tiny_gpt()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return zerodp.initialize(model, inner, offload_config(stage, precision, offload))


def clipped_step(model, opt, step: int) -> None:  # type: ignore[no-untyped-def]
    rank, world = rank_world()
    opt.backward(model_loss("gpt", model, step, rank, world))
    opt.clip_grad_norm_(0.05)
    opt.step()
    opt.zero_grad()


def train_steps(  # type: ignore[no-untyped-def]
    kind: str, model, opt, sched, steps: int, *, clip: bool = True, synced: bool = False
) -> None:
    """Clip every step (``clip``), accumulate two micro-batches at step 1 (the first inside
    ``no_sync``; ``synced``: both synchronised), a scheduler after each step."""
    rank, world = rank_world()
    for step in range(steps):
        micro = 2 if step == 1 else 1
        for m in range(micro):
            loss = model_loss(kind, model, 10 * step + m, rank, world)
            if m < micro - 1 and not synced:
                with model.no_sync():
                    opt.backward(loss)
            else:
                opt.backward(loss)
        if clip:
            opt.clip_grad_norm_(0.05)
        opt.step()
        sched.step()
        opt.zero_grad()


def train(kind: str, config: zerodp.ZeroConfig, steps: int = 3, **how):  # type: ignore[no-untyped-def]
    """``how``: ``train_steps``'s options."""
    model = build_model(kind)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + s))
    model, opt = zerodp.initialize(model, inner, config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the scheduler's "step() before" warning
        train_steps(kind, model, opt, sched, steps, **how)
    params = full_params(model)
    # Through state_dict: on NVMe the optimizer's own tensors are empty between steps.
    state = state_values(opt)
    report = opt.memory_report()
    opt.close()
    return params, state, report


def compare(kind: str, want_config: zerodp.ZeroConfig, got_config: zerodp.ZeroConfig, **how):  # type: ignore[no-untyped-def]
    """Train ``kind`` under both configurations: what differs (``mismatch``: None when bitwise
    equal) and the second run's memory report."""
    want, want_state, _ = train(kind, want_config, **how)
    got, got_state, report = train(kind, got_config, **how)
    return mismatch(want, want_state, got, got_state), report


def state_values(opt) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every optimizer state value per parameter (by name, then state key): the pieces' values
    of every rank joined in element order. Offloaded runs cut parameters into more pieces
    ([Note: offload chunks]), and partial offload lays them out in other segments, so other
    ranks own them ([Note: partial offload]); element-wise, the values must be the same. A
    per-piece scalar (Adam's ``step``) is listed once, or every copy if they differ."""
    sd = opt.state_dict()
    mine: list[tuple[str, str, int, torch.Tensor]] = []
    for k, (name, start, _) in enumerate(sd["zerodp"]["pieces"]):
        for key, value in sd["state"].get(k, {}).items():
            mine.append((name, key, start, value))
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    merged: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
    for name, key, start, value in (entry for rank in everyone for entry in rank):
        merged.setdefault(name, {}).setdefault(key, []).append((start, value))
    out = []
    for name in sorted(merged):
        for key in sorted(merged[name]):
            parts = [v for _, v in sorted(merged[name][key], key=lambda part: part[0])]
            if parts[0].dim() > 0:
                out.append(torch.cat(parts))
            elif all(torch.equal(parts[0], v) for v in parts):
                out.append(parts[0])
            else:
                out += parts
    return out


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (stage 3: gathered), cloned."""
    with zerodp.full_parameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def differing(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are not bitwise equal."""
    return [n for n in want if not torch.equal(want[n], got[n])]


def mismatch(want, want_state, got, got_state) -> str | None:  # type: ignore[no-untyped-def]
    """What differs between two runs' parameters (by name) and optimizer state values (a
    count; a different number of values raises), or None when they are bitwise equal."""
    names = differing(want, got)
    states = sum(not torch.equal(a, b) for a, b in zip(want_state, got_state, strict=True))
    return f"params {names[:3]}, {states} states" if names or states else None


def relative(want: torch.Tensor, got: torch.Tensor) -> float:
    """Normwise relative difference."""
    scale = want.float().norm().item()
    diff = (want.float() - got.float()).norm().item()
    return diff / scale if scale else diff


def one_rounding(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Every element equal or one bf16 rounding apart (at most 2^-7 relative)."""
    return bool(((want.float() - got.float()).abs() <= want.float().abs() * 2.0**-7).all())
