"""Checkpoints of a model split over a tensor-parallel group ([Note: tensor parallelism]).

[Note: tensor-parallel checkpoints]
``save_checkpoint(root, ...)`` of a split model writes ``root/tp<r>/`` for TP rank r: each an
ordinary sharded checkpoint of that rank's slices by its data-parallel group (so every DP group
owns its own root: [Note: one data-parallel group per root]), whose manifest also records the
TP size, the rank and how each parameter is split. ``load_checkpoint(root, ...)`` reads
``root/tp<r>/``: at another data-parallel size it reshards as any checkpoint does; the TP size
must be the one saved (re-splitting needs the full model: consolidate, then ``parallelize`` a
full model and ``load_model_state_dict``). ``consolidate_checkpoint(root)`` joins the slices of
every TP rank into the full model's ``state_dict``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerodp.checkpoint import directory as fs
from zerodp.checkpoint.common import attempt
from zerodp.checkpoint.manifest import MANIFEST, CheckpointError, Manifest
from zerodp.tensor_parallel import Split, join_slices, layout_of, local_slice


def tp_root(directory: str | os.PathLike[str], model: nn.Module) -> Path:
    """Where this rank's checkpoints of ``model`` live under ``directory``."""
    layout = layout_of(model)
    root = Path(directory)
    return root if layout is None else root / f"tp{layout.tp.rank}"


def agreed_checkpoint(directory: str | os.PathLike[str], model: nn.Module) -> tuple[Path, str]:
    """(the checkpoint this rank loads, "" or why none). For a split model the step is agreed
    over the tensor-parallel group (a collective there: call on every rank): the newest step
    every TP rank published, so that a save that failed on some TP rank is passed over instead
    of giving the ranks different steps; ``directory`` is the root or ``root/step-N``."""
    layout = layout_of(model)
    if layout is None:
        path, error = attempt(lambda: resolve_for(directory, model))
        return path or Path(directory), error
    tp, base = layout.tp, Path(directory)
    if not (base / f"tp{tp.rank}").is_dir() and (base.parent / f"tp{tp.rank}").is_dir():
        base, wanted = base.parent, base.name  # root/step-N: that step of every TP rank
    else:
        wanted = None
    mine, error = attempt(lambda: _complete_steps(base / f"tp{tp.rank}", wanted))
    gathered = tp.comm.all_gather_object((mine or [], error))
    errors = [e for _, e in gathered if e]
    if errors:
        return base, errors[0]
    newest = _newest_common([names for names, _ in gathered])
    if newest is None:
        found = {f"tp{r}": names for r, (names, _) in enumerate(gathered)}
        return base, (
            f"no checkpoint under {base} that every tensor-parallel rank saved (complete steps "
            f"per rank: {found})"
        )
    return base / f"tp{tp.rank}" / newest, ""


def _complete_steps(root: Path, wanted: str | None) -> list[str]:
    steps = [d.name for _, d in fs.step_dirs(root) if (d / MANIFEST).is_file()]
    if wanted is not None:
        steps = [n for n in steps if n == wanted]
    return steps


def across_tp(errors: list[str], model: nn.Module) -> list[str]:
    """Every rank's errors of ``model``'s DP group and, for a split model, of the other DP
    groups of its TP group too (a collective there): the TP ranks raise together, none goes on
    to a TP collective the others never reach."""
    layout = layout_of(model)
    if layout is None:
        return errors
    gathered: list[list[str]] = layout.tp.comm.all_gather_object(errors)
    return [e for group in gathered for e in group]


def agree_on_save(model: nn.Module, directory: str | os.PathLike[str], error: str) -> None:
    """Raise on every rank of the TP group if a save failed on one of its DP groups (a
    collective over TP for a split model; nothing otherwise)."""
    layout = layout_of(model)
    if layout is None:
        return
    errors: list[str] = layout.tp.comm.all_gather_object(error)
    failed = [r for r, e in enumerate(errors) if e]
    if not failed:
        return
    first = errors[failed[0]]
    raise CheckpointError(
        f"save_checkpoint({directory}) failed on tensor-parallel rank(s) {failed}; the steps "
        "every TP rank saved stay loadable (load_checkpoint takes the newest of them):\n  "
        + first.replace("\n", "\n  ")
    )


def resolve_for(directory: str | os.PathLike[str], model: nn.Module) -> Path:
    """The checkpoint ``load_checkpoint`` reads for ``model`` (``fs.resolve`` of ``tp_root``),
    saying so where the root holds the checkpoints of a split model and this one is not."""
    root = Path(directory)
    if layout_of(model) is None and not (root / MANIFEST).is_file() and tp_roots(root):
        raise CheckpointError(
            f"{root} holds the checkpoints of a model split over a tensor-parallel group "
            "(tp0/, tp1/, ...) and this model is not split: parallelize it the same way, or "
            "consolidate the checkpoint (zerodp.consolidate_checkpoint) and load the full "
            "state_dict"
        )
    return fs.resolve(tp_root(root, model))


