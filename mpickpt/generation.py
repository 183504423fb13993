"""Generations of a job: who is in it now, and the groups its members talk over.

A job starts in generation 0. Every change of membership (a rank died and a replacement takes its
place) starts the next generation: its members meet at the rendezvous (a TCPStore, hosted by a
process that outlives trainers: `mpickpt-run`, beside the launcher), and build a new
training process group and a new control channel (`mpickpt.control.StoreControl`) under the
generation's own key prefix. The old generation's groups are aborted, never waited on, so no
survivor hangs on a dead peer. MPI is not used after the job started: a replacement process never
joins MPI at all.

Store keys (all under the job's store; G is a generation number):
- `gen`: the current generation. A survivor moves it from G to G+1 with compare-and-set, so every
  survivor that saw the same death agrees on the next number.
- `g<G>/in/<rank>`: the pid of the process that holds `rank` in generation G. A replacement takes
  the first generation whose slot for its rank is free.
- `g<G>/dead/<rank>`: set by every survivor that saw `rank` dead when it left generation G (the
  union: deaths that happen together are seen one by one), and by a replacement's respawn that
  finds the slot of G still held by the dead replacement (`generation_for_replacement`).
- `g<G>/deaths`: how many such records G has (one lookup for `FormationWatch`).
- `finished`: how many processes are done with the store (trainers and spares at their end).
- `completed`: the step the training completed at (rank 0, at a normal end): the run is done
  whatever status its launcher reports (`mpickpt.launch.run_store`).
- `agent_lost/<rank>`: the node agent of launcher rank `rank` died (`mpickpt-run`'s agent watch):
  no respawn will come for that rank.
- `spares_waiting`: how many hot spares wait for a slot now.
- `fallback`: why the job gave up recovering in place (a survivor left for a relaunch); spares
  and replacements waiting for a slot leave when they see it.
- `g<G>/pg/...`, `g<G>/ctl/...`: the rendezvous of G's training group and control channel.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from mpickpt.control import StoreControl
from mpickpt.interruptible import Interruptible
from mpickpt.job_variables import STORE_VARIABLE  # noqa: F401 (re-exported)

DEFAULT_JOIN_TIMEOUT = 120.0
"""Seconds a generation's members wait for each other before the in-place recovery gives up and
the job falls back to a relaunch."""


TRAINING_FINISHED = "the training finished"
"""`Rendezvous.job_over`'s reason when a member is done with the store after the training
completed (`complete`)."""
JOB_ENDED = "the job ended before its training did (a stop signal or an error)"
"""`Rendezvous.job_over`'s reason when a member is done with the store and nobody completed."""


@dataclass(frozen=True)
class JobOver:
    """Why a process waiting for a slot leaves: `reason` in words, and whether the job falls
    back to a relaunch (the process then ends with the survivors' EXIT_PEER_LOST, else 0)."""

    reason: str
    relaunch: bool = False

    def __str__(self) -> str:
        return self.reason


class GenerationError(RuntimeError):
    """A generation could not be formed (a member never came, the store is gone)."""


class SlotTaken(GenerationError):
    """Another process (a hot spare, or a respawn) claimed the rank this process came for, or
    the job ended before it came (a process waiting for a slot then leaves as a spare does)."""


