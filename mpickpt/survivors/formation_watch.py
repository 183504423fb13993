"""FormationWatch: a member's death while a generation forms and settles ends it at once.

From the moment a survivor's rendezvous for generation G completes until G's own peer watch stands,
nothing watches G's new members: the old generation's ring (kept open until then) holds the
survivors but not the replacements, and G's collectives (agreeing on a step, forming the peer watch)
wait for a dead member until gloo's timeout (minutes). A replacement that dies there is respawned by
its node agent, and the respawn finds its slot of G still held by the dead process: it records the
death at the store (`g<G>/dead/<rank>` and `g<G>/deaths`, `Rendezvous.generation_for_replacement`).
This watch looks for that record and for the job's fallback to a relaunch every `POLL_S` seconds, on
a thread with a store connection of its own (a TCPStore client serves one thread: the main thread's
blocking waits while it builds G's groups would hold the watch's looks), and aborts G's groups when
it sees either: the waiting collective raises, and the survivor falls back to a relaunch as for any
death while a generation forms. A respawned spare records the slots its dead predecessor held
(`Rendezvous.record_if_held`). Not seen: the death of a member nobody respawns (an agent without
respawns left, a lost node), which the groups' own timeouts still end. Local.
"""
from __future__ import annotations

import threading

from mpickpt.generation import Rendezvous, connect_store

POLL_S = 0.2
"""Seconds between two looks at the store (two lookups each, whatever the world size)."""


class FormationWatch:
    """The watch of one member over generation `generation` of `world` ranks. Starts its thread
    at construction; `stop()` once the generation's peer watch stands. Local."""

    def __init__(self, address: str, generation: int, world: int, abort):
        """`address`: the rendezvous store's; `abort()`: end every collective of the generation,
        running or to come (called again at each look once tripped, so groups made after the
        first call are aborted too; it must do nothing to another generation's)."""
        self.address, self.generation, self.world = address, generation, world
        self.abort = abort
        self.reason: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"mpickpt-formation-watch-g{generation}")
        self._thread.start()

    def stop(self) -> None:
        """The generation's peer watch stands (or this process leaves): stop looking. Local."""
        self._stopped.set()
        self._thread.join(2 * POLL_S + 1.0)

    def _run(self) -> None:
        rendezvous = None
        while not self._stopped.wait(POLL_S):
            try:
                if rendezvous is None:
                    rendezvous = Rendezvous(connect_store(self.address, 30.0), self.address)
                if self.reason is None:
                    self.reason = self._look(rendezvous)
            except (RuntimeError, OSError):  # the store did not answer: look again
                rendezvous = None
                continue
            if self.reason is not None and not self._stopped.is_set():
                self.abort()

    def _look(self, rendezvous) -> str | None:
        """Why the generation cannot settle, or None. Local (store lookups)."""
        if rendezvous.deaths_recorded(self.generation):
            dead = rendezvous.dead_of(self.generation, self.world)
            return f"rank(s) {dead} of generation {self.generation} died before its peer " \
                   f"watch stood"
        why = rendezvous.fallback()
        return f"the job falls back to a relaunch: {why}" if why is not None else None
