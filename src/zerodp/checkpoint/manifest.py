"""The checkpoint manifest (pure JSON), its records, and the range math of resharding.

[Note: checkpoint format]
A checkpoint is one directory (see docs/checkpoints.md)::

    checksums.sha256         written last: SHA-256 of every file below (``sha256sum`` format)
    manifest.json            describes everything below, with each file's size and SHA-256
    common.safetensors       rank 0: replicated tensors (frozen or never-optimized parameters,
                             buffers), each flattened to 1-D
    rank-00000.safetensors   one per rank: only what that rank owned

A rank file holds, for every piece (parameter name + half-open range of its flattened elements,
see [Note: flat buffers]) the rank owned, the master values ``param/<name>/<a>-<b>`` and every
per-element optimizer state tensor ``state/<key>/<name>/<a>-<b>``, plus its RNG state. Scalar
state (Adam's ``step``) is stored in the manifest, exactly (JSON floats are float64, which holds
every float32/bf16/fp16 value). Because everything is keyed by (name, range), loading at another
world size or stage is range intersection (``plan_reads``), whatever layout wrote the ranges.
Checks of a manifest against itself and the model are in ``checks.py``; the checksums, and
why a manifest is parsed only after they match, in [Note: checkpoint checksums]
(``integrity.py``). ``checksums`` (the checksum file's name) was added to the manifest without a
format bump: a manifest without it is from before, and older readers ignore it. ``config`` is
``ZeroConfig.to_dict()``, a record of the saving run that loading does not use: zerodp 0.1 wrote
it flat, ``from_json`` gives it in the nested form whichever wrote it ([Note: flat names]).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from zerodp.config import ZeroConfig
from zerodp.config.legacy import nest_saved_config
from zerodp.partition.layout import Range

FORMAT = "zerodp.checkpoint.v1"
MANIFEST = "manifest.json"
COMMON_FILE = "common.safetensors"
RNG_TORCH = "rng/torch"


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; raised on every rank, before state changes."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def param_key(name: str, r: Range) -> str:
    return f"param/{name}/{r.start}-{r.stop}"


def state_key(key: str, name: str, r: Range) -> str:
    return f"state/{key}/{name}/{r.start}-{r.stop}"


def model_key(name: str) -> str:
    return f"model/{name}"


def buffer_key(name: str) -> str:
    return f"buffer/{name}"


def rng_cuda_key(device: int) -> str:
    return f"rng/cuda/{device}"


# -- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateEntry:
    """How one optimizer-state value of one piece is stored.

    ``elem``: a per-element tensor in the rank file (sliced when resharding); ``scalar``: a
    0-dim tensor whose ``value`` is right here; ``tensor``: any other tensor, in the rank file,
    whole; ``json``: a plain Python value (e.g. ``None``), right here."""

    kind: str
    dtype: str | None = None
    value: Any = None
    shape: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.kind in ("scalar", "json"):
            out["value"] = self.value
        if self.shape is not None:
            out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StateEntry:
        shape = tuple(d["shape"]) if "shape" in d else None
        return cls(d["kind"], d.get("dtype"), d.get("value"), shape)


@dataclass(frozen=True)
class SavedPiece:
    name: str
    range: Range
    group: int
    dtype: str  # of the saved values: the optimizer's master dtype
    state: dict[str, StateEntry]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "range": [self.range.start, self.range.stop],
            "group": self.group,
            "dtype": self.dtype,
            "state": {k: v.to_json() for k, v in self.state.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SavedPiece:
        state = {k: StateEntry.from_json(v) for k, v in d["state"].items()}
        return cls(d["name"], Range(*d["range"]), d["group"], d["dtype"], state)


@dataclass(frozen=True)
class RankRecord:
    rank: int
    file: str
    pieces: tuple[SavedPiece, ...]
    rng: dict[str, Any]  # JSON parts (python, numpy); tensor parts live in the rank file
    extra: Any

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "file": self.file,
            "pieces": [p.to_json() for p in self.pieces],
            "rng": self.rng,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankRecord:
        pieces = tuple(SavedPiece.from_json(p) for p in d["pieces"])
        return cls(d["rank"], d["file"], pieces, d["rng"], d["extra"])


@dataclass(frozen=True)
class ParamRecord:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the model's parameter dtype
    master_dtype: str  # dtype of the saved values (fp32 masters under mixed precision)
    sharded: bool  # False: replicated, stored whole in the common file
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BufferRecord:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    stage: int
    precision: str
    config: dict[str, Any]
    optimizer: dict[str, Any]  # {"class": name, "param_groups": [encoded hyperparameters]}
    scaler: Any  # encoded loss-scaler state_dict, or None
    params: tuple[ParamRecord, ...]
    buffers: tuple[BufferRecord, ...]
    state_dict: tuple[tuple[str, str, str], ...]  # (key, "param"|"buffer", canonical name)
    ranks: tuple[RankRecord, ...]
    files: dict[str, dict[str, Any]]  # file name -> {"size", "sha256"}
    counters: dict[str, int] = field(default_factory=dict)  # other engine counters
    versions: dict[str, str] = field(default_factory=dict)
    checksums: str | None = None  # the checksum file covering this manifest; None: older save
    # A model split over a tensor-parallel group: {"rank", "size", "splits": {name: [dim,
    # chunks]}} ([Note: tensor-parallel checkpoints] in tensor_parallel.py); None: not split.
    tensor_parallel: dict[str, Any] | None = None

    def to_json(self) -> str:
        d = {
            "format": FORMAT,
            "versions": self.versions,
            "step": self.step,
            "counters": self.counters,
            "world_size": self.world_size,
            "stage": self.stage,
            "precision": self.precision,
            "config": self.config,
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "params": [_record_json(p) for p in self.params],
            "buffers": [_record_json(b) for b in self.buffers],
            "state_dict": [list(e) for e in self.state_dict],
            "files": self.files,
            "ranks": [r.to_json() for r in self.ranks],
        }
        if self.checksums is not None:
            d["checksums"] = self.checksums
        if self.tensor_parallel is not None:
            d["tensor_parallel"] = self.tensor_parallel
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise CheckpointError(f"not a zerodp checkpoint manifest (format {found!r})")
        return cls(
            step=d["step"],
            world_size=d["world_size"],
            stage=d["stage"],
            precision=d["precision"],
            config=_nested_config(d["config"]),
            optimizer=d["optimizer"],
            scaler=d["scaler"],
            params=tuple(_param_record(p) for p in d["params"]),
            buffers=tuple(
                BufferRecord(b["name"], tuple(b["shape"]), b["dtype"]) for b in d["buffers"]
            ),
            state_dict=tuple((k, kind, target) for k, kind, target in d["state_dict"]),
            ranks=tuple(RankRecord.from_json(r) for r in d["ranks"]),
            files=d["files"],
            counters=d.get("counters", {}),
            versions=d.get("versions", {}),
            checksums=d.get("checksums"),
            tensor_parallel=d.get("tensor_parallel"),
        )

    def param(self, name: str) -> ParamRecord | None:
        return self._params_by_name.get(name)

    @cached_property
    def _params_by_name(self) -> dict[str, ParamRecord]:
        return {p.name: p for p in self.params}


def _nested_config(saved: Any) -> Any:
    return nest_saved_config(ZeroConfig, saved) if isinstance(saved, dict) else saved


def _record_json(rec: ParamRecord | BufferRecord) -> dict[str, Any]:
    d = dict(rec.__dict__)
    d["shape"] = list(rec.shape)
    return d


def _param_record(d: dict[str, Any]) -> ParamRecord:
    return ParamRecord(
        d["name"],
        tuple(d["shape"]),
        d["dtype"],
        d["master_dtype"],
        d["sharded"],
        d["requires_grad"],
    )


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """The manifest of a checkpoint directory, for inspection: its checksum is not verified
    (``load_checkpoint`` and ``consolidate_checkpoint`` verify it, see ``integrity.py``)."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: not a (complete) checkpoint") from None
    return parse_manifest(text, path)


