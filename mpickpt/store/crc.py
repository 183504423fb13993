"""CRC-32 with zlib's polynomial and values, at the speed of the CPU's carry-less multiply.

Every checksum mpickpt writes or checks (per-block CRCs, whole-file CRCs in manifests, survivor
dumps) is zlib's CRC-32. CPython's `zlib.crc32` computes it at ~4 GB/s here; zlib-ng's, with
PCLMULQDQ / VPCLMULQDQ folding, at 33-57 GB/s (1 MB to 64 MB buffers), the same values, and it
releases the GIL as zlib's does. That is a checkpoint writer's CRC at a tenth of its CPU, and a
restore's or a verify's CRC pass nearly free. Without the zlib-ng package (a platform without
its wheel) zlib's is used: same values, slower. Local.
"""
from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32
    IMPLEMENTATION = "zlib-ng"
except ImportError:  # pragma: no cover - where zlib-ng has no wheel
    from zlib import crc32
    IMPLEMENTATION = "zlib"

__all__ = ["crc32", "IMPLEMENTATION"]
