"""StopSignals with real signals: each of SIGTERM, SIGUSR1 and SIGINT is recorded (the first one
wins), a second SIGINT ends the process at once (Ctrl-C twice) while a second SIGTERM does not,
SIGUSR1 stays ignored after `uninstall` where it had its default; and the exit status and the
message of a stop whose emergency checkpoint did not commit."""
import signal
import subprocess
import sys
import time

import pytest

from mpickpt.stop_signals import (EXIT_SAVE_FAILED, EXIT_SAVED, SIGNALS, StopSignals,
                                  stop_failed_message)
from tests.launch import REPO


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_each_stop_signal_is_recorded_and_the_first_one_wins(sig):
    before = {s: signal.getsignal(s) for s in SIGNALS}
    signals = StopSignals().install()
    try:
        assert not signals.requested and signals.since() == 0.0
        signal.raise_signal(sig)
        assert signals.requested and signals.received == sig.name
        other = signal.SIGTERM if sig != signal.SIGTERM else signal.SIGUSR1
        signal.raise_signal(other)
        assert signals.received == sig.name and 0.0 <= signals.since() < 5.0
    finally:
        signals.uninstall()
    for s in SIGNALS:
        assert signal.getsignal(s) == before[s] or (s == signal.SIGUSR1 and
                                                   signal.getsignal(s) == signal.SIG_IGN)


CHILD = """
import signal, sys, time
from mpickpt.stop_signals import StopSignals
s = StopSignals().install()
print("ready", flush=True)
deadline = time.monotonic() + 20
while not s.requested and time.monotonic() < deadline:
    time.sleep(0.01)
print("got", s.received, flush=True)
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    time.sleep(0.01)
s.uninstall()
print("still here after", s.received, flush=True)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    time.sleep(0.01)
print("done", flush=True)
"""


def _child(hold: float, after: float = 0.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(hold), str(after)], text=True,
                            stdout=subprocess.PIPE, cwd=str(REPO))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_second_ctrl_c_ends_the_process_at_once():
    proc = _child(hold=20)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "got SIGINT"
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 128 + signal.SIGINT and time.monotonic() - start < 5
    assert proc.stdout.read() == ""  # it never reached the end of its wait


def test_a_second_sigterm_waits_for_the_step_boundary():
    proc = _child(hold=1.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "got SIGTERM"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert proc.stdout.read().split("\n")[0] == "still here after SIGTERM"


def test_sigusr1_stays_ignored_after_uninstall():
    """MPICH's hydra sends SIGUSR1 to the ranks still running at every rank's exit under
    -disable-auto-cleanup: a rank that is finishing must not die of it."""
    proc = _child(hold=0.0, after=1.0)
    proc.send_signal(signal.SIGUSR1)
    assert proc.stdout.readline().strip() == "got SIGUSR1"
    assert proc.stdout.readline().strip() == "still here after SIGUSR1"
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(20) == 0 and proc.stdout.read().strip() == "done"


def test_a_failed_emergency_checkpoint_has_its_own_status_and_names_the_last_valid_one():
    assert (EXIT_SAVED, EXIT_SAVE_FAILED) == (75, 74)
    text = stop_failed_message("SIGUSR1", 52, 40, "/ckpt")
    assert text.startswith("stopping on SIGUSR1 after step 52: the emergency checkpoint of "
                           "step 52 FAILED")
    assert "last valid checkpoint in /ckpt: step 40" in text and text.endswith("status 74")
    assert "in /ckpt: none" in stop_failed_message("SIGTERM", 3, None, "/ckpt")
