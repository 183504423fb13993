"""The agent's side of a warm standby (`mpickpt.launch.standby`), with a real child process that
reads its assignment as the trainer's standby does; the whole path under a real job is in
tests/test_in_place.py."""
import io
import os
import sys

from mpickpt.launch.standby import Standby, read_assignment

CHILD = ("import sys; from mpickpt.launch.standby import read_assignment; "
         "a = read_assignment(sys.stdin.buffer); print(a); sys.exit(3 if a else 0)")


def _standby() -> Standby:
    return Standby([sys.executable, "-c", CHILD], dict(os.environ))


def test_read_assignment_parses_one_line_or_the_end_of_input():
    assert read_assignment(io.BytesIO(b"2/4/h:12 10.0.0.1:2900\n")) == ("2/4/h:12", "10.0.0.1:2900")
    assert read_assignment(io.BytesIO(b"")) is None
    assert read_assignment(io.StringIO("garbage\n")) is None


def test_a_standby_takes_over_with_the_dead_trainers_place(capfd):
    standby = _standby()
    assert standby.due()
    standby.start()
    assert not standby.due()  # one at a time
    proc = standby.take_over("1/4/host:99", "127.0.0.1:5000")
    assert proc is not None and proc.wait(30) == 3
    assert "('1/4/host:99', '127.0.0.1:5000')" in capfd.readouterr().out
    assert not standby.due()  # the next one only after RESTART_DELAY_S
    assert standby.take_over("1/4/host:100", "x:1") is None  # none waits: a plain respawn


def test_a_dropped_standby_leaves_with_status_0():
    standby = _standby()
    standby.start()
    proc = standby.proc
    standby.drop()
    assert proc.returncode == 0 and standby.proc is None


def test_a_dead_standby_is_not_handed_the_rank():
    standby = _standby()
    standby.start()
    standby.proc.kill()
    standby.proc.wait()
    assert standby.due()  # a dead one is replaced at once
    assert standby.take_over("0/2/h:1", "h:2") is None


def test_a_replacement_is_born_ignoring_the_stop_signals_until_it_takes_them():
    """A stop sent to the job while a replacement's interpreter starts must not kill it (its
    agent would take that for a crash and replace it again): SIGTERM, SIGINT and SIGUSR1 are
    ignored from exec until `StopSignals` installs its handlers, which then take them, and
    give back the defaults when removed (SIGUSR1 stays ignored, hydra's notices)."""
    import signal
    import subprocess

    from mpickpt.launch.rank_wrapper import _replacement_start

    code = ("import os, signal, sys, time\n"
            "from mpickpt.stop_signals import StopSignals\n"
            "print(open('/proc/self/status').read().split('SigIgn:')[1].split()[0], flush=True)\n"
            "sys.stdin.readline()\n"  # a stop arrives here, before any handler: ignored
            "s = StopSignals().install(restore_defaults=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.2)\n"
            "print(s.received, flush=True)\n"
            "s.uninstall()\n"  # the defaults come back, not the SIG_IGN it was born with
            "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,\n"
            "      signal.getsignal(signal.SIGINT) is signal.default_int_handler,\n"
            "      signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, preexec_fn=_replacement_start)
    ignored = int(proc.stdout.readline(), 16)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        assert ignored >> (sig - 1) & 1, (sig, hex(ignored))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate("go\n", timeout=30)
    assert proc.returncode == 0 and out.split("\n")[:2] == ["SIGTERM", "True True True"], \
        (proc.returncode, out)
