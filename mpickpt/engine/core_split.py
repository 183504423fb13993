"""Training and checkpoint background work on separate cores of a rank's share of the node
(`--ckpt-cores`).

With the cores shared (`shared`), the kernel places every thread anywhere in the rank's affinity
mask. The background processes run at a lower priority (`mpickpt.background_priority`), yet the
training thread still lands on the core a writer, the extractor or the copier was using, and
their caches and the migrations cost the step time. `split` keeps the training thread (and the
threads it starts, unless they say otherwise) on the cores training needs and puts the
background (the writers, the IncrCP extractor, the copy-on-update copier, the commit thread) on
the cores it leaves free. Threads that help training where a core is free (the data reader, the
parity rebuild's readers and sweep) run on the whole share. `auto` splits where the rank's share
leaves a core free, and shares otherwise.

The rank's share: its own affinity mask when the launcher bound each rank (or it runs alone on
the node); when it did not bind (every rank's mask is the node's), the node's cores dealt out by
local rank, as a per-core binding would; when several ranks share a part of the node (socket
binding), no split, since which of them takes which cores is not known here. Local: nothing here
uses MPI.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from mpickpt.engine.free_cores import cores_available

MODES = ("auto", "shared", "split")


@dataclass(frozen=True)
class CoreSplit:
    """The cores of one rank's share: `training`'s for the training thread, `background`'s for
    the checkpoint's background work. Both non-empty and disjoint."""

    training: tuple[int, ...]
    background: tuple[int, ...]

    def __post_init__(self):
        if not self.training or not self.background or set(self.training) & set(self.background):
            raise ValueError(f"a core split needs disjoint, non-empty training and background "
                             f"cores, got {self.training} and {self.background}")

    @property
    def share(self) -> tuple[int, ...]:
        return tuple(sorted(self.training + self.background))

    def pin_training(self) -> str | None:
        """Keep the calling thread (training's) on the training cores; the threads it starts
        from now on inherit them. None when done, else why not. Local."""
        return _pin([0], self.training)

    def pin_background(self, tids) -> str | None:
        """Move the threads `tids` (of this process or another) to the background cores. Local."""
        return _pin(tids, self.background)

    def widen(self) -> str | None:
        """Let the calling thread run on the whole share (a helper of training started by the
        training thread: the reader, the rebuild's readers). Local."""
        return _pin([0], self.share)

    def describe(self) -> str:
        return f"training on cores {_ranges(self.training)}, background on {_ranges(self.background)}"


def _pin(tids, cpus) -> str | None:
    problems = []
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except (OSError, AttributeError) as e:
            problems.append(f"affinity of thread {tid or 'self'}: {e}")
    return "; ".join(problems) or None


def _ranges(cpus) -> str:
    out, run = [], [cpus[0]]
    for c in cpus[1:]:
        if c == run[-1] + 1:
            run.append(c)
            continue
        out.append(run)
        run = [c]
    out.append(run)
    return ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out)


def rank_share(local_rank: int, local_size: int, mask, node_cores: int):
    """(this rank's cores, None) or (None, why they are not known). `mask`: the rank's affinity
    mask; `node_cores`: the node's core count. Local."""
    mask = tuple(sorted(mask))
    if local_size <= 1 or local_size * len(mask) <= node_cores:
        return mask, None  # alone, or bound to cores of its own
    if len(mask) >= node_cores:  # unbound: deal the node out by local rank
        per = len(mask) // local_size
        if per < 1:
            return None, f"{local_size} ranks on this node's {len(mask)} cores"
        return mask[local_rank * per:(local_rank + 1) * per], None
    return None, (f"{local_size} ranks share part of the node ({len(mask)} of its {node_cores} "
                  f"cores in this rank's mask): which cores each takes is not known")


def plan(mode: str, local_rank: int, local_size: int, device_type: str, training_threads: int,
         mask=None, node_cores: int | None = None):
    """(CoreSplit, None) where `mode` splits this rank's share, else (None, why not: for
    `shared`, None). ValueError naming the choices for an unknown mode. Local."""
    if mode not in MODES:
        raise ValueError(f"--ckpt-cores must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "shared":
        return None, None
    mask = mask if mask is not None else _mask()
    node_cores = node_cores if node_cores is not None else (os.cpu_count() or len(mask))
    share, why = rank_share(local_rank, local_size, mask, max(node_cores, len(mask)))
    if share is None:
        return None, why
    busy = 1 if device_type == "cuda" else max(1, training_threads)
    if len(share) <= busy:
        return None, (f"training needs all of this rank's {len(share)} core(s) "
                      f"({busy} for training on {device_type})")
    return CoreSplit(share[:busy], share[busy:]), None


def _mask():
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return range(cores_available())
