"""`full`: every row, every time; the format of every chain's baseline too. Local."""
from __future__ import annotations

from mpickpt.kinds.base import Kind
from mpickpt.store.segments import whole_files


class Full(Kind):
    """Every save writes every row and builds on nothing."""

    name = format = "full"
    tracks_rows = False
    layered = False

    def baseline_reason(self, chain, counts, reduce_max):
        return "policy full"

    def segments(self, root, manifest, parents):
        return whole_files(manifest)
