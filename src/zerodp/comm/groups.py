"""Which process group zerodp runs on, and names one group claims for the whole job.

[Note: data-parallel sub-groups]
``zerodp.initialize(..., process_group=...)`` takes the data-parallel group: ``None`` (the
default group), a ``ProcessGroup``, or a 1-D ``DeviceMesh`` such as ``mesh["dp"]`` of a DP x TP
mesh. It is resolved to a ``ProcessGroup`` once, here; every zerodp collective then runs on it
and names group ranks (``group_src``/``group_dst``), never global ones: with
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`` the DP groups are {0, 2} and
{1, 3}, so global rank 2 is group rank 1. Collectives of the other dimensions (the TP all-reduces
inside the model's forward) are the model's, not zerodp's, and never enter its ledger.

Clipping follows: ``clip_grad_norm_`` combines gradient norms over this group only. With tensor
parallelism each rank holds its TP shard of the model, so the norm is that of this TP rank's
shards, not the model's, and TP ranks clip by different factors. The model's norm needs the
p-th powers summed over TP as well, counting the parameters replicated over TP once: that
belongs with tensor-parallel support, not here. A model replicated over the other dimensions
(the same parameters on every TP rank) gets the true norm.

Several DP groups of one job share no zerodp collective, but they may share a filesystem:
``claim`` lets one group own a name (a checkpoint root) for the job's lifetime through the
default group's store, with no collective between groups that never meet.
"""

from __future__ import annotations

from typing import TypeAlias

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# What ``process_group=`` accepts (``None``: the default group).
GroupLike: TypeAlias = ProcessGroup | DeviceMesh | None


def resolve_group(process_group: GroupLike) -> ProcessGroup | None:
    """The ``ProcessGroup`` to run on (``None``: the default group). A multi-dimensional mesh is
    refused: ZeRO shards over the data-parallel dimension only, and which one that is is the
    caller's to say."""
    if isinstance(process_group, DeviceMesh):
        if process_group.ndim != 1:
            names = process_group.mesh_dim_names
            dims = f"dimensions {names}" if names else f"shape {tuple(process_group.shape)}"
            raise ValueError(
                f"process_group is a {process_group.ndim}-D DeviceMesh ({dims}); zerodp shards "
                'over the data-parallel group only: pass that dimension, e.g. mesh["dp"]'
            )
        return process_group.get_group()
    if isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group returns on a rank outside the group (an int, not a group).
        raise ValueError(not_a_member_message())
    if process_group is not None and not isinstance(process_group, ProcessGroup):
        raise TypeError(
            "process_group must be None (the default group), a torch.distributed.ProcessGroup "
            f'or a 1-D DeviceMesh such as mesh["dp"]; got {type(process_group).__name__}'
        )
    return process_group


def not_a_member_message() -> str:
    return (
        f"this process (global rank {dist.get_rank()}) is not a member of the process_group "
        "given to zerodp: call zerodp.initialize on the members of that group only, each with "
        "the data-parallel group it belongs to"
    )


def members(group: ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group``, index = group rank."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def claim(name: str, group: ProcessGroup | None) -> tuple[int, ...]:
    """Claim ``name`` for ``group`` for the rest of the job (the default group's lifetime) and
    return the global ranks of the group holding it: ``group``'s own unless another group
    claimed it first. One store operation, no collective; call it on one rank of ``group``."""
    store = dist.distributed_c10d._get_default_store()
    mine = ",".join(map(str, members(group)))
    # compare_set writes ``mine`` only where the key is absent ("" expected) and returns the
    # value now stored: ours, or the first claimant's.
    held = store.compare_set(f"zerodp/claim/{name}", "", mine)
    text = held.decode() if isinstance(held, bytes) else str(held)
    return tuple(int(r) for r in text.split(",") if r)


def dp_tp_mesh(tensor_parallel: int, device_type: str) -> DeviceMesh:
    """The world as a DP x TP mesh (dimensions "dp" and "tp"): ranks r and r + 1 of a TP group
    are neighbours (on one node they share its fast links), the DP groups stride by
    ``tensor_parallel``. Call on every rank."""
    world = dist.get_world_size()
    if tensor_parallel < 1 or world % tensor_parallel:
        raise ValueError(
            f"a tensor-parallel size of {tensor_parallel} does not divide the world of {world} "
            "ranks"
        )
    shape = (world // tensor_parallel, tensor_parallel)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp"))
