"""How many threads a checkpoint writer's quantizer may use: the cores of this rank's share of
the node that training leaves free, split over the rank's writers.

The rank's share is its CPU affinity mask over the node's ranks that share it: the whole node
over all of them when the launcher did not bind (mpiexec's default), the mask alone when each
rank is bound to its own cores, and in between for socket binding.

A GPU rank's training needs about one core (its Python thread feeding the device); a CPU rank's
training uses its torch threads. The rest of the rank's share is free for the background.
Writers run at the background priority (`--ckpt-background`), so a free core they take is one
training was not using. Local.
"""
from __future__ import annotations

import os

MAX_THREADS = 16
"""Beyond this the quantizer is bound by memory bandwidth, not by cores."""


def cores_available() -> int:
    """Cores this process may run on (its affinity mask), else the machine's count. Local."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_share(local_size: int, cores: int, node_cores: int) -> int:
    """This rank's cores: its affinity mask (`cores` of the node's `node_cores`) over the ranks
    that share the mask, assuming the launcher spread the node's ranks evenly: all of them when
    unbound, none but this one when bound to its own cores. Local."""
    sharing = max(1, round(local_size * cores / max(1, node_cores)))
    return max(1, cores // sharing)


def free_cores(local_size: int, device_type: str, training_threads: int,
               cores: int | None = None, node_cores: int | None = None) -> int:
    """Cores of one rank's share of the node that its training leaves free (>= 0). Local."""
    cores = cores if cores is not None else cores_available()
    node_cores = node_cores if node_cores is not None else (os.cpu_count() or cores)
    share = rank_share(local_size, cores, max(cores, node_cores))
    busy = 1 if device_type == "cuda" else max(1, training_threads)
    return max(0, share - busy)


def codec_threads(local_size: int, writers: int, device_type: str, training_threads: int,
                  cores: int | None = None, node_cores: int | None = None) -> int:
    """Quantizer threads per writer process: the rank's free cores over its writers, at least
    1 and at most MAX_THREADS. Local."""
    free = free_cores(local_size, device_type, training_threads, cores, node_cores)
    return max(1, min(MAX_THREADS, free // max(1, writers)))
