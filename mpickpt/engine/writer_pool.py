"""A rank's pool of background writer processes (spawned, no MPI inside)."""
from __future__ import annotations

import time

from mpickpt.background import WorkerStartError, start_worker
from mpickpt.background_priority import Background
from mpickpt.engine.writer_process import writer_main


class WriterPool:
    """`count` writer processes; one job (a list of per-writer jobs) in flight at a time. Local."""

    def __init__(self, count: int, background: Background | str = "idle"):
        """`background`: the writers' CPU and I/O priority and cores (a
        `mpickpt.background_priority.Background`, or a mode name: anywhere)."""
        self.background = Background.of(background)
        self.priority_problem: str | None = None
        """Why the priority could not be set (the writers then run as they are), once."""
        self._procs: list = [None] * count
        self._conns: list = [None] * count
        for i in range(count):
            self._start(i)
        self._outstanding: set[int] = set()
        self._results: list[dict] = []
        self._dirs: dict[int, str | None] = {}

    def _start(self, i: int) -> None:
        with self.background.spawning():
            self._procs[i], self._conns[i] = start_worker(writer_main, f"mpickpt-writer-{i}")
        self._prioritize(self._procs[i])

    def _prioritize(self, proc) -> None:
        problem = self.background.apply(proc.pid)
        if problem and self.priority_problem is None:
            self.priority_problem = problem

    def prioritize(self, background: str) -> None:
        """Run the writers at `background` priority from now on (`normal` for a last checkpoint
        before a stop), on the same cores. Local."""
        self.background = self.background.at(background)
        for proc in self._procs:
            if proc is not None and proc.is_alive():
                self._prioritize(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None]

    @property
    def size(self) -> int:
        return len(self._procs)

    @property
    def busy(self) -> bool:
        """True while a submitted job has parts not yet finished. Local."""
        return bool(self._outstanding)

    def submit(self, jobs: list[dict]) -> None:
        """Hand one job per writer (at most `size`). Local; never blocks on I/O."""
        assert not self._outstanding, "a checkpoint is already being written"
        self._results = []
        for i, job in enumerate(jobs):
            self._dirs[i] = job.get("dir")
            try:
                self._conns[i].send(job)
            except OSError:  # the writer died since its last job: that part fails, not training
                self._results.append(self._died(i))
                continue
            self._outstanding.add(i)

    def poll(self, timeout: float = 0.0) -> list[dict] | None:
        """The per-writer results once every part is done, else None. Local."""
        for i in sorted(self._outstanding):
            if self._conns[i].poll(timeout):
                self._results.append(self._receive(i))
                self._outstanding.discard(i)
        if self._outstanding or not self._results:
            return None
        results, self._results = self._results, []
        return results

    def _receive(self, i: int) -> dict:
        try:
            return self._conns[i].recv()
        except (EOFError, OSError):
            return self._died(i)

    def _died(self, i: int) -> dict:
        """Writer `i` is gone: a failed result for its part, and a new writer. Local."""
        self._procs[i].join(1.0)
        code = self._procs[i].exitcode
        why = f"writer process {i} died (exit code {code})"
        try:
            self._start(i)
        except WorkerStartError as e:  # tried again at the next checkpoint; training goes on
            why += f", and a new one could not be started: {e}"
        return {"ok": False, "step": None, "error": f"{self._dirs.get(i)}: {why}"}

    def wait(self) -> list[dict] | None:
        """Block until the job in flight is done; its results (None if nothing was in flight).
        Local."""
        while self._outstanding:
            results = self.poll(0.05)
            if results is not None:
                return results
        return self.poll()  # parts that failed at submit

    def close(self, timeout: float = 10.0) -> list[str]:
        """Stop every writer (after the job in flight). Returns a line for each writer that had
        died while idle (no part of a checkpoint was lost, but the death must not go unsaid) or
        had to be killed. Safe twice. Local."""
        self.wait()
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        lines = []
        for i, proc in enumerate(self._procs):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()  # it ignores the job's signals
                lines.append(f"writer process {i} did not stop within {timeout:g} s: killed")
            elif proc.exitcode != 0:
                lines.append(f"writer process {i} died while idle (exit code {proc.exitcode})")
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        return lines
