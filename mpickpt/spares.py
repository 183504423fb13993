"""Hot spares (`--spares S`): processes started with the job that train nothing until a rank dies,
then one takes the dead rank's place in the job's next generation.

A spare is launched like every rank (so it can live on any node the launcher places it on: the
last S processes of the launch are the spares), goes through MPI startup with the trainers (the
store's address comes over MPI), imports torch and mpickpt, and then waits at the rendezvous
store: it looks for a rank whose death ended the previous generation and whose slot in the
current one is free, and claims it with compare-and-set, so one process wins however many race
(other spares, the dead rank's own respawn; a respawn that loses becomes a spare itself). The
winner joins the generation as that rank (`Topology.from_store` with the claimed generation) and is
built as any replacement is: dense part and reader from a survivor, the shard by `--recovery`. It needs no node agent of its own, so it outlives the
loss of the dead rank's node.

A waiting spare leaves when the training finished (a member is done with the store), when the
job gives up recovering in place (a survivor left for a relaunch), when the store is gone, or on
a stop signal. In generation 0 it then returns normally (the interpreter's MPI_Finalize meets the
trainers'); after a generation change nobody finalizes MPI.
"""
from __future__ import annotations

import importlib
import signal
import time
from dataclasses import dataclass

from mpickpt.generation import JobOver, Rendezvous

POLL_S = 0.05
"""Seconds between a waiting spare's looks at the store (one round trip each)."""
_STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
"""Signals that end a waiting spare's wait (a stop of the whole job). Hydra's SIGUSR1, its notice
that a rank exited, is not one: that rank's death is what a spare waits for (the caller's
`StopSignals.notices_only`)."""


def warm_up(config) -> float:
    """Do now what a replacement's first model build pays once per process (a hot spare's, a
    warm standby's): the trainer's modules are imported, and the dense part and its optimizer
    built and dropped (torch.optim's would import torch._dynamo, 1.4 s here; mpickpt's dense
    optimizers do not, see model/dense_optimizers). Returns the seconds it took. Local."""
    start = time.perf_counter()
    importlib.import_module("mpickpt.trainer")  # the imports a replacement pays
    from mpickpt.model.dense import DLRMDense
    from mpickpt.model.optimizers import make_dense_optimizer

    dense = DLRMDense(config.arch)
    make_dense_optimizer(config.optim, dense.parameters())
    return time.perf_counter() - start


@dataclass
class Spare:
    """One spare process between its startup and the slot it takes. Local, except `take`."""

    rendezvous: Rendezvous
    world: int
    """The job's training ranks (the launch's processes less the spares)."""
    local_rank: int
    local_size: int
    backend: str
    timeout_s: float

    def warm_up(self, config) -> float:
        """`warm_up(config)`. Local."""
        return warm_up(config)

    def over(self) -> JobOver | None:
        """Why this spare is not needed any more (see `wait`), or None. Local."""
        try:
            return self.rendezvous.job_over()
        except (RuntimeError, OSError) as e:
            return _store_gone(e)

    def _count(self, change: int) -> bool:
        """Count this spare in (+1) or out (-1) of the waiting ones (the survivors do not give
        up on a rank whose agent is gone while one waits). Local; False if the store is
        gone."""
        try:
            self.rendezvous.spares_waiting(change)
            return True
        except (RuntimeError, OSError):
            return False

    def wait(self, say, poll_s: float = POLL_S) -> tuple[int, int] | JobOver:
        """Wait for a dead rank's slot and claim it: (generation, rank), or why to leave
        instead. Local (the claim is atomic at the store)."""
        stopped = []
        previous = {s: signal.signal(s, lambda n, f: stopped.append(n)) for s in _STOP}
        counted = self._count(+1)
        try:
            while not stopped:
                try:
                    over = self.rendezvous.job_over()
                    if over:
                        return over
                    slot = self.rendezvous.free_slot(self.world)
                    if slot is not None and self.rendezvous.claim(*slot):
                        say(f"spare: took rank {slot[1]} of generation {slot[0]}")
                        return slot
                except (RuntimeError, OSError) as e:  # the store's host is gone: the job is
                    return _store_gone(e)
                time.sleep(poll_s)
            return JobOver(f"{signal.Signals(stopped[0]).name} received")
        finally:
            if counted:
                self._count(-1)
            for s, handler in previous.items():
                signal.signal(s, handler)


def _store_gone(error) -> JobOver:
    """The store's host (mpickpt-run) is gone: the job is over, nothing to relaunch here."""
    return JobOver(f"the rendezvous store is gone ({error})")
