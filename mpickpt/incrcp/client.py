"""The trainer's handle on its extractor process: submit, poll, restart, drain. Local."""
from __future__ import annotations

import time

from mpickpt.background import WorkerStartError, start_worker
from mpickpt.background_priority import Background
from mpickpt.incrcp.extractor_process import extractor_main


class ExtractorClient:
    """Hands ingestion jobs to one background extractor, in order; restarts it if it dies and hands
    it every unanswered job again (ingestion is idempotent). Never blocks unless asked to drain."""

    def __init__(self, root: str, ratio: float, log=None, background: Background | str = "idle"):
        """`background`: the extractor's CPU and I/O priority and cores (a
        `mpickpt.background_priority.Background`, or a mode name: anywhere)."""
        self.root, self.ratio = root, ratio
        self.background = Background.of(background)
        self.log = log or (lambda line: None)
        self.pending: list[dict] = []
        self.results: list[dict] = []
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        with self.background.spawning():
            self.proc, self.conn = start_worker(extractor_main, "mpickpt-extractor", self.root,
                                                self.ratio)
        self.prioritize(self.background.mode)

    def prioritize(self, background: str) -> None:
        """Run the extractor at `background` priority from now on, on the same cores. Local."""
        self.background = self.background.at(background)
        problem = self.background.apply(self.proc.pid)
        if problem:
            self.log(f"the extractor runs at its start priority: {problem}")

    def submit(self, job: dict) -> None:
        """Queue one ingestion (after its column file is durable). Local."""
        self.pending.append(job)
        try:
            self.conn.send(job)
        except OSError:  # the extractor died since the last poll: a new one gets every job
            self._restart()

    def poll(self, timeout: float = 0.0) -> list[dict]:
        """Answers received so far (each job's result once). Local."""
        out, self.results = self.results, []  # jobs failed for want of an extractor
        while self.pending:
            try:
                if not self.conn.poll(timeout):
                    break
                result = self.conn.recv()
            except (EOFError, OSError):
                self._restart()
                continue
            self.pending.pop(0)
            out.append(result)
        out += self.results
        self.results = []
        return out

    def _restart(self) -> None:
        code = self.proc.exitcode if not self.proc.is_alive() else None
        self.restarts += 1
        self.log(f"extractor process died (exit code {code}); restarting it and resubmitting "
                 f"{len(self.pending)} ingestions (committed checkpoints are unaffected)")
        self.conn.close()
        try:
            self._start()
        except WorkerStartError as e:  # the jobs fail; the next submit tries a new extractor
            self.log(f"a new extractor could not be started: {e}")
            self.results += [{"ok": False, "step": job["step"], "chain": job["chain"],
                              "error": f"ingesting step {job['step']}: no extractor ({e})"}
                             for job in self.pending]
            self.pending = []
            return
        for job in self.pending:
            self.conn.send({**job, "crash_before_commit": False})

    def drain(self, timeout: float = 600.0) -> list[dict]:
        """Wait for every queued ingestion. Local."""
        out, deadline = [], time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            out += self.poll(0.05)
            if self.pending and not self.proc.is_alive():
                self._restart()
        return out

    def close(self) -> None:
        """Stop the extractor after its queue. Safe twice. Local."""
        if self.conn is None:
            return
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()  # it ignores the job's signals
        self.conn.close()
        self.conn = None
