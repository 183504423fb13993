"""Kill real ranks with SIGKILL, relaunch with --resume latest, and get the uninterrupted result."""
import os
import random
import re
import signal
import time

import pytest

from tests.fault_jobs import alive
from tests.launch import (SMALL_MODEL, descendants, digest_of, read_trace, resumed_step,
                          run_ranks, start_ranks)

STEPS = 40


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    trace = tmp_path_factory.mktemp("straight") / "trace"
    proc = run_ranks(2, "mpickpt.train", *SMALL_MODEL, "--num-batches", str(STEPS), "--digest",
                     "--trace-samples", str(trace))
    return digest_of(proc), read_trace(trace)


def test_sigkill_one_rank_then_resume_is_identical(tmp_path, straight):
    digest, trace = straight
    ckpt, log = tmp_path / "ckpt", tmp_path / "trace"
    args = (*SMALL_MODEL, "--num-batches", str(STEPS), "--ckpt-dir", str(ckpt),
            "--ckpt-interval", "10", "--trace-samples", str(log))
    killed = run_ranks(2, "mpickpt.train", *args, "--inject-kill", "23:1")
    assert killed.returncode != 0
    assert "checkpoint step 20" in killed.stdout
    resumed = run_ranks(2, "mpickpt.train", *args, "--digest")
    assert resumed_step(resumed.stdout) in (10, 20), resumed.stdout
    assert digest_of(resumed) == digest
    got = read_trace(log)
    assert got == trace  # every step saw the same sample position: nothing skipped or repeated
    assert sorted(got) == list(range(1, STEPS + 1))




def _kill_random_process(proc, rng, ckpt, trace, at_step, kind):
    """SIGKILL a random rank or background writer (`kind`) of the running job once its first
    checkpoint is committed and rank 0 has reached step `at_step` (plus a random part of a step),
    so the kill lands in training and background writes. Returns ("rank" | "writer", step
    reached); fails the test if the job ended before anything could be killed."""
    deadline = time.monotonic() + 90
    reached = 0
    while proc.poll() is None and time.monotonic() < deadline:
        reached = max(read_trace(trace)) if trace.exists() and trace.read_text() else 0
        if reached >= at_step and list(ckpt.glob("manifest-*.json")):
            break
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.05))
    procs = [(pid, cmd) for pid, cmd in descendants(proc.pid) if "python" in cmd]
    ranks = [pid for pid, cmd in procs if "mpickpt.train" in cmd and alive(pid)]
    writers = [pid for pid, cmd in procs if "spawn_main" in cmd and alive(pid)]
    pool = ranks if kind == "rank" else writers
    assert proc.poll() is None and pool, f"no {kind} alive at step {at_step}: nothing was killed"
    victim = rng.choice(pool)
    os.kill(victim, signal.SIGKILL)  # alive a moment ago; a ProcessLookupError fails the test
    return ("writer" if victim in writers else "rank"), reached


def crash_trial(tmp_path, seed, straight_digest, kind=None):
    """One random kill (of a `kind` or, when None, a randomly chosen rank or writer) at a random
    step, then a resume that must end with the uninterrupted digest."""
    rng = random.Random(seed)
    kind = kind or rng.choice(["rank", "writer"])
    ckpt, trace = tmp_path / f"ckpt-{seed}", tmp_path / f"trace-{seed}"
    args = ("--arch-embedding-size", "60000-40000-20000-500", "--arch-sparse-feature-size", "16",
            "--arch-mlp-bot", "13-16", "--arch-mlp-top", "8-1", "--mini-batch-size", "64",
            "--test-num-batches", "0", "--print-freq", "0", "--num-batches", "60",
            "--ckpt-dir", str(ckpt), "--ckpt-interval", "3", "--ckpt-keep", "2")
    proc = start_ranks(2, "mpickpt.train", *args, "--trace-samples", str(trace))
    try:
        victim, reached = _kill_random_process(proc, rng, ckpt, trace, rng.randint(4, 50),
                                               kind)
        out, err = proc.communicate(timeout=120)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise
    if victim == "rank":
        assert proc.returncode != 0, "a rank was SIGKILLed but the job exited 0"
    else:  # a background fault never kills training, and the job says what happened
        assert proc.returncode == 0, (seed, err[-2000:])
        assert re.search(r"writer process \d+ died", out + err), (seed, out[-2000:])
    resumed = run_ranks(2, "mpickpt.train", *args, "--digest")
    assert resumed.returncode == 0, (victim, resumed.stderr)
    assert digest_of(resumed) == straight_digest, (seed, victim, resumed.stdout)
    step = resumed_step(resumed.stdout)
    assert step is not None and step % 3 == 0, resumed.stdout  # a committed checkpoint was loaded
    return victim, reached, step


@pytest.fixture(scope="module")
def crash_reference():
    args = ("--arch-embedding-size", "60000-40000-20000-500", "--arch-sparse-feature-size", "16",
            "--arch-mlp-bot", "13-16", "--arch-mlp-top", "8-1", "--mini-batch-size", "64",
            "--test-num-batches", "0", "--print-freq", "0", "--num-batches", "60", "--digest")
    return digest_of(run_ranks(2, "mpickpt.train", *args))


@pytest.mark.parametrize("seed,kind", [(11, "rank"), (12, "writer"),
                                       # CI time: a random victim is one of the two above
                                       pytest.param(13, None, marks=pytest.mark.slow)])
def test_crash_at_random_moment_always_resumes_validly(tmp_path, crash_reference, seed, kind):
    victim, reached, step = crash_trial(tmp_path, seed, crash_reference, kind)
    assert kind is None or victim == kind
    print(f"seed {seed}: killed a {victim} at step {reached}, relaunch resumed from step {step}")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 120))
def test_crash_at_random_moment_many_trials(tmp_path, crash_reference, seed):
    victim, reached, step = crash_trial(tmp_path, seed, crash_reference)
    print(f"seed {seed}: killed a {victim} at step {reached}, relaunch resumed from step {step}")
