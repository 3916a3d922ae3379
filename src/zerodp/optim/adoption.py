"""Parameters zerodp meets after ``initialize``: unfrozen ones, and those of
``opt.add_param_group``. This module decides *what* to adopt and checks that every rank adopts
the same; the engine then builds the components for them (``ZeroEngine._adopt``).

[Note: unfreezing] A parameter frozen at ``initialize`` has no segment, bucket or optimizer
piece. When it requires grad again (progressive unfreezing), the first forward with grad enabled
adopts it, before any gradient of it exists: new segments (stage 3: persistent ones) built like
the first ones, their masters and gather, a reducer over every segment, and the optimizer rebound
to the pieces, each old piece keeping its state. Every rank must unfreeze the same parameters
before the same forward (checked: one small collective, only then). Freezing a trainable
parameter needs nothing: it gets no gradient and is not stepped, as a parameter unused in a step.

[Note: param groups added after initialize] ``opt.add_param_group`` as in torch (the group keeps
its options; the defaults fill the rest), its parameters sharded like the others. One already
known to zerodp (frozen at ``initialize``, or trainable in no group) joins the group: it is
stepped from its next gradient on (a frozen one once unfrozen, [Note: unfreezing]). One
registered in the model after ``initialize`` is broadcast from rank 0 and adopted (stage 3: a
persistent segment), or replicated if frozen. Every rank must add the same parameters and
options (checked: one small collective; otherwise every rank raises and nothing changes);
adopting a new trainable parameter rebuilds the reducer, so no gradient may be pending then
(after ``opt.zero_grad()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.optim.compute_dtype import Cast
from zerodp.partition.segment import Segment

Named = list[tuple[str, nn.Parameter]]


def take_unfrozen(frozen: Named, comm: Communicator, used: list[list[bool]]) -> tuple[Named, Named]:
    """``frozen`` split into (still frozen, unfrozen since), after checking with every rank
    that they unfroze the same ones ([Note: unfreezing])."""
    unfrozen = [(n, p) for n, p in frozen if p.requires_grad]
    check_unfrozen(comm, [n for n, _ in unfrozen], used)
    return [(n, p) for n, p in frozen if not p.requires_grad], unfrozen


@dataclass(frozen=True, slots=True)
class AddedGroup:
    """A group given to ``opt.add_param_group``, checked on every rank."""

    given: list[Any]  # the parameters as given (torch's add_param_group sees these)
    params: list[nn.Parameter]  # without duplicates
    new_frozen: Named  # registered after initialize, frozen: replicated
    new_trainable: Named  # registered after initialize, trainable: adopted


def examine_added_group(
    group: dict[str, Any],
    model: nn.Module,
    segments: list[Segment],
    frozen: Named,
    groups: dict[int, int],  # id -> optimizer group of the parameters in one
    used: list[list[bool]],
    comm: Communicator,
) -> AddedGroup:
    """What adding ``group`` adopts; raises the same ``ValueError`` on every rank, with
    nothing changed, if some rank cannot add it ([Note: param groups added after
    initialize])."""
    given = group["params"]
    given = [given] if isinstance(given, torch.Tensor) else list(given)
    params = list(dict.fromkeys(given))  # torch warns about duplicates (add_param_group)
    names = {id(p): n for n, p in model.named_parameters()}
    known = {id(p) for seg in segments for p in seg.params} | {id(p) for _, p in frozen}
    new = [(names[id(p)], p) for p in params if id(p) in names and id(p) not in known]
    device = segments[0].device if segments else None
    pending = any(map(any, used)) and any(p.requires_grad for _, p in new)
    problem = added_group_problem(params, names, groups, device, pending)
    labels = [names.get(id(p), f"<unnamed {type(p).__name__}>") for p in params]
    options = sorted((k, repr(v)) for k, v in group.items() if k != "params")
    check_added_group(comm, labels, options, problem)
    return AddedGroup(
        given,
        params,
        [(n, p) for n, p in new if not p.requires_grad],
        [(n, p) for n, p in new if p.requires_grad],
    )


def replicate_frozen(frozen: Named, comm: Communicator, cast: Cast) -> None:
    """Frozen parameters new to zerodp: rank 0's values, in the compute dtype, as at
    ``initialize``."""
    with torch.no_grad():
        for _, p in frozen:
            if comm.world_size > 1:
                comm.broadcast(p.data)
            cast.parameter(p)


def check_unfrozen(comm: Communicator, names: list[str], used: list[list[bool]]) -> None:
    """Before adopting unfrozen parameters ([Note: unfreezing]): every rank must
    have unfrozen the same ones, with no gradient accumulated since the last ``zero_grad``
    (the re-planned reducer starts from zero). Raises the same error on every rank."""
    pending = any(any(u) for u in used)
    everyone = comm.all_gather_object((names, pending))
    problems = [
        f"rank {r} unfroze {theirs} but rank 0 unfroze {everyone[0][0]}"
        for r, (theirs, _) in enumerate(everyone)
        if theirs != everyone[0][0]
    ]
    problems += [
        f"rank {r} has gradients accumulated since the last zero_grad (a backward ran before "
        "this forward): unfreeze parameters after opt.step() / opt.zero_grad(), not between "
        "micro-batches"
        for r, (_, late) in enumerate(everyone)
        if late
    ]
    if problems:
        raise RuntimeError("zerodp: cannot adopt unfrozen parameters:\n  " + "\n  ".join(problems))


def added_group_problem(
    params: list[Any],
    names: dict[int, str],  # id -> name of the model's parameters
    groups: dict[int, int],  # id -> optimizer group of the parameters in one
    device: torch.device | None,  # the model's
    pending: bool,  # a new trainable parameter while gradients are pending
) -> str:
    """Why this rank cannot add a group of ``params`` ("" if it can)."""
    for p in params:
        if not isinstance(p, torch.Tensor):
            return f"optimizer can only optimize Tensors, but one of the params is {type(p)}"
        if id(p) not in names:
            return (
                f"a tensor of shape {tuple(p.shape)} is not a parameter of the model given to "
                "zerodp.initialize: register it in the model on every rank first (e.g. as a "
                "submodule's parameter), so that zerodp can broadcast and shard it"
            )
        name = names[id(p)]
        if id(p) in groups:
            return (
                f"parameter '{name}' is already in param group {groups[id(p)]} (some "
                "parameters appear in more than one parameter group)"
            )
        if device is not None and p.device != device:
            return f"parameter '{name}' is on {p.device}, the model on {device}"
    if pending:
        return (
            "gradients are pending since the last zero_grad: add a group with new trainable "
            "parameters after opt.step() and opt.zero_grad(), not between micro-batches"
        )
    return ""


def check_added_group(
    comm: Communicator, labels: list[str], options: list[tuple[str, str]], problem: str
) -> None:
    """Before ``opt.add_param_group`` changes anything ([Note: param groups added after
    initialize]): every rank adds the same parameters with the same options, and
    no rank found a problem. Raises the same ``ValueError`` on every rank."""
    everyone = comm.all_gather_object((labels, options, problem))
    first_labels, first_options, _ = everyone[0]
    problems = [f"rank {r}: {p}" for r, (_, _, p) in enumerate(everyone) if p]
    for r, (theirs, opts, _) in enumerate(everyone):
        if theirs != first_labels:
            problems.append(f"rank {r} adds {theirs} but rank 0 adds {first_labels}")
        elif opts != first_options:
            problems.append(f"rank {r} adds the group with options {opts}, rank 0 {first_options}")
    if problems:
        raise ValueError(
            "zerodp: opt.add_param_group refused, nothing was changed:\n  "
            + "\n  ".join(problems)
            + "\n(every rank must add the same model parameters, with no gradient pending if "
            "one is new; or pass every group to the optimizer before zerodp.initialize)"
        )
