"""Commit protocol: ranks report durability over the control channel; rank 0 writes the manifest.

Reports travel as messages on the control channel (through the rendezvous store, never the training
group), so a rank never waits for another rank's writer. Rank 0 collects them whenever the manager polls; when
all ranks reported for a step it either commits (manifest, then retention) or abandons the
checkpoint (deletes its directory; the previous committed checkpoint stays valid). The filesystem
work of a commit (manifest fsyncs, deleting retired checkpoints) runs on one background thread, in
order, so polling never blocks training; control calls stay on the training thread.
"""
from __future__ import annotations

import os
import shutil
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mpickpt.background_priority import Background
from mpickpt.store.leftovers import set_aside
from mpickpt.store.manifest import Manifest, apply_retention, list_manifests, write_manifest

REPORT_TAG = 0x4D43  # "MC"


@dataclass
class PendingCheckpoint:
    """What rank 0 knows about a checkpoint that is being written."""

    step: int
    ckpt_id: str
    reader_state: dict
    fields: dict
    reports: list = field(default_factory=list)


class CommitCoordinator:
    """Per-rank reporting plus rank 0's bookkeeping. Methods are local unless they say otherwise."""

    def __init__(self, topo, root: str, keep: int, log, background: Background | str = "normal"):
        """`background`: the commit thread's CPU and I/O priority (`--ckpt-background`) and
        cores (a `Background`, or a mode name: anywhere): its work is the manifest and the
        retention, whose deletes cost the kernel ~160 ms per synced GB (measured here), taken
        from training at normal priority."""
        self.topo, self.root, self.keep, self.log = topo, root, keep, log
        self.background = Background.of(background)
        self._tid: int | None = None
        self.priority_problem: str | None = None
        self.pending: dict[int, PendingCheckpoint] = {}
        self._early: dict[int, list] = defaultdict(list)
        self._sends: list = []
        self.committed: list[int] = []
        self.abandoned: list[int] = []
        self._forgotten: list[tuple[PendingCheckpoint, str]] = []
        """Checkpoints abandoned with their generation, whose directories are still to go."""
        self._io = ThreadPoolExecutor(1, thread_name_prefix="mpickpt-commit",
                                      initializer=self._lower) if topo.rank == 0 else None
        self._io_futures: list = []

    def _lower(self) -> None:
        """On the commit thread, once: take the background priority. Local."""
        self._tid = threading.get_native_id()
        self.prioritize(self.background.mode)

    def prioritize(self, background: str) -> None:
        """Run the commit thread at `background` priority from now on (`normal` once training
        is over or stopping), on the same cores. Local."""
        self.background = self.background.at(background)
        if self._tid is not None:
            problem = self.background.apply_to_threads([self._tid])
            if problem and self.priority_problem is None:
                self.priority_problem = problem

    def expect(self, pending: PendingCheckpoint) -> None:
        """Rank 0: register a checkpoint whose reports will arrive. Local."""
        pending.reports.extend(self._early.pop(pending.step, []))
        self.pending[pending.step] = pending
        self._maybe_finish(pending.step)

    def report(self, report: dict) -> None:
        """Send this rank's durability report for one step to rank 0 (non-blocking). Local."""
        if self.topo.rank == 0:
            self._receive(report)
        else:
            self._sends.append(self.topo.control.isend(report, dest=0, tag=REPORT_TAG))

    def progress(self) -> None:
        """Move messages along: others complete their sends; rank 0 receives waiting reports,
        but only once its own writers reported a checkpoint that still waits for other ranks'.
        Before that nothing can commit, and each look at the store is a round trip on the
        training thread (20-40 ms while the writers' files are flushed); a 1-rank job never
        looks. Local."""
        self._sends = [r for r in self._sends if not r.Test()]
        if self.topo.rank != 0 or not self._waiting_for_others():
            return
        while self.topo.control.iprobe(tag=REPORT_TAG):
            self._receive(self.topo.control.recv(tag=REPORT_TAG))

    def _waiting_for_others(self) -> bool:
        """Rank 0: a pending checkpoint holds rank 0's own report (and lacks another's)."""
        return any(r["rank"] == 0 for p in self.pending.values() for r in p.reports)

    def drain(self) -> None:
        """Finish every checkpoint in flight. Collective: every rank must have reported already."""
        for req in self._sends:
            req.wait()
        self._sends = []
        if self.topo.rank == 0:
            while self.pending:
                self._receive(self.topo.control.recv(tag=REPORT_TAG))
            for future in self._io_futures:
                future.result()
            self._io_futures = []

    def forget_pending(self, why: str) -> list[int]:
        """The generation these reports travel in is gone: abandon every checkpoint still
        waiting for reports and drop the messages. Their directories stay until
        `remove_forgotten`: other survivors' writers may still be writing into them. Returns
        the abandoned steps. Local."""
        self._sends, self._early = [], defaultdict(list)
        steps = sorted(self.pending)
        self._forgotten += [(self.pending.pop(step), why) for step in steps]
        return steps

    def remove_forgotten(self) -> None:
        """The next generation formed: every survivor waited for its writers before it joined,
        so nothing writes into the checkpoints `forget_pending` abandoned any more. Rank 0
        sets their directories aside now, on the commit thread after its queued work, and
        waits for that (a rollback may save the same step again soon, into a directory of the
        same name), not for their removal, which follows on that thread. Local."""
        for pending, why in self._forgotten:
            failures = [{"ok": False, "error": why}]
            if self._io is None:  # closed: on this thread
                self._abandon(pending, failures)
            else:
                self._io.submit(self._abandon, pending, failures, True).result()
        self._forgotten = []

    def close(self) -> None:
        """Stop the commit thread after its queued work. Local."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    def _receive(self, report: dict) -> None:
        step = report["step"]
        if step not in self.pending:
            self._early[step].append(report)
            return
        self.pending[step].reports.append(report)
        self._maybe_finish(step)

    def _maybe_finish(self, step: int) -> None:
        pending = self.pending[step]
        if len(pending.reports) < self.topo.world_size:
            return
        del self.pending[step]
        failures = [r for r in pending.reports if not r["ok"]]
        work = (self._abandon, pending, failures) if failures else (self._commit, pending)
        self._io_futures = [f for f in self._io_futures if not f.done()]
        self._io_futures.append(self._io.submit(self._guarded, *work))

    def _guarded(self, fn, pending: PendingCheckpoint, *args) -> None:
        """Run commit work; a failure abandons that checkpoint and never reaches training."""
        try:
            fn(pending, *args)
        except Exception as e:  # e.g. ENOSPC while writing the manifest
            self._abandon(pending, [{"ok": False, "error": f"commit failed: {e}"}])

    def _commit(self, p: PendingCheckpoint) -> None:
        files, total, seconds = {}, 0, 0.0
        for r in p.reports:
            files.update(r["files"])
            total += r["bytes"]
            seconds = max(seconds, r["seconds"])
        stats = {"bytes": total, "write_seconds": seconds,
                 "stall_seconds": max(r["stall_seconds"] for r in p.reports),
                 "staged_bytes": sum(r["staged_bytes"] for r in p.reports),
                 "rows_written": sum(r.get("rows", 0) for r in p.reports), **p.fields.pop("stats")}
        manifest = Manifest(step=p.step, ckpt_id=p.ckpt_id, files=files,
                            reader_state=p.reader_state, stats=stats, **p.fields)
        write_manifest(self.root, manifest)
        self.committed.append(p.step)
        retired = apply_retention(self.root, self.keep)
        self.log(f"checkpoint step {p.step} committed ({manifest.kind}): {total / 1e6:.1f} MB in "
                 f"{seconds:.2f} s ({total / 1e6 / max(seconds, 1e-9):.0f} MB/s over "
                 f"{self.topo.world_size} ranks, timed by the slowest), max stall "
                 f"{stats['stall_seconds'] * 1e3:.1f} ms"
                 + (f"; retired steps {retired}" if retired else ""))

    def _abandon(self, p: PendingCheckpoint, failures: list, later: bool = False) -> None:
        """Say `p` is abandoned and delete its directory, set aside first under a name of its
        own (`leftovers.set_aside`); `later`: the deletion is queued on the commit thread
        (this runs there), not waited for, unless the directory could not be set aside (a
        checkpoint of the same name may be written again soon). Commit thread."""
        path = os.path.join(self.root, p.ckpt_id)
        aside = set_aside(path)
        if aside is not None and aside != path and later and self._io is not None:
            self._io.submit(shutil.rmtree, aside, ignore_errors=True)
        elif aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self.abandoned.append(p.step)
        manifests = list_manifests(self.root)
        last = manifests[-1].step if manifests else None
        keeps = f"checkpoint step {last} stays valid" if last is not None else "no earlier checkpoint"
        self.log(f"checkpoint step {p.step} abandoned: {failures[0]['error']} "
                 f"({len(failures)} of {self.topo.world_size} ranks failed); {keeps}")
