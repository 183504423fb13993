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
leaves a core free and shares otherwise, silently; `split` says why it cannot.

Training's threads: on a GPU rank, the thread that feeds the device (NCCL's and the driver's
threads keep their own placement); on a CPU rank, every thread not placed yet when training
pins itself (its torch and OpenMP workers, its gloo threads), on as many cores as it has torch
threads.

The rank's share, from the affinity masks of the node's ranks (gathered once at start-up): its
own mask when the masks are disjoint (the launcher or Slurm bound each rank, or it is alone);
when they are all equal (an unbound launch, in a cgroup or not), their cores dealt out by the
ranks' order, as a per-core binding would; otherwise (socket binding: some ranks share part of
the node) no split, since which of them takes which cores is not known. Local: nothing here
uses MPI (the caller gathers the masks).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from mpickpt.background_priority import set_cores

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

    def pin_training(self, workers: bool = False) -> str | None:
        """Keep the calling thread (training's) on the training cores, and with `workers` every
        other thread of this process not placed yet (its mask still covers the whole share: a
        CPU rank's torch workers, its gloo threads); the threads started from now on inherit
        them. None when done, else why not. Local."""
        tids = [0]
        if workers:
            me, share = threading.get_native_id(), set(self.share)
            tids += [t for t in _threads() if t != me and _affinity(t) >= share]
        return set_cores(tids, self.training)

    def pin_background(self, tids) -> str | None:
        """Move the threads `tids` (of this process or another) to the background cores. Local."""
        return set_cores(tids, self.background)

    def widen(self) -> str | None:
        """Let the calling thread run on the whole share (a helper of training started by the
        training thread: the reader, the rebuild's readers). Local."""
        return set_cores([0], self.share)

    def describe(self) -> str:
        return (f"training on cores {_ranges(self.training)}, background on "
                f"{_ranges(self.background)}")


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _affinity(tid: int) -> set:
    try:
        return os.sched_getaffinity(tid)
    except OSError:
        return set()


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


def rank_share(index: int, masks):
    """(this rank's cores, None) or (None, why they are not known). `masks`: the affinity masks
    of the node's ranks in rank order; `index`: this rank's place among them. Local."""
    masks = [tuple(sorted(m)) for m in masks]
    mine = masks[index]
    if sum(len(m) for m in masks) == len(set().union(*masks)):
        return mine, None  # alone, or bound to cores of its own
    if all(m == mine for m in masks):  # unbound: deal the cores out in rank order
        per = len(mine) // len(masks)
        if per < 1:
            return None, f"{len(masks)} ranks on this node's {len(mine)} cores"
        return mine[index * per:(index + 1) * per], None
    return None, (f"{len(masks)} ranks on this node whose masks overlap without being equal "
                  f"(socket binding?): which cores each takes is not known")


def plan(mode: str, index: int, masks, device_type: str, training_threads: int):
    """(CoreSplit, None) where `mode` splits this rank's share (`rank_share` of `index` in
    the node's `masks`), else (None, why not: for `shared`, None). ValueError naming the
    choices for an unknown mode. Local."""
    if mode not in MODES:
        raise ValueError(f"--ckpt-cores must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "shared":
        return None, None
    share, why = rank_share(index, masks)
    if share is None:
        return None, why
    busy = 1 if device_type == "cuda" else max(1, training_threads)
    if len(share) <= busy:
        return None, (f"training needs all of this rank's {len(share)} core(s) "
                      f"({busy} for training on {device_type})")
    return CoreSplit(share[:busy], share[busy:]), None


def node_masks(control, hostname: str | None = None):
    """(this rank's index among its node's ranks, their affinity masks in rank order), gathered
    over `control` (an MPI communicator or the generation's channel) by host name.
    Collective."""
    import socket

    me = (hostname or socket.gethostname(), sorted(this_mask()))
    everyone = control.allgather(me)
    node = [i for i, (host, _) in enumerate(everyone) if host == me[0]]
    return node.index(control.Get_rank()), [everyone[i][1] for i in node]


def this_mask() -> set:
    """The calling thread's affinity mask (every core where the OS has none). Local."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))
