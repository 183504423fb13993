"""Survival: how a rank outlives a peer's death and how the relaunch picks up the survivors.

While training, a `PeerWatch` (`mpickpt.liveness`) tells every rank within milliseconds (a killed
process) to seconds (a lost node) that a peer died and which one. The survivor then stops in
order, on the watch thread and at once (some launchers kill the survivors half a second after a
death: MPICH's hydra does, even with -disable-auto-cleanup): it takes the model's state lock, so
that no update is half applied while it reads, undoes what the step the death interrupted had
applied, dumps its state at its last completed step (with `--survivor-dumps`), says what happened
and exits with `EXIT_PEER_LOST`, asking for a relaunch. The main thread, whether its collective
failed (gloo reports a closed connection) or hangs (MPICH's collectives wait forever, NCCL's for
minutes), only waits for that.

At the relaunch (`resume`), the ranks survey their dumps: survivors load theirs, and the lost
ranks' shards are recovered by the configured recovery policy after the trainer is built.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from mpickpt.control import MAX
from mpickpt.exit_codes import EXIT_PEER_LOST
from mpickpt.job_variables import RESTART_VARIABLE
from mpickpt.liveness import PeerWatch
from mpickpt.survivors.state import SurvivorDumps
from mpickpt.survivors.undo import StepUndo

GRACE = 2.0
"""Seconds the main thread waits, after its collective failed, to hear of a peer's death before
it treats the failure as an error of its own."""
LOCK_WAIT = 5.0
"""Seconds the survivor waits for a change of its state to finish (an update takes
milliseconds; a recovery, which holds the lock across its collectives, may never finish): past
it, no dump is written and the relaunch recovers this rank from the checkpoint."""
COMM_ERRORS = (RuntimeError, ConnectionError, OSError)
"""What a collective raises when a peer is gone (gloo: RuntimeError / DistBackendError)."""


class Survival:
    """One rank's watch, dumps and exit path. Construction is local; `start_watch`, `resume`
    are collective."""

    def __init__(self, topo, model, parity, root: str | None, dumps: str, peer_timeout: float,
                 say, restart: int | None = None, in_place: bool = False, on_notice=None):
        """`restart`: how many times this job was relaunched (default: $MPICKPT_RESTART, which
        `mpickpt-run` sets; 0 for a first launch). `in_place`: a death aborts the generation's
        groups and the trainer forms the next generation (`mpickpt.survivors.inplace`) instead
        of this rank dumping and exiting; `on_notice()` runs on the watch thread when a death
        becomes known (the trainer mutes the launcher's death notice, hydra's SIGUSR1)."""
        self.topo, self.model, self.say = topo, model, say
        self.restart = restart_count(os.environ) if restart is None else restart
        self.peer_timeout = peer_timeout
        self.in_place = in_place and topo.can_advance and topo.world_size > 1
        self.on_notice = on_notice
        wants_undo = self.in_place or (root is not None and dumps != "off")
        self.undo = StepUndo(model, parity.store if parity is not None else None) \
            if wants_undo else None
        self.dumps = SurvivorDumps(topo, model, parity, root, dumps, say, self.undo) \
            if root is not None and dumps != "off" else None
        self.watch: PeerWatch | None = None
        self._old_watch: PeerWatch | None = None
        self.state_at_boundary = None
        self._lock = threading.Lock()
        self.surviving = False
        self.dead: set[int] = set()
        """Ranks whose death ended the current generation (in place), until it is replaced."""

    # ---- the relaunch -----------------------------------------------------------------------------
    def resume(self, newest_committed: int | None):
        """Survey the dumps of a relaunch; restore the survivors if usable. Returns the Survey
        and, when usable, (reader position, PLS stats). Collective."""
        if self.dumps is None:
            return None, None
        survey = self.dumps.survey(newest_committed)
        if not survey.usable:
            message = fallback_message(survey.reason, self.restart)
            if message:
                self.say(message)
            self.dumps.remove()
            return survey, None
        start = time.perf_counter()
        restored = self.dumps.restore(survey)
        took = self.topo.control.allreduce(time.perf_counter() - start, op=MAX)
        back = f" ({', '.join(f'rank {r}' for r in survey.undo)} went back one step)" \
            if survey.undo else ""
        self.say(f"relaunch: ranks {survey.survivors} restored from their survivor dumps at step "
                 f"{survey.step}{back} in {took:.2f} s"
                 + "".join(f"; rank {r} lost: {why}" for r, why in sorted(survey.lost.items())))
        return survey, restored

    def start_anew(self) -> None:
        """A chosen start: earlier jobs' dumps go, and this job's will be its relaunch's
        (`SurvivorDumps.start_anew`). Collective."""
        if self.dumps is not None:
            self.dumps.start_anew()

    def drop_dump(self) -> None:
        """A checkpoint newer than the dumps committed: remove this rank's. Local."""
        if self.dumps is not None:
            self.dumps.remove()

    # ---- while training --------------------------------------------------------------------------
    def start_watch(self, state_at_boundary) -> None:
        """Watch the peers (collective); `state_at_boundary()` gives (last completed step, reader
        position, PLS stats) for a survivor dump. A death the ring saw while it formed (before
        it was this rank's watch, so its notice was dropped) is handled at once."""
        self.state_at_boundary = state_at_boundary
        if self.topo.world_size > 1:
            watch = PeerWatch(self.topo.control, self._on_death, self.peer_timeout)
            with self._lock:
                self.watch = watch
            if watch.dead:  # seen before it was this rank's watch: its notice was dropped
                self._on_death(set(watch.dead))

    def begin_step(self, step: int, reader_before: dict) -> None:
        if self.undo is not None:
            self.undo.begin(step, reader_before)

    def end_step(self) -> None:
        if self.undo is not None:
            self.undo.complete()

    def failed(self, error: BaseException) -> set[int]:
        """The main thread's collective failed: if a peer died, return the dead ranks (in
        place: the trainer forms the next generation) or let the watch thread finish (it exits
        the process); else re-raise. Local."""
        dead = self.watch.wait_for_death(GRACE) if self.watch is not None and \
            isinstance(error, COMM_ERRORS) else set()
        if not dead:
            raise error
        if self.in_place:
            with self._lock:
                return set(self.dead) or dead
        while True:  # the watch thread dumps and ends the process
            time.sleep(1.0)

    def _on_death(self, dead: set[int]) -> None:
        """On the current ring's watch thread, the moment a death is known. Under the lock that
        `leave_generation` takes, so a notice that comes as the ring is left is dropped."""
        with self._lock:
            watch = self.watch
            if watch is None or watch.closed:
                return
            if self.on_notice is not None:
                self.on_notice()
            if self.in_place:
                self.dead |= set(dead)
                self.topo.abort()  # the main thread's collectives raise now, or at their
                return             # next call
        self.survive(dead, watch.how)

    def _on_old_ring_death(self, dead: set[int]) -> None:
        """On the old ring's watch thread, while the next generation forms and until its own
        ring stands (`left_generation`): a death of a survivor that already joined the next
        generation means it cannot form or settle, so this thread falls back to a relaunch at
        once (the main thread may be waiting in a group's rendezvous or collective with the
        dead rank). Other deaths: `Rendezvous.gather` offers them to a replacement or a spare."""
        with self._lock:
            old = self._old_watch
            if old is None or self.watch is not None:  # the new ring reports its members
                return
            lost = self._members_lost(dead)
        if lost:
            generation, ranks = lost
            self.give_up_in_place(set(dead) | old.dead, f"ranks {ranks} died while "
                                  f"generation {generation} formed, after they joined it")

    def _members_lost(self, dead) -> tuple[int, list[int]] | None:
        """(the forming generation, those of `dead` that already joined it as themselves), or
        None if none did: `dead` were seen on the broken generation's ring while the next one
        forms; a survivor that joined it holds its slot, so the generation cannot form without
        it and nobody else may take the slot. Local (store lookups)."""
        rv = self.topo.rendezvous
        if rv is None:
            return None
        try:
            g = rv.current()
            ranks = [r for r in sorted(dead)
                     if (held := rv.holder(g, r)) is not None and held == rv.holder(g - 1, r)]
        except (RuntimeError, OSError):
            return None
        return (g, ranks) if ranks else None

    def leave_generation(self) -> set[int]:
        """Leave the broken generation and hand over the dead ranks known so far. Local. Its
        ring goes on being watched, without aborting anything, until `left_generation`: ranks
        that died together are seen one by one, and those seen while the next generation forms
        are offered to spares too (`more_dead`)."""
        with self._lock:
            self._old_watch, self.watch = self.watch, None
            dead, self.dead = set(self.dead), set()
            if self._old_watch is not None:
                self._old_watch.on_death = self._on_old_ring_death
        if self._old_watch is not None:
            dead |= self._old_watch.dead
        return dead

    def more_dead(self) -> set[int]:
        """The broken generation's dead ranks as its ring's watch knows them now. Local."""
        return set(self._old_watch.dead) if self._old_watch is not None else set()

    def left_generation(self) -> None:
        """The next generation's ring stands (or it could not form): stop watching the old
        ring. The neighbours get a goodbye: a survivor slower to leave would otherwise count
        this one dead when its connection closes (seen: a live rank in the dead set, offered to
        a spare). A rank that gives up on the next generation keeps the old ring open instead
        (it ends the process): the others' old rings see it leave and give up too. Local."""
        if self._old_watch is not None:
            self._old_watch.close(goodbye=True)
            self._old_watch = None

    def give_up_in_place(self, dead: set[int], why: str, dump: bool = True) -> None:
        """The next generation could not be formed, or not settled in: leave as a survivor does
        without in-place recovery (dump with --survivor-dumps unless `dump` is False, exit
        EXIT_PEER_LOST for a relaunch). Never returns. Local."""
        self.say(f"in-place recovery failed ({why}); falling back to a relaunch")
        if self.topo.rendezvous is not None:
            try:  # the spares and waiting respawns leave instead of waiting for a slot
                self.topo.rendezvous.give_up(f"rank {self.topo.rank}: {why}")
            except (RuntimeError, OSError):
                pass
        self.survive(dead, f"in-place recovery failed: {why}", dump)

    def survive(self, dead: set[int], cause: str, dump: bool = True) -> None:
        """Dump this rank's state at its last completed step (not when `dump` is False: a
        recovery stopped half-way), say so, and exit with EXIT_PEER_LOST. Never returns. Local;
        the model's state lock is taken first, so the main thread can change nothing
        meanwhile."""
        noticed = time.time()
        with self._lock:
            already = self.surviving
            self.surviving = True
        while already:  # another thread dumps and ends the process
            time.sleep(1.0)
        start = time.perf_counter()
        locked = self.model.state_lock.acquire(timeout=LOCK_WAIT)
        step, reader, pls = self.state_at_boundary()
        where = "no survivor dump (--survivor-dumps off)"
        if self.dumps is not None and (not locked or not dump):
            where = "no survivor dump: a recovery was changing this rank's state"
        elif self.dumps is not None:
            try:
                dirs, nbytes = self.dumps.write(step, reader, pls, dead)
                where = (f"survivor state of step {step} dumped to {', '.join(dirs)} "
                         f"({nbytes / 1e6:.1f} MB in {time.perf_counter() - start:.2f} s)")
            except OSError as e:
                where = f"the survivor dump failed: {e}"
        print(f"mpickpt: rank {self.topo.rank}: peer rank(s) {sorted(dead)} died after step "
              f"{step} ({cause}; noticed {_iso(noticed)}); {where}; exiting for a relaunch "
              f"(status {EXIT_PEER_LOST})", flush=True)
        sys.stderr.flush()
        os._exit(EXIT_PEER_LOST)

    def close(self) -> None:
        """Stop watching (tell the neighbours this rank ends normally). Local."""
        if self.watch is not None:
            self.watch.close()


def restart_count(environ) -> int:
    """The relaunch number `mpickpt-run` gives each run in $MPICKPT_RESTART (0: a first launch,
    or no mpickpt-run). Local."""
    value = environ.get(RESTART_VARIABLE, "").strip()
    return int(value) if value.isdigit() else 0


def fallback_message(reason: str, restart: int) -> str | None:
    """What a launch says when the survivor dumps are not used, or None (a first launch that
    found none). Local and pure."""
    if reason:
        return f"survivor dumps not used: {reason}; resuming from the checkpoint"
    if restart > 0:
        return (f"relaunch (restart {restart}): no rank found a survivor dump (the relaunch "
                f"runs on other nodes than the failed run, or the dumps are gone, or the "
                f"survivors could not write them); falling back to the newest checkpoint, "
                f"if any (else training starts over)")
    return None


def _iso(t: float) -> str:
    """Wall-clock time in UTC with milliseconds, for lining a death up with other logs."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
