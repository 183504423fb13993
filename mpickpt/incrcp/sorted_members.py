"""Which of a chunk's keys a new checkpoint repeats: IncrCP's third filter, exactly.

Stage 3 of the selective extraction counts a row-0 chunk's keys that the new chunk's keys repeat,
and the chunk is then split by the same answer. Both sides are ascending: a chunk's keys as its
rows were written, and the new keys as the extractor joined them. The kernel
(`kernels/bloom_cpu.c`'s ``members``) checks both sides' order in one pass each (the new keys'
once per table where the caller checked them: `ascending`) and finds each key of the shorter
side by galloping through the longer from where the last one was, where numpy's `searchsorted`
makes a binary search of the new keys per chunk key (1/5 of its time with 400k keys in a chunk
and 37k new; a small chunk of a table with many new keys costs its own length, not theirs).
Without the kernel, or for a chunk's keys that are not strictly ascending (which the kernel
refuses rather than answer wrongly; the new keys too, unless the caller `checked` them), or with
a kernel built before `checked` existed, the answer comes from `searchsorted`, which needs only
the new keys ascending. Same answer either way. Local.
"""
from __future__ import annotations

import numpy as np

try:
    from mpickpt import _bloom_cpu as KERNEL
except ImportError:  # built without a C compiler
    KERNEL = None


def members(gids: np.ndarray, keys: np.ndarray, checked: bool = False) -> np.ndarray:
    """A mask of `gids` (a chunk's keys) that are among `keys` (strictly ascending: `checked`
    says the caller made sure of it, see `ascending`, and the kernel then takes it on trust).
    Local."""
    if KERNEL is not None and gids.dtype == keys.dtype == np.int64:
        out = np.empty(len(gids), dtype=bool)
        try:
            KERNEL.members(np.ascontiguousarray(gids), np.ascontiguousarray(keys),
                           out.view(np.uint8), not checked)
            return out
        except ValueError:
            pass  # a chunk's keys out of order: the binary search below does not mind
        except TypeError:
            pass  # a kernel built before its fourth argument: rebuild (setup.py build_ext)
    return searched(gids, keys)


def ascending(keys: np.ndarray) -> np.ndarray:
    """`keys` when strictly ascending, else their sorted unique values (which `members` answers
    the same for): what `members(..., checked=True)` may be given. Local."""
    if len(keys) < 2 or bool(np.all(keys[1:] > keys[:-1])):
        return keys
    return np.unique(keys)


def searched(gids: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """`members` by a binary search of each of `gids` in `keys` (ascending, unique). Local."""
    if not len(keys):
        return np.zeros(len(gids), dtype=bool)
    at = np.minimum(np.searchsorted(keys, gids), len(keys) - 1)
    return keys[at] == gids
