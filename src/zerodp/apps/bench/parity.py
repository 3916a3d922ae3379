"""The parity check: final parameters of a configuration against DDP's, by name.

Each rank of a launch writes its full final parameters (``runner.params_file``); the parent
compares every rank's against DDP's rank 0 as soon as both exist and deletes the files it no
longer needs (a 120M-parameter model is 480 MB per rank in fp32).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def compare_params(
    params: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """How far ``params`` are from ``reference``, by name:

    * ``model_rel_diff``: the largest ``|p - p_ref|`` over all elements / the largest
      ``|p_ref|`` in the model: the pass/fail figure;
    * ``max_rel_diff``: the largest per-tensor ``max|p - p_ref| / max|p_ref|``, and the three
      worst tensors. It is large for tensors whose true gradient is zero, whose values are
      rounding noise amplified by Adam (e.g. the key bias of attention, which softmax ignores):
      there any change of summation order shows, so it is reported but not judged;
    * ``max_abs_diff`` (0 means bit-identical).

    Names missing on either side (or of another shape) are listed and make both figures
    infinite."""
    missing = sorted(set(reference) ^ set(params))
    rel: dict[str, float] = {}
    worst_abs = scale = 0.0
    with torch.no_grad():
        for name in sorted(set(reference) & set(params)):
            p, q = params[name].detach().float(), reference[name].detach().float()
            if p.shape != q.shape:
                missing.append(name)
                continue
            if q.numel() == 0:
                continue
            diff = (p - q).abs().max().item()
            q_max = q.abs().max().item()
            rel[name] = diff / q_max if q_max > 0 else diff
            worst_abs, scale = max(worst_abs, diff), max(scale, q_max)
    ranked = sorted(rel, key=lambda n: -rel[n])
    inf = float("inf")
    return {
        "model_rel_diff": inf if missing else (worst_abs / scale if scale > 0 else worst_abs),
        "max_rel_diff": inf if missing else max(rel.values(), default=0.0),
        "max_abs_diff": worst_abs,
        "worst_parameters": {n: rel[n] for n in ranked[:3]},
        "mismatched_names": missing[:10],
    }


def compare_files(files: Sequence[str], reference_file: str) -> dict[str, Any]:
    """``compare_params`` for every rank's file against the reference; the worst over ranks."""
    ref = torch.load(reference_file, map_location="cpu", weights_only=True)
    results = [
        compare_params(torch.load(f, map_location="cpu", weights_only=True), ref) for f in files
    ]
    worst = max(results, key=lambda r: (r["model_rel_diff"], r["max_rel_diff"]))
    return {**worst, "max_abs_diff": max(r["max_abs_diff"] for r in results), "ranks": len(files)}


class ParityTracker:
    """Compares each configuration's files with the reference's once both exist."""

    def __init__(self, reference: str) -> None:
        self.reference = reference
        self._reference_file: str | None = None
        self._pending: dict[str, list[str]] = {}
        self.results: dict[str, dict[str, Any]] = {}

    def add(self, name: str, files: Sequence[str]) -> None:
        if name == self.reference:
            self._reference_file = files[0]  # replicas: rank 0 stands for all
        self._pending[name] = list(files)
        if self._reference_file is not None:
            for pending in list(self._pending):
                self._compare(pending)

    def _compare(self, name: str) -> None:
        assert self._reference_file is not None
        files = self._pending.pop(name)
        self.results[name] = compare_files(files, self._reference_file)
        for f in files:
            if f != self._reference_file:
                Path(f).unlink(missing_ok=True)