def tp_record(model: nn.Module) -> dict[str, Any] | None:
    """What a manifest records of ``model``'s split (None: not split)."""
    layout = layout_of(model)
    if layout is None:
        return None
    splits = {name: [s.dim, s.chunks] for name, s in sorted(layout.splits.items())}
    return {"rank": layout.tp.rank, "size": layout.tp.size, "splits": splits}


def tp_problems(m: Manifest, model: nn.Module) -> list[str]:
    """Why ``model`` cannot load the checkpoint of manifest ``m`` ([] if it can)."""
    mine, saved = tp_record(model), m.tensor_parallel
    if mine == saved:
        return []
    if saved is None or mine is None:
        how = "without" if saved is None else f"with {saved['size']}-way"
        now = "split over a tensor-parallel group" if saved is None else "not split"
        return [
            f"the checkpoint was saved {how} tensor parallelism and the model is {now}: "
            "consolidate it (zerodp.consolidate_checkpoint) and load the full state_dict"
        ]
    if saved["size"] != mine["size"]:
        return [
            f"the checkpoint was saved at tensor-parallel size {saved['size']}, the model is "
            f"split {mine['size']} ways: consolidate it (zerodp.consolidate_checkpoint), then "
            "load the full state_dict into the newly split model (load_model_state_dict)"
        ]
    return [
        "the checkpoint's tensor-parallel split differs from the model's (another plan): "
        f"saved {saved['splits']}, now {mine['splits']}"
    ]


def tp_roots(root: Path) -> list[Path] | None:
    """The ``tp<r>`` checkpoint roots under ``root``, in rank order (None: not a TP root)."""
    if not (root / "tp0").is_dir():
        return None
    roots: list[Path] = []
    while (root / f"tp{len(roots)}").is_dir():
        roots.append(root / f"tp{len(roots)}")
    return roots


def newest_common(roots: list[Path]) -> list[Path]:
    """The newest step every one of the TP ranks' ``roots`` holds complete, in each."""
    newest = _newest_common([_complete_steps(r, None) for r in roots])
    if newest is None:
        where = roots[0].parent if roots else ""
        raise CheckpointError(f"no step that every tensor-parallel rank saved under {where}")
    return [r / newest for r in roots]


def _newest_common(per_rank: list[list[str]]) -> str | None:
    """The highest-numbered step directory name in every list (None: none is in all)."""
    common = set.intersection(*(set(names) for names in per_rank)) if per_rank else set()
    return max(common, key=lambda n: int(n.rpartition("-")[2])) if common else None


def check_single_part(m: Manifest, path: Path) -> None:
    """Refuse to consolidate one TP rank's slices as if they were the model."""
    record = m.tensor_parallel
    if record is not None:
        raise CheckpointError(
            f"cannot consolidate {path}: it holds tensor-parallel rank {record['rank']}'s slices "
            f"of a model split {record['size']} ways; consolidate the directory that holds "
            "tp0/, tp1/, ... (the slices are joined into the full model)"
        )


def check_tp_parts(manifests: list[Manifest]) -> list[str]:
    """Problems with joining the TP ranks' checkpoints of ``manifests`` (rank order)."""
    records = [m.tensor_parallel for m in manifests]
    if any(r is None for r in records):
        return ["a tp<r> directory holds a checkpoint saved without tensor parallelism"]
    size = records[0]["size"] if records[0] else 0
    # The steps agree by construction: newest_common picked one directory name for all.
    if len(manifests) != size:
        return [f"{len(manifests)} tp<r> directories for tensor-parallel size {size}"]
    return []


def split_of(m: Manifest, name: str) -> Split | None:
    record = m.tensor_parallel
    if record is None or name not in record["splits"]:
        return None
    dim, chunks = record["splits"][name]
    return Split(dim, chunks)


def full_shape(shape: tuple[int, ...], split: Split | None, size: int) -> tuple[int, ...]:
    if split is None:
        return shape
    return tuple(n * size if d == split.dim else n for d, n in enumerate(shape))


def joined(parts: list[torch.Tensor], split: Split | None, shape: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from the TP ranks' (flat) ``parts`` of local ``shape``."""
    if split is None:
        return parts[0]
    return join_slices([p.view(shape) for p in parts], split)


def sliced(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with every full tensor of a split parameter cut to this rank's slice
    (pretrained full weights into a split model); tensors already of the slice's shape stay."""
    layout = layout_of(model)
    if layout is None:
        return state_dict
    out = dict(state_dict)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tp = layout.tp
    for name, split in layout.splits.items():
        t = out.get(name)
        if t is not None and tuple(t.shape) == full_shape(shapes[name], split, tp.size):
            out[name] = local_slice(t, split, tp.rank, tp.size)
    return out