def parse_manifest(text: str, path: str) -> Manifest:
    """``Manifest.from_json`` with every parse error a ``CheckpointError`` naming ``path``."""
    try:
        return Manifest.from_json(text)
    except (KeyError, TypeError, ValueError, AssertionError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path} is malformed ({type(exc).__name__}: {exc})") from None


# -- range math ---------------------------------------------------------------------------------


def split_range(r: Range, parts: int, index: int) -> Range | None:
    """The ``index``-th of ``parts`` near-equal consecutive chunks of ``r`` (None if empty).
    Stage 0 replicates everything; this spreads the writing of it over the ranks."""
    base, rem = divmod(r.numel, parts)
    start = r.start + index * base + min(index, rem)
    stop = start + base + (1 if index < rem else 0)
    return Range(start, stop) if start < stop else None


@dataclass(frozen=True)
class Source:
    """Where a range of one parameter's saved values lives."""

    file: str
    key: str  # the values' key in ``file`` (1-D)
    range: Range  # the parameter elements ``key`` holds
    piece: SavedPiece | None  # None: replicated (no optimizer state)


def sources_by_name(m: Manifest) -> dict[str, list[Source]]:
    out: dict[str, list[Source]] = {p.name: [] for p in m.params}
    for p in m.params:
        if not p.sharded:
            out[p.name].append(Source(COMMON_FILE, model_key(p.name), Range(0, p.numel), None))
    for rec in m.ranks:
        for pc in rec.pieces:
            out.setdefault(pc.name, []).append(
                Source(rec.file, param_key(pc.name, pc.range), pc.range, pc)
            )
    for srcs in out.values():
        srcs.sort(key=lambda s: s.range)
    return out


def plan_reads(sources: Sequence[Source], target: Range) -> list[tuple[Source, Range]]:
    """The saved pieces overlapping ``target`` and each overlap (parameter coordinates)."""
    out = []
    for src in sources:
        inter = src.range.intersect(target)
        if inter is not None:
            out.append((src, inter))
    return out


# -- JSON encoding of hyperparameters, scaler state and user data --------------------------------


def encode(value: Any, where: str = "value") -> Any:
    """JSON-encode ``value``, tagging tuples and 0-dim tensors so that ``decode`` restores them
    (Adam's ``betas`` must come back a tuple; a tensor ``lr`` a tensor)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, where) for v in value]}
    if isinstance(value, list):
        return [encode(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}}
    import torch  # local: keep this module importable without torch for tooling

    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {"__tensor__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    raise TypeError(
        f"{where} of type {type(value).__name__} cannot be stored in a checkpoint manifest "
        "(supported: None, bool, int, float, str, list, tuple, str-keyed dict, 0-dim tensor)"
    )


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__dict__" in value:
        return {k: decode(v) for k, v in value["__dict__"].items()}
    if "__tensor__" in value:
        import torch

        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    return {k: decode(v) for k, v in value.items()}


def check_json(value: Any, what: str) -> str:
    """An error message if ``value`` is not plain JSON (e.g. the user's ``extra``)."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        return f"{what} must be JSON-serialisable: {exc}"
    return ""