def process_identity(pid: int | None = None) -> str:
    """"host:pid" of this process (or of `pid` on this host): what holds a rank's slot at the
    store (a pid alone repeats across nodes). Local."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}"


def rendezvous_host() -> str:
    """Address other ranks reach this host at (override with MPICKPT_MASTER_ADDR). Local."""
    override = os.environ.get("MPICKPT_MASTER_ADDR")
    if override:
        return override
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


STORE_TIMEOUT_S = 300.0
"""Seconds a store or group operation may take before it fails (the default everywhere)."""


def host_store(timeout_s: float = STORE_TIMEOUT_S):
    """A TCPStore server on a free port of this host; returns (store, "host:port"). Local."""
    host = rendezvous_host()
    store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, f"{host}:{store.port}"


def connect_store(address: str, timeout_s: float = STORE_TIMEOUT_S):
    """A client of the store at "host:port". Local."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{STORE_VARIABLE}={address!r}: expected host:port")
    return dist.TCPStore(host, int(port), None, False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class Rendezvous:
    """The store seen by one process: generation numbers and memberships. Local calls, except
    that `gather` waits for the other members."""

    def __init__(self, store, address: str | None):
        self.store, self.address = store, address

    def current(self) -> int:
        """The job's current generation. Local."""
        return int(self.store.add("gen", 0))

    def advance(self, from_generation: int, dead) -> int:
        """Start the generation after `from_generation` (no effect if a peer already did, or a
        later one already started); returns the generation to join now. Local."""
        self.record_dead(from_generation, dead)
        self.store.compare_set("gen", str(from_generation), str(from_generation + 1))
        return self.current()

    def dead_of(self, generation: int, world: int) -> list[int]:
        """The ranks of `world` that a survivor saw dead when it left `generation`. Local."""
        return [r for r in range(world) if self.store.check([f"g{generation}/dead/{r}"])]

    def record_dead(self, generation: int, dead) -> None:
        """Add the ranks this survivor saw dead when it left `generation`. Local."""
        for r in sorted(dead):
            self.store.set(f"g{generation}/dead/{r}", "1")
            self.store.add(f"g{generation}/deaths", 1)

    def deaths_recorded(self, generation: int) -> int:
        """How many records `record_dead` made for `generation` (one lookup; a rank seen
        dead by several survivors counts once per record). Local."""
        return int(self.store.add(f"g{generation}/deaths", 0))

    def slot_taken(self, generation: int, rank: int) -> bool:
        return self.store.check([f"g{generation}/in/{rank}"])

    def holder(self, generation: int, rank: int) -> str | None:
        """Who holds `rank` in `generation` ("host:pid", see `process_identity`), or None.
        Local."""
        key = f"g{generation}/in/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def publish_side_groups(self, generation: int, specs: list) -> None:
        """Record the side groups every member of `generation` creates, in order (the first
        record stays). Local."""
        import json

        self.store.compare_set(f"g{generation}/sides", "", json.dumps(specs))

    def side_groups(self, generation: int, timeout_s: float) -> list:
        """The side groups of `generation` as published (waits for them). Local."""
        import json

        self.store.wait([f"g{generation}/sides"], datetime.timedelta(seconds=timeout_s))
        return json.loads(self.store.get(f"g{generation}/sides"))

    def register(self, generation: int, rank: int, identity: str | None = None) -> None:
        """Hold `rank` in `generation` as the process that held it before (a survivor); raises
        GenerationError if another process claimed it (this survivor was counted dead: the
        generation must not form around two holders of one rank). Local."""
        if not self.claim(generation, rank, identity):
            raise GenerationError(f"rank {rank} of generation {generation} was claimed by "
                                  f"{self.holder(generation, rank)} while its survivor "
                                  f"{identity or process_identity()} lives (counted dead by a "
                                  f"peer)")

    def claim(self, generation: int, rank: int, identity: str | None = None) -> bool:
        """Take the free slot of `rank` in `generation` for this process (`identity`, default
        `process_identity()`): True unless another process took it first (compare-and-set, so
        one wins). Local."""
        me = (identity or process_identity()).encode()
        return self.store.compare_set(f"g{generation}/in/{rank}", "", me) == me

    def free_slot(self, world: int) -> tuple[int, int] | None:
        """(generation, rank) of a slot a spare can claim now: a rank of `world` seen dead when
        the previous generation ended and that nobody holds yet in the current one; None if
        there is none. Local."""
        g = self.current()
        if g == 0:
            return None
        for rank in self.dead_of(g - 1, world):
            if not self.slot_taken(g, rank):
                return g, rank
        return None

    def job_over(self) -> JobOver | None:
        """Why a process waiting for a slot should leave, or None: the training finished (a
        member is done with the store) or the job gave up recovering in place. Local."""
        why = self.fallback()
        if why is not None:
            return JobOver("the job falls back to a relaunch: " + why, relaunch=True)
        if int(self.store.add("finished", 0)) > 0:
            completed = self.store.check(["member_completed"])
            return JobOver(TRAINING_FINISHED if completed else JOB_ENDED)
        return None

    def fallback(self) -> str | None:
        """Why the job gave up recovering in place (`give_up`), or None. Local."""
        return self.store.get("fallback").decode() if self.store.check(["fallback"]) else None

    def agent_lost(self, rank: int) -> bool:
        """Whether the node agent of launcher rank `rank` died (no respawn can come). Local."""
        return self.store.check([f"agent_lost/{rank}"])

    def spares_waiting(self, change: int = 0) -> int:
        """How many hot spares wait for a slot, after adding `change` (a spare counts itself
        in and out). Local."""
        return int(self.store.add("spares_waiting", change))

    def unreplaceable(self, generation: int, world: int) -> list[int]:
        """Ranks that died at the end of the previous generation, whose slot in `generation`
        nobody holds, whose node agent is gone or has no respawn left, while no spare waits:
        nobody can come for them. Local."""
        if generation == 0 or self.spares_waiting() > 0:
            return []
        return [r for r in self.dead_of(generation - 1, world)
                if not self.slot_taken(generation, r) and self.agent_lost(r)]

    def complete(self, step: int) -> None:
        """Rank 0: the training completed at `step`. Local; a store already gone is no
        error."""
        try:
            self.store.set("completed", str(step))
        except (RuntimeError, OSError):
            pass

    def done(self, completed: bool = False) -> None:
        """Say this process is done with the store (its host waits for everyone; a waiting
        spare reads it as the job's end), `completed`: after training to the end (else a stop
        or an error ended it). Local; a store already gone is no error."""
        try:
            if completed:  # before "finished": whoever reads that knows how the job ended
                self.store.set("member_completed", "1")
            self.store.add("finished", 1)
        except (RuntimeError, OSError):
            pass

    def give_up(self, why: str) -> None:
        """Say that the job stops recovering in place (the first reason stays). Local."""
        self.store.compare_set("fallback", "", why)

    def gather(self, generation: int, world: int, timeout_s: float,
               more_dead=None) -> dict[int, int]:
        """Wait until every rank of `generation` registered; returns rank -> pid. Raises
        GenerationError naming the missing ranks past `timeout_s`, or if a later generation
        started meanwhile (a further death). `more_dead()`: the dead ranks this member knows of
        now (its old ring's watch goes on while it waits): recorded as they appear, so a spare
        is offered a rank that died together with the first one but was seen later. Waits for
        the others."""
        keys = [f"g{generation}/in/{r}" for r in range(world)]
        deadline = time.monotonic() + timeout_s
        recorded: set[int] = set()
        next_look = time.monotonic() + 0.2
        while True:
            if more_dead is not None and generation > 0:
                seen = set(more_dead()) - recorded
                if seen:
                    self.record_dead(generation - 1, seen)
                    recorded |= seen
            if self.current() > generation:
                raise GenerationError(f"generation {generation} was overtaken by generation "
                                      f"{self.current()} while it formed (another death)")
            if self.store.check(keys):
                return {r: int(self.store.get(k).decode().rpartition(":")[2])
                        for r, k in enumerate(keys)}
            if time.monotonic() > next_look:
                next_look = time.monotonic() + 0.2
                lost = self.unreplaceable(generation, world)
                if lost:
                    raise GenerationError(f"generation {generation}: nobody can take rank(s) "
                                          f"{lost}: their node agent is gone or has no respawn "
                                          f"left, and no spare is waiting")
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise GenerationError(f"generation {generation}: rank(s) {missing} did not join "
                                      f"within {timeout_s:.0f} s")
            time.sleep(0.01)

    def record_if_held(self, dead: str, world: int) -> list[int]:
        """The dead process `dead` ("host:pid") holds slots of the current generation (a spare
        that took a rank, or a respawn serving as one): record their ranks dead there, as
        `generation_for_replacement` does for its own slot, so the members waiting for that
        generation to settle learn it (`FormationWatch`). Returns those ranks. Local."""
        g = self.current()
        held = [r for r in range(world) if self.holder(g, r) == dead]
        if held:
            self.record_dead(g, held)
        return held

    def generation_for_replacement(self, rank: int, timeout_s: float,
                                   dead: str | None = None) -> int:
        """The generation a process started to replace `rank` joins: the current one if its slot
        is free, else (the dead process `dead`, "host:pid", still holds it: the survivors have
        not moved on yet) the next one, once it starts. Raises SlotTaken when another process
        (a spare) already holds the slot, GenerationError when the job ended meanwhile.
        Local."""
        deadline = time.monotonic() + timeout_s
        told: set[int] = set()
        while True:
            over = self.job_over()
            if over:
                raise SlotTaken(f"rank {rank} is not needed any more: {over}")
            g = self.current()
            holder = self.holder(g, rank)
            if holder is None:
                return g
            if dead is not None and holder != dead:
                raise SlotTaken(f"rank {rank} of generation {g} was taken by {holder}")
            if dead is not None and g not in told:  # the members of g wait for it: say it died
                self.record_dead(g, [rank])
                told.add(g)
            if time.monotonic() > deadline:
                raise GenerationError(f"rank {rank}: generation {g} still holds this rank after "
                                      f"{timeout_s:.0f} s, and no survivor started the next one")
            time.sleep(0.02)


class Groups:
    """The process groups of one generation: the training group (torch.distributed's default
    group, so the data plane's calls need no change), the control channel, and the side groups
    created on it. Construction is collective over the generation's members."""

    def __init__(self, rendezvous: Rendezvous, generation: int, rank: int, world: int,
                 backend: str, timeout_s: float):
        self.generation, self.backend = generation, backend
        self.interrupt = Interruptible(sliced=backend == "gloo", what=f"generation {generation}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore(f"g{generation}/pg/", rendezvous.store)
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
        self.pg = dist.group.WORLD
        self.control = StoreControl(rendezvous.store, f"g{generation}/ctl/", rank, world,
                                    timeout_s)
        self.side: dict[str, object] = {}

    def abort(self) -> None:
        """Make every collective in progress or to come on this generation's groups raise.
        Local; safe from any thread and twice."""
        self.interrupt.abort()
        self.control.abort()
        for group in [self.pg, *self.side.values()]:
            try:
                group.abort()
            except (RuntimeError, AttributeError):
                pass

    def wait(self, work) -> None:
        """Wait for a collective of the training group or a side group; raises GenerationAborted
        once this generation is aborted (`mpickpt.interruptible`). Local."""
        self.interrupt.wait(work)

    def release(self) -> None:
        """Drop this generation's groups (after `abort`, or at the end). Local. The caller keeps
        this object: an aborted gloo operation still holds a worker thread of its group, which
        a destructor would wait for."""
        self.side.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
