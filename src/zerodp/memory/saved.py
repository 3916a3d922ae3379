"""Bytes autograd saves for backward (the activations a step holds), counted by storage.

A tensor's bytes are those of its *storage*, once: a parameter that is a view into a flat buffer
counts the buffer, a view of an activation counts the activation once. A DTensor counts its
local shard's storage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def local_tensor(t: Any) -> torch.Tensor | None:
    """The tensor whose storage this rank holds: a DTensor's local shard, else ``t`` itself;
    ``None`` for non-tensors and meta tensors."""
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "_local_tensor", None)  # DTensor, without importing its module
    if isinstance(local, torch.Tensor):
        t = local
    return None if t.is_meta else t


class SavedForBackward:
    """Bytes autograd saves for backward inside the ``with`` block (unique storages; a view
    counts its whole storage once). Storages of ``exclude`` (the parameters as the rank holds
    them at rest) are counted apart: saving them costs no memory. Parameters gathered for the
    step (stage 3, FSDP) are saved too, but freed after the unit's forward (their storage is
    resized to 0 and gathered again for backward): ``alive_bytes()`` says what is still held.
    """

    def __init__(self, exclude: Iterable[Any]) -> None:
        params = list(exclude)
        tensors = (local_tensor(x) for x in params)
        self._exclude = {storage_key(t) for t in tensors if t is not None}
        # The parameters themselves, and views of them, whatever storage they have when saved:
        # a stage-3 unit's parameters then view its gathered buffer, which a unit held into the
        # backward (the root, the last block) keeps alive; those bytes are gathered
        # parameters, not activations.
        self._param_ids = {id(x) for x in params}
        self._seen: set[tuple[str, int]] = set()
        self._storages: list[torch.UntypedStorage] = []
        self.nbytes = 0
        self.param_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(RuntimeError):  # no storage (sparse, nested): not counted
            key = storage_key(t)
            # Seen by storage object, not address: a stage-3 unit's buffer freed after its
            # forward may hand its address to a later activation, which must still count.
            ident = (key[0], t.untyped_storage()._cdata)
            if key[1] != 0 and ident not in self._seen:
                self._seen.add(ident)
                n = t.untyped_storage().nbytes()
                base = t._base
                is_param = id(t) in self._param_ids or (
                    base is not None and id(base) in self._param_ids
                )
                if key in self._exclude or is_param:
                    self.param_bytes += n
                else:
                    self.nbytes += n
                    self._storages.append(t.untyped_storage())
        return t

    def alive_bytes(self) -> int:
        """Bytes of the saved (non-parameter) storages now; less than ``nbytes`` where some
        were freed since (gathered parameters)."""
        return sum(st.nbytes() for st in self._storages)

    def release(self) -> None:
        """Drop the references to the storages (autograd keeps what it needs)."""
        self._storages.clear()

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
