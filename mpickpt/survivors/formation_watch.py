"""FormationWatch: a member's death while a generation forms and settles ends it at once.

From the moment a survivor's rendezvous for generation G completes until G's own peer watch stands,
nothing watches G's new members: the old generation's ring (kept open until then) holds the
survivors but not the replacements, and G's collectives (agreeing on a step, forming the peer watch)
wait for a dead member until gloo's timeout (minutes). A replacement that dies there is respawned by
its node agent, and the respawn finds its slot of G still held by the dead process: it records the
death at the store (`g<G>/dead/<rank>`, `Rendezvous.generation_for_replacement`). This watch looks
for that record, and for the job's fallback to a relaunch, every `POLL_S` seconds on a thread, and
aborts G's groups when it sees either: the waiting collective raises, and the survivor falls back
to a relaunch as for any death while a generation forms. Local.
"""
from __future__ import annotations

import threading

POLL_S = 0.2
"""Seconds between two looks at the store (one round trip for all of a generation's ranks)."""


class FormationWatch:
    """The watch of one member over generation `generation` of `world` ranks. Starts its thread
    at construction; `stop()` once the generation's peer watch stands. Local."""

    def __init__(self, rendezvous, generation: int, world: int, abort):
        """`abort()`: end every collective of the generation, running or to come (called again
        at each look once tripped: groups made after the first call are aborted too)."""
        self.rendezvous, self.generation, self.world = rendezvous, generation, world
        self.abort = abort
        self.reason: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"mpickpt-formation-watch-g{generation}")
        self._thread.start()

    def stop(self) -> None:
        """The generation's peer watch stands (or this process leaves): stop looking. Local."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2 * POLL_S + 1.0)

    def _run(self) -> None:
        while not self._stopped.wait(POLL_S):
            if self.reason is None:
                try:
                    self.reason = self._look()
                except (RuntimeError, OSError):  # the store is gone: the job is ending
                    return
            if self.reason is not None:
                self.abort()

    def _look(self) -> str | None:
        """Why the generation cannot settle, or None. Local (store lookups)."""
        rv = self.rendezvous
        if rv.deaths_recorded(self.generation):
            dead = rv.dead_of(self.generation, self.world)
            return f"rank(s) {dead} of generation {self.generation} died before its peer " \
                   f"watch stood"
        over = rv.job_over()
        if over is not None and over.relaunch:
            return str(over)
        return None
