"""Released CPU full buffers kept for the next gather ([Note: reused gather memory] in
params/reuse.py): the memory is handed over by swapping data pointers, so views made of the
buffer before stay valid; what is kept plus what is in use stays under the limit."""

from __future__ import annotations

import torch

from zerodp.params.reuse import GatherMemory

NUMEL = 1000
NBYTES = NUMEL * 4


def _buffer() -> tuple[torch.Tensor, torch.Tensor]:
    """A resident full buffer (empty storage) and a view made while it had memory."""
    buf = torch.empty(NUMEL)
    view = buf[10:20]
    buf.untyped_storage().resize_(0)
    return buf, view


def test_released_memory_goes_to_the_next_gather_of_that_size() -> None:
    memory = GatherMemory(lambda: 3 * NBYTES)
    a, _ = _buffer()
    b, b_view = _buffer()
    memory.fill(a.untyped_storage(), NBYTES, in_use=0)  # nothing kept yet: allocated
    assert a.untyped_storage().nbytes() == NBYTES
    a.fill_(7.0)
    where = a.data_ptr()
    memory.take(a.untyped_storage(), in_use=0)
    assert a.untyped_storage().nbytes() == 0
    assert memory.cached_bytes == NBYTES
    memory.fill(b.untyped_storage(), NBYTES, in_use=0)
    assert b.data_ptr() == where  # the same memory, no new allocation
    assert memory.cached_bytes == 0
    b_view.fill_(3.0)  # the view made before the swap writes into the new memory
    assert b[10:20].eq(3.0).all()
    assert b.untyped_storage().nbytes() == NBYTES


def _empty(numel: int) -> torch.Tensor:
    t = torch.empty(numel)
    t.untyped_storage().resize_(0)
    return t


def test_other_sizes_allocate_and_free_what_no_longer_fits() -> None:
    memory = GatherMemory(lambda: 4 * NBYTES)
    a, _ = _buffer()
    memory.fill(a.untyped_storage(), NBYTES, in_use=0)
    memory.take(a.untyped_storage(), in_use=0)
    c = _empty(2 * NUMEL)
    memory.fill(c.untyped_storage(), 2 * NBYTES, in_use=0)  # 1 kept + 2 fit under 4
    assert c.untyped_storage().nbytes() == 2 * NBYTES
    assert memory.cached_bytes == NBYTES  # the other size is still kept
    d = _empty(2 * NUMEL)
    memory.fill(d.untyped_storage(), 2 * NBYTES, in_use=2 * NBYTES)  # c gathered: 1 + 2 + 2 > 4
    assert d.untyped_storage().nbytes() == 2 * NBYTES
    assert memory.cached_bytes == 0  # the kept 1 x was freed to make room


def test_room_is_made_from_the_largest_size_under_the_bound_read_then() -> None:
    bound = [6 * NBYTES]
    memory = GatherMemory(lambda: bound[0])
    small, large = _empty(NUMEL), _empty(2 * NUMEL)
    for t, nbytes in ((small, NBYTES), (large, 2 * NBYTES)):
        memory.fill(t.untyped_storage(), nbytes, in_use=0)
    memory.take(small.untyped_storage(), in_use=2 * NBYTES)
    memory.take(large.untyped_storage(), in_use=0)
    assert memory.cached_bytes == 3 * NBYTES  # both sizes kept
    memory.make_room(4 * NBYTES, in_use=0)  # 3 + 4 > 6: the 2 x goes, the 1 x stays
    assert memory.cached_bytes == NBYTES
    memory.fill(large.untyped_storage(), 2 * NBYTES, in_use=0)  # allocated: none of that size
    assert memory.cached_bytes == NBYTES
    bound[0] = 2 * NBYTES  # e.g. buffers re-stored in bf16: read at the next allocation
    memory.fill(_empty(3 * NUMEL).untyped_storage(), 3 * NBYTES, in_use=0)
    assert memory.cached_bytes == 0  # 1 + 3 > 2: the kept 1 x was freed
    memory.take(large.untyped_storage(), in_use=3 * NBYTES)  # over the new bound: freed
    assert memory.cached_bytes == 0 and large.untyped_storage().nbytes() == 0


def test_nothing_kept_beyond_the_limit() -> None:
    memory = GatherMemory(lambda: 2 * NBYTES)
    a, _ = _buffer()
    b, _ = _buffer()
    for t in (a, b):
        memory.fill(t.untyped_storage(), NBYTES, in_use=0)
    memory.take(a.untyped_storage(), in_use=NBYTES)  # b still gathered: room for a
    assert memory.cached_bytes == NBYTES
    memory.take(b.untyped_storage(), in_use=0)  # kept + b would be 2 x: still room
    assert memory.cached_bytes == 2 * NBYTES
    c = torch.empty(NUMEL)  # gathered besides (a private gather's own buffer)
    memory.take(c.untyped_storage(), in_use=0)  # 3 x: over the limit, freed
    assert memory.cached_bytes == 2 * NBYTES
    assert c.untyped_storage().nbytes() == 0
