"""The mixed-precision step, one bucket at a time, through a constant-size fp32 scratch.

[Note: chunked fp32 gradients]
Under bf16/fp16 the optimizer needs the owned gradient in fp32, divided by the loss scale (and
multiplied by the clip coefficient). Materialising it whole would allocate 4Ψ (stage 0) or 4Ψ/N
bytes at every step: ZeRO-R's M_D rule says no per-step model-sized allocation. Instead one
fp32 *scratch* of the largest chunk is allocated once, at ``initialize``, and the owned gradient
is processed in chunks: a chunk is one bucket's owned slice (stages 1-3; stage 3: a unit's shard)
or one whole bucket (stage 0), so the scratch is bounded by ``bucket_bytes`` (or a stage-3
unit's shard), not by the model. Every optimizer piece lies in one bucket, hence in one chunk.
Filling the scratch for a chunk is always the same: upcast the reduced compute-dtype gradient,
multiply by 1/loss_scale, then by each clip coefficient of this step, in order.

- ``nonfinite`` (pass 1, ``finish_gradients``): fill each chunk and accumulate the non-finite
  flag with ``torch._amp_foreach_non_finite_check_and_unscale_`` (inverse scale 1: a check only)
  into a persistent one-element tensor: nothing proportional to the chunk is allocated;
- ``clip`` (``clip_grad_norm_``): fill each chunk, ``torch._foreach_norm`` of its used pieces;
  the per-piece norms are combined exactly as ``optim/clip.py`` does for fp32;
- ``step``: fill each chunk, point ``.grad`` of that chunk's used pieces at views of the scratch
  (every other piece's ``.grad`` is ``None``), call the inner optimizer's ``step``, clear them.
  An element-wise optimizer steps each piece exactly once per step, with exactly the values the
  whole fp32 gradient would have given it: results are bitwise those of the unchunked step.

The inner optimizer's ``step`` therefore runs once per chunk that has a used piece (a hook
registered on the inner optimizer runs that often; ``ZeroOptimizer``'s own hooks run once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerodp.optim.clip import NormScope, clip_coefficient, combine_norms
from zerodp.optim.masters import ReducedGrads
from zerodp.optim.pieces import OptimPiece
from zerodp.partition.segment import Segment


@dataclass(frozen=True, slots=True)
class Chunk:
    seg: int
    bucket: int
    numel: int
    pieces: tuple[tuple[int, int, int], ...]  # (index in pieces, offset in chunk, numel)


ChunkPieces = dict[tuple[int, int], list[tuple[int, int, int]]]


def pieces_by_chunk(
    segments: list[Segment], pieces: list[OptimPiece], owner: int | None
) -> ChunkPieces:
    """(segment, bucket) -> the pieces in what ``owner`` steps of that bucket (a *chunk*, [Note:
    flat and shard buffers]): (index in ``pieces``, offset in the chunk, numel)."""
    out: ChunkPieces = {}
    for k, op in enumerate(pieces):
        region = segments[op.seg].layout.buckets[op.piece.bucket].region(owner)
        entry = (k, op.piece.flat_range.start - region.start, op.piece.flat_range.numel)
        out.setdefault((op.seg, op.piece.bucket), []).append(entry)
    return out


class ChunkedGrads:
    """See [Note: chunked fp32 gradients]."""

    writes_params = False

    def __init__(
        self,
        segments: list[Segment],
        pieces: list[OptimPiece],
        *,
        owner: int | None,
        factors: Callable[[], list[torch.Tensor]] | None = None,
    ) -> None:
        """``factors``: where this step's clip coefficients come from when another runner
        clips (partial offload: [Note: partial offload] in offload/partial.py)."""
        self.segments = segments
        self._factors = factors
        self.pieces = pieces
        self.sharded = owner is not None  # each rank steps its slices (stages 1-3)
        by_bucket = pieces_by_chunk(segments, pieces, owner)
        self.chunks: list[Chunk] = []
        for i, seg in enumerate(segments):
            for bucket in seg.layout.buckets:
                numel = bucket.region(owner).numel
                pcs = tuple(by_bucket.get((i, bucket.index), ()))
                self.chunks.append(Chunk(i, bucket.index, numel, pcs))
        device = segments[0].device if segments else torch.device("cpu")
        size = max((c.numel for c in self.chunks), default=0)
        self.scratch = torch.empty(size, dtype=torch.float32, device=device)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self.coefs: list[torch.Tensor] = []  # clip coefficients applied this step, in order

    def _source(self, reducer: ReducedGrads, c: Chunk) -> torch.Tensor:
        """The chunk's reduced gradient (compute dtype, or fp32 for fp32-kept segments)."""
        return reducer.grad_storage(c.seg).region(c.bucket)

    def _fill(self, reducer: ReducedGrads, c: Chunk, scale: float) -> torch.Tensor:
        buf = self.scratch.narrow(0, 0, c.numel)
        buf.copy_(self._source(reducer, c))
        if scale != 1.0:
            buf.mul_(scale)
        for coef in self.coefs if self._factors is None else self._factors():
            buf.mul_(coef)
        return buf

    def nonfinite(self, reducer: ReducedGrads, scale: float) -> bool:
        """Whether some owned gradient element is not finite (after unscaling)."""
        self._found_inf.zero_()
        for c in self.chunks:
            buf = self._fill(reducer, c, scale)
            torch._amp_foreach_non_finite_check_and_unscale_([buf], self._found_inf, self._one)
        return bool(self._found_inf.item())

    def clip(
        self,
        reducer: ReducedGrads,
        scale: float,
        used: list[list[bool]],
        max_norm: float,
        norm_type: float,
        scope: NormScope,
    ) -> torch.Tensor:
        """``clip_grad_norm`` over the used pieces' fp32 gradients; the coefficient is applied
        whenever a chunk is filled from now until the end of the step."""
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"norm_type must be positive or inf; got {norm_type}")
        norms: list[torch.Tensor | None] = [None] * len(self.pieces)
        for c in self.chunks:
            mine = [(k, off, n) for k, off, n in c.pieces if self._used(k, used)]
            if not mine:
                continue
            buf = self._fill(reducer, c, scale)
            views = [buf.narrow(0, off, n) for _, off, n in mine]
            for (k, _, _), norm in zip(mine, torch._foreach_norm(views, norm_type), strict=True):
                norms[k] = norm
        local = [(n, self.pieces[k].name) for k, n in enumerate(norms) if n is not None]
        total = combine_norms(
            [n for n, _ in local],
            [name for _, name in local],
            norm_type,
            scope,
            sharded=self.sharded,
            device=self.scratch.device,
        )
        self.coefs.append(clip_coefficient(total, max_norm))
        return total

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        reducer: ReducedGrads,
        scale: float,
        used: list[list[bool]],
    ) -> None:
        """Step ``optimizer`` chunk by chunk (see the note)."""
        for c in self.chunks:
            mine = [(k, off, n) for k, off, n in c.pieces if self._used(k, used)]
            if not mine:
                continue
            buf = self._fill(reducer, c, scale)
            for k, off, n in mine:
                self.pieces[k].tensor.grad = buf.narrow(0, off, n)
            try:
                optimizer.step()
            finally:
                for k, _, _ in mine:
                    self.pieces[k].tensor.grad = None

    def bind(self, used: list[list[bool]]) -> None:
        """Nothing: ``.grad`` points at the scratch only inside ``step``."""

    def unbind(self) -> None:
        pass

    def _used(self, k: int, used: list[list[bool]]) -> bool:
        op = self.pieces[k]
        return used[op.seg][op.slot]

    def pending_factors(self) -> list[torch.Tensor]:
        return list(self.coefs)

    @property
    def host_nbytes(self) -> dict[str, int]:
        return {}

    @property
    def timing(self) -> dict[str, float] | None:
        return None

    def reset(self) -> None:
        self.coefs = []

    @property
    def nbytes(self) -> int:
        return self.scratch.numel() * self.scratch.element_size()
