"""The protocol every data source implements so `PrefetchReader` can drive it.

A source is stateless: ``read_slice(state, global_batch, rank, world)`` reads the global batch that
starts at ``state`` and returns this rank's contiguous slice ``[rank * B, (rank + 1) * B)`` with
``B = global_batch // world``, together with the state of the following global batch. Every rank
passes the same state and gets the same next state, so the position never depends on the rank.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from mpickpt.data.batch import Batch
from mpickpt.data.position import ReaderState


@runtime_checkable
class SliceSource(Protocol):
    """A stateless, thread-safe reader of rank slices of global batches."""

    def read_slice(self, state: ReaderState, global_batch: int, rank: int,
                   world: int) -> tuple[Batch | None, ReaderState]:
        """Return (this rank's slice or None at end of data, next state). Local."""
        ...


def local_slice(global_batch: int, rank: int, world: int) -> range:
    """Sample offsets of ``rank``'s slice inside a global batch; checks the arguments. Local."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if global_batch < 1 or global_batch % world:
        raise ValueError(f"global batch must be a positive multiple of the world size {world}, "
                         f"got {global_batch}")
    local = global_batch // world
    return range(rank * local, (rank + 1) * local)
