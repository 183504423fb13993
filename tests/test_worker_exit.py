"""A process that exits through its exit hooks with a worker still running (a replacement whose
start failed) ends at once: the workers ignore SIGTERM, so multiprocessing's own exit hook, had it
run first, would wait for them forever (found by killing a second rank during a parity rebuild
under mpickpt-run: the replacement hung at its exit)."""
import subprocess
import sys
import time

from tests.launch import REPO

SCRIPT = """
import atexit
from mpickpt.background import start_worker
from mpickpt.engine.writer_process import writer_main

if __name__ == "__main__":
    proc, conn = start_worker(writer_main, "mpickpt-writer")
    print(proc.pid, flush=True)
    atexit._run_exitfuncs()  # what a failed replacement does before os._exit
    print("hooks done", flush=True)
"""


def test_exit_hooks_kill_a_running_worker_instead_of_waiting_for_it(tmp_path):
    script = tmp_path / "exit_with_worker.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    pid, done = out.stdout.split()[0], out.stdout.splitlines()[-1]
    assert done == "hooks done" and time.monotonic() - start < 30, out.stdout
    assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0


def test_a_worker_whose_rank_is_gone_ends_its_loop_quietly():
    """`serve` with the rank's end of the pipe closed while a job ran (the rank was killed):
    the answer finds no reader, and the loop ends without raising (multiprocessing would print
    the worker's name and a traceback as the job ends: the stray line seen after a SIGKILL)."""
    from multiprocessing import Pipe

    from mpickpt.background import READY, serve

    rank, worker = Pipe()
    rank.send({"job": 1})
    handled = []

    def handle(job):
        handled.append(job)
        rank.close()  # the rank dies while its worker writes
        return {"ok": True}

    serve(worker, handle)  # returns: no BrokenPipeError
    assert handled == [{"job": 1}]
    rank, worker = Pipe()
    rank.close()
    serve(worker, handle)  # gone before READY: returns too
    rank, worker = Pipe()
    rank.send(None)
    serve(worker, handle)  # the rank's None: the normal end
    assert rank.recv() == READY and handled == [{"job": 1}]
