"""In-place recovery of a real death (`--in-place on` under mpickpt-run and MPICH's mpiexec): a
trainer is SIGKILLed from outside at a random step; its node agent starts a replacement (or a hot
spare, `--spares 1`, takes the rank first), the survivors keep their processes and form the next
generation with it, the lost shard is recovered by `--recovery`, and the job ends with exit 0, no
relaunch and the failure-free digest."""
from __future__ import annotations

import json
import os
import random
import re
import time

import pytest

from mpickpt.exit_codes import EXIT_SAVED
from mpickpt.store.manifest import list_manifests, torn_dirs
from tests.fault_jobs import (OPEN_MPI_ARGS, Job, alive, digest_in, mpickpt_run, open_mpi_skip,
                              rank_of)
from tests.launch import descendants, run_ranks

FLAGS = ["--num-batches", "120", "--mini-batch-size", "256", "--print-freq", "1",
         "--test-num-batches", "0", "--digest", "--ckpt-interval", "20", "--parity-k", "3"]
_IN_PLACE = re.compile(r"in-place recovery: generation (\d+) at step (\d+): rank\(s\) \[(\d+)\] "
                       r"replaced")
_REPLACED_BY = re.compile(r"replaced by new process\(es\) \(pid (\d+)\)")


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("clean")
    proc = run_ranks(4, "mpickpt.train", *FLAGS, "--ckpt-dir", str(root / "ckpt"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return digest_in(proc.stdout)


def _mpi_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("mpich_", "vader_segment"))}


def _trial(tmp_path, seed: int, recovery: str, spares: int = 0, launcher=(),
           env=None, more=()) -> tuple[Job, dict]:
    rng = random.Random(seed)
    kill_at = rng.randint(22, 45)
    segments = _mpi_segments()
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "1", *launcher, "--", *FLAGS,
                          "--ckpt-dir", str(tmp_path / "ckpt"), "--recovery", recovery,
                          "--in-place", "on", "--spares", str(spares), *more), env=env)
    try:
        assert job.wait_for_step(kill_at), job.output
        launched = job.ranks()
        assert len(launched) == 4 + spares, job.output
        before = [p for p in launched if rank_of(p) < 4]  # the spares are the last launched
        pid, rank = job.kill_rank(pick=lambda pids: rng.choice(sorted(set(pids) & set(before))))
        reached = job.step
        after = _trainers_after_recovery(job)
        code = job.wait(240)
    finally:
        job.stop()
    return job, {"pid": pid, "rank": rank, "reached": reached, "code": code,
                 "survivors": [p for p in before if p != pid], "after": after,
                 "spares": sorted(set(launched) - set(before)),
                 "segments_left": _mpi_segments() - segments}


def _trainers_after_recovery(job: Job, timeout: float = 90) -> list[int]:
    """The trainer pids right after the job logged its in-place recovery."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        if _IN_PLACE.search(job.output):
            return job.ranks()
        time.sleep(0.05)
    return []


@pytest.mark.parametrize("seed,launcher,warm", [
    # CI time: hydra runs every other in-place test; this case's parity rebuild is the same
    pytest.param(3, "hydra", False, marks=pytest.mark.slow),
    # CI time: the Open MPI case also keeps a warm standby, which takes the dead rank's place
    # (the plain respawn runs under hydra in the other tests), and sweeps the rebuild beside the
    # steps (auto sweeps in the lookup on 2 cores, as the other in-place parity tests do)
    (4, "openmpi", True)])
def test_a_killed_rank_is_replaced_in_place_with_parity(tmp_path, clean_digest, seed, launcher,
                                                        warm):
    """Under MPICH's hydra and under Open MPI's mpirun (4.x): the agent respawns the killed
    trainer (with --warm-respawn: hands its place to the standby it keeps warm), the survivors
    keep their processes, the job ends with exit 0 and the failure-free digest (Open MPI: though
    the later generation skips MPI_Finalize)."""
    args, env = (), None
    if launcher == "openmpi":
        if open_mpi_skip():
            pytest.skip(open_mpi_skip())
        args, env = OPEN_MPI_ARGS, dict(os.environ, MPI4PY_MPIABI="openmpi")
    job, t = _trial(tmp_path, seed, "parity", launcher=args, env=env,
                    more=("--warm-respawn", "--rebuild-sweep", "beside") if warm else ())
    out = job.output
    assert f"rank {t['rank']}: its trainer (pid {t['pid']}) was killed by SIGKILL" in out, out
    found = _IN_PLACE.findall(out)
    assert len(found) == 1, out
    generation, step, replaced = map(int, found[0])
    assert (generation, replaced) == (1, t["rank"]), out
    assert step >= t["reached"] - 1, f"more than one step replayed: {step} < {t['reached']}-1"
    assert "relaunching" not in out and "exiting for a relaunch" not in out, out
    assert t["code"] == 0, out
    assert digest_in(out) == clean_digest, out
    if warm:
        _assert_the_warm_standby_took_over(out, t)
    # the respawned rank read its survivors' memory (one host), the processes of before included:
    # it mapped their shared rows (a process it never met published them in its first round)
    assert re.search(r"parity: rebuilt ranks .* reading the group's memory"
                     + (r", \d+ swept beside the steps" if warm else "")
                     + ", its shared rows mapped", out), out
    # the survivors kept their processes; one new process took the dead rank's place (a warm
    # standby is not listed among the launched trainers: its pid was checked above)
    assert set(t["survivors"]) <= set(t["after"]) and t["pid"] not in t["after"], (t, out)
    assert len(t["after"]) == 3 + (not warm), (t, out)
    assert not [p for p in t["after"] if alive(p)], "a trainer outlived the job"
    assert not t["segments_left"], f"MPI segments left in /dev/shm: {t['segments_left']}"
    assert (tmp_path / "ckpt" / "mpickpt-restarts.log").read_text().count("in-place recovery") \
        == 1


def _assert_the_warm_standby_took_over(out: str, t: dict) -> None:
    started = re.findall(rf"rank {t['rank']}: warm standby started \(pid (\d+)\)", out)
    assert started, out
    assert f"rank {t['rank']}: the warm standby (pid {started[0]}) takes over" in out, out
    assert [int(p) for p in _REPLACED_BY.findall(out)] == [int(started[0])], out


@pytest.mark.slow  # CI time: the Open MPI case above keeps a warm standby under the same checks
def test_a_warm_standby_takes_its_killed_trainers_place(tmp_path, clean_digest):
    """--warm-respawn: the dead trainer's agent hands its place to the standby it keeps warm
    (started after the trainer's startup), which joins as the replacement."""
    job, t = _trial(tmp_path, 6, "parity", more=("--warm-respawn",))
    out = job.output
    _assert_the_warm_standby_took_over(out, t)
    assert t["code"] == 0 and digest_in(out) == clean_digest, out
    assert "relaunching" not in out and len(_IN_PLACE.findall(out)) == 1, out
    assert set(t["survivors"]) <= set(t["after"]), (t, out)
    assert not [p for p in t["after"] if alive(p)], "a process outlived the job"
    assert not t["segments_left"], f"MPI segments left in /dev/shm: {t['segments_left']}"


@pytest.mark.parametrize("seed", [5])
def test_a_hot_spare_takes_a_killed_ranks_place(tmp_path, clean_digest, seed):
    """--spares 1: the spare, launched with the job and waiting warm, takes the dead rank (not
    the dead rank's own respawn, which comes seconds later and serves as a spare instead)."""
    job, t = _trial(tmp_path, seed, "parity", spares=1)
    out = job.output
    found = _IN_PLACE.findall(out)
    assert len(found) == 1 and int(found[0][2]) == t["rank"], out
    assert int(found[0][1]) >= t["reached"] - 1, out
    assert [int(p) for p in _REPLACED_BY.findall(out)] == t["spares"], (t, out)
    assert f"spare: took rank {t['rank']} of generation 1" in out, out
    assert "relaunching" not in out and "exiting for a relaunch" not in out, out
    assert t["code"] == 0, out
    assert digest_in(out) == clean_digest, out
    assert set(t["survivors"]) <= set(t["after"]) and t["spares"][0] in t["after"], (t, out)
    assert "spare: leaving: the training finished" in out, out  # the respawn, spare in turn
    assert not [p for p in t["after"] if alive(p)], "a process outlived the job"
    assert not t["segments_left"], f"MPI segments left in /dev/shm: {t['segments_left']}"


@pytest.mark.slow  # CI time: CI loses two ranks at once to two spares (rank 0's node, below) and
# rebuilds one lost shard from parity in place (above); this case joins the two
def test_two_deaths_in_different_parity_groups_are_rebuilt_together_by_two_spares(
        tmp_path, clean_digest):
    """Ranks 1 and 3 (parity groups {0,1} and {2,3}, k=1) SIGKILL themselves at the same step: the
    survivors see the deaths one by one, both are offered to the spares, one generation forms,
    both shards are rebuilt from parity while training goes on."""
    segments = _mpi_segments()
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "1", "--", *FLAGS, "--ckpt-dir",
                          str(tmp_path / "ckpt"), "--parity-k", "1", "--spares", "2",
                          "--inject-kill", "30:1,3"))
    code = job.wait(240)
    out = job.output
    assert code == 0 and "relaunching" not in out, out
    # the kills follow step 30; a survivor that had not finished step 30 when it saw a death
    # takes the generation one step back (as in the one-death tests)
    found = re.findall(r"in-place recovery: generation 1 at step (29|30): rank\(s\) \[1, 3\] "
                       r"replaced", out)
    assert len(found) == 1 and len(_IN_PLACE.findall(out)) == 0, out  # one generation, both
    assert "spare: took rank 1 of generation 1" in out, out
    assert "spare: took rank 3 of generation 1" in out, out
    assert "parity: rebuilt ranks [1, 3]" in out, out
    assert digest_in(out) == clean_digest, out
    assert not _mpi_segments() - segments


def test_an_idle_spare_leaves_when_the_training_finishes(tmp_path):
    """No death: the spare leaves at the end and the job ends at once (it used to wait in
    MPI_Finalize for trainers that, under agents, end without it)."""
    job = Job(mpickpt_run("-n", "2", "--", "--num-batches", "10", "--mini-batch-size", "64",
                          "--test-num-batches", "0", "--spares", "1"))
    started = time.monotonic()
    code = job.wait(60)
    assert code == 0 and "spare: leaving: the training finished" in job.output, job.output
    assert time.monotonic() - started < 45, job.output


def test_an_idle_spare_told_the_job_ended_by_a_stop_does_not_say_the_training_finished(tmp_path):
    """A stop sent to a trainer only (a user's kill of one trainer): the trainers save, commit
    and leave; the spare (the last launcher rank) leaves then too, saying the job ended before
    its training did. Rank 0, which got no signal, times its line from the signal's arrival at
    rank 1 (it measured none itself): held stopped for a second after the signal, it makes rank
    1 wait that long for the step boundary, which the line's reach must hold."""
    import signal

    job = Job(mpickpt_run("-n", "2", "--", "--num-batches", "100000", "--mini-batch-size", "64",
                          "--print-freq", "1", "--test-num-batches", "0", "--spares", "1",
                          "--ckpt-dir", str(tmp_path / "ckpt")))
    try:
        assert job.wait_for_line("spare: waiting", 60) and job.wait_for_step(3, 60), job.output
        trainers = job.ranks()
        assert sorted(map(rank_of, trainers)) == [0, 1, 2], (trainers, job.output)
        ranked = {rank_of(pid): pid for pid in trainers}
        os.kill(ranked[0], signal.SIGSTOP)
        os.kill(ranked[1], signal.SIGTERM)
        time.sleep(1.0)
        os.kill(ranked[0], signal.SIGCONT)
        code = job.wait(60)
    finally:
        job.stop()
    out = job.output
    m = re.search(r"stopping on a peer's stop signal after step \d+: checkpoint step \d+ "
                  r"committed ([0-9.]+) s after the signal \(([0-9.]+) s to write and commit; "
                  r"([0-9.]+) s to reach the step boundary\)", out)
    assert m, out
    after, write, reach = map(float, m.groups())
    assert write > 0 and abs(after - (write + reach)) <= 0.011, m.group(0)
    assert reach >= 0.9, m.group(0)  # rank 1's wait for the stopped rank 0, not rank 0's none
    assert "spare: leaving: the job ended before its training did (a stop signal or an error)" \
        in out and "the training finished" not in out, out
    assert code == EXIT_SAVED, out  # requeue me


def test_spares_with_in_place_off_are_refused_before_training(tmp_path):
    job = Job(mpickpt_run("-n", "2", "--", "--num-batches", "5", "--spares", "1",
                          "--in-place", "off"))
    code = job.wait(120)
    assert code == 2, job.output
    assert "--spares 1 takes a dead rank's place in place; it needs in-place recovery, not " \
           "--in-place off" in job.output and "Traceback" not in job.output, job.output
    assert "launching" in job.output and "-n 3" in job.output, job.output


@pytest.mark.slow
def test_a_killed_spare_comes_back_as_a_spare_and_takes_the_next_death(tmp_path):
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "1", "--", *FLAGS, "--ckpt-dir",
                          str(tmp_path / "ckpt"), "--spares", "1", "--num-batches", "3000"))
    try:
        assert job.wait_for_step(15), job.output
        by_rank = {rank_of(p): p for p in job.ranks()}  # read while all live: pids are not in
        spare = by_rank[4]                              # rank order, and the spare dies first
        os.kill(spare, 9)
        deadline = time.monotonic() + 60
        while job.output.count("spare: waiting for a dead rank's slot") < 2:
            assert time.monotonic() < deadline and job.proc.poll() is None, job.output
            time.sleep(0.05)
        os.kill(by_rank[1], 9)
        code = job.wait(240)
    finally:
        job.stop()
    out = job.output
    assert f"rank 4: its trainer (pid {spare}) was killed by SIGKILL" in out, out
    assert "spare: took rank 1 of generation 1" in out and code == 0, out
    assert len(_IN_PLACE.findall(out)) == 1 and "parity: rebuilt ranks [1]" in out, out
    assert "relaunching" not in out and "step 3000/3000" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10, 30))
@pytest.mark.parametrize("recovery", ["parity", "partial", "full", "parity-spare"])
def test_in_place_randomized(tmp_path, clean_digest, seed, recovery):
    spares = 1 if recovery.endswith("-spare") else 0
    job, t = _trial(tmp_path, seed, recovery.removesuffix("-spare"), spares)
    out = job.output
    if spares:
        assert [int(p) for p in _REPLACED_BY.findall(out)] == t["spares"], (t, out)
    assert t["code"] == 0 and len(_IN_PLACE.findall(out)) == 1, out
    assert "relaunching" not in out, out
    assert set(t["survivors"]) <= set(t["after"]), (t, out)
    if recovery != "partial":  # partial recovery trades exactness for the survivors' progress
        assert digest_in(out) == clean_digest, out


def _startup_trial(tmp_path, seed: int) -> tuple[Job, dict]:
    """SIGKILL one trainer at a random moment after all four exist and before the first step."""
    rng = random.Random(seed)
    segments = _mpi_segments()
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "2", "--", *FLAGS, "--ckpt-dir",
                          str(tmp_path / "ckpt"), "--in-place", "on"))
    try:
        deadline, pids = time.monotonic() + 60, []
        while time.monotonic() < deadline:  # one reading: a process between fork and exec
            pids = job.ranks()              # may be missing from the next
            if len(pids) == 4:
                break
            time.sleep(0.02)
        assert len(pids) == 4, job.output
        time.sleep(rng.uniform(0.0, 1.5))
        step_at_kill = job.step
        pid = pids[rng.randrange(4)]
        os.kill(pid, 9)
        code = job.wait(240)
        left = [p for p in pids if alive(p)]
    finally:
        job.stop()
    return job, {"pid": pid, "step": step_at_kill, "code": code, "left": left,
                 "segments_left": _mpi_segments() - segments}


def _check_startup_trial(job: Job, t: dict, clean_digest: str) -> None:
    out = job.output
    assert t["step"] == 0, f"the kill came after step {t['step']}, not during startup"
    assert f"its trainer (pid {t['pid']}) was killed by SIGKILL" in out, out
    # before the trainer said it started, the run ends at once and is relaunched; in the moment
    # after it did, the kill is recovered in place like any other
    if "during startup" in out:
        assert "relaunching (restart 1 of 2)" in out and "restart 2" not in out, out
    else:
        assert len(_IN_PLACE.findall(out)) == 1, out
    assert t["code"] == 0, out
    assert digest_in(out) == clean_digest, out
    assert not t["left"], f"processes of the first run outlived the job: {t['left']}"
    assert not t["segments_left"], f"MPI segments left in /dev/shm: {t['segments_left']}"


def _two_deaths(tmp_path, flags, rng, first_by: int, second) -> tuple[Job, dict]:
    """Start a job of `flags`; once step `first_by` is reached kill a random trainer, then
    `second(job, pid, rank, before)` waits as the trial wants and returns (the second victim,
    whether its kill falls where the trial wants it, judged before the kill); kill it too and
    wait for the job's end."""
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "1", "--", *flags,
                          "--ckpt-dir", str(tmp_path / "ckpt")))
    try:
        assert job.wait_for_step(first_by), job.output
        before = job.ranks()
        pid, rank = job.kill_rank(pick=rng.choice)
        victim, during = second(job, pid, rank, before)
        os.kill(victim, 9)
        code = job.wait(240)
    finally:
        job.stop()
    return job, {"rank": rank, "victim": victim, "during": during, "code": code}


def _second_death_trial(tmp_path, seed: int, target: str, pause: float) -> tuple[Job, dict]:
    """Kill a random trainer at a random step, then, while the next generation forms, kill
    `target` ("replacement": the process its agent started; "survivor": another trainer)
    `pause` s after the first death is seen (or after the replacement appeared)."""
    rng = random.Random(seed)

    def second(job, pid, rank, before):
        assert job.wait_for_line(rf"its trainer \(pid {pid}\) was killed", 30), job.output
        if target == "replacement":
            deadline = time.monotonic() + 30
            while not (new := set(job.ranks()) - set(before)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert new, job.output
            victim = new.pop()
        else:
            victim = rng.choice([p for p in before if p != pid])
        time.sleep(pause)
        return victim, not _IN_PLACE.search(job.output)  # the generation had not formed yet

    return _two_deaths(tmp_path, FLAGS, rng, rng.randint(22, 45), second)


@pytest.mark.parametrize("target", ["replacement"])
def test_a_second_death_while_the_generation_forms(tmp_path, clean_digest, target):
    """The replacement killed as it starts: the job recovers (in place, or by a relaunch from
    the survivors' state) to the failure-free digest and never hangs."""
    job, t = _second_death_trial(tmp_path, 8, target, 0.2)
    out = job.output
    assert t["during"], out
    assert f"its trainer (pid {t['victim']}) was killed by SIGKILL" in out, out
    assert t["code"] == 0 and digest_in(out) == clean_digest, out


@pytest.mark.parametrize("victim", [0, 1])  # a survivor, the replacement
def test_a_death_after_the_generation_formed_before_its_watch_stood_ends_it_at_once(
        tmp_path, clean_digest, victim):
    """Rank 1 killed after step 30; in generation 1, rank `victim` SIGKILLs itself after the
    generation formed and before its peer watch stood (`--inject-kill-settling`). Nothing
    watched there before (the old ring closed, the new one not up: the others waited in gloo
    for minutes; seen once in the randomized trials). Now the old ring sees a survivor die, and
    the store a replacement (its respawn records the death): the survivors fall back to a
    relaunch at once (or gloo's own error does, on a rank whose connection to the dead one
    closed), and the job ends with the failure-free digest."""
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "1", "--", *FLAGS,
                          "--ckpt-dir", str(tmp_path / "ckpt"), "--inject-kill", "30:1",
                          "--inject-kill-settling", str(victim)))
    try:
        code = job.wait(150)
    finally:
        job.stop()
    out = job.output
    assert code == 0 and digest_in(out) == clean_digest, out
    kept = sorted({0, 2, 3} - {victim})  # a survivor that died dumped nothing
    # generation 1 goes on from the earliest step a survivor completed: 30, or 29 where one
    # had not finished step 30 when rank 1 died (the others undo theirs)
    dumped = set(re.findall(r"survivor state of step (\d+) dumped", out))
    assert len(dumped) == 1 and dumped <= {"29", "30"}, out
    assert "in-place recovery failed" in out and f"relaunch: ranks {kept} restored from their " \
        f"survivor dumps at step {dumped.pop()}" in out, out
    assert not _IN_PLACE.search(out), out  # generation 1 never settled


def test_the_death_of_the_last_survivor_while_the_generation_forms_falls_back_at_once(
        tmp_path):
    """2 ranks: rank 1 killed after step 30, then the only survivor, once it registered in
    generation 1. Nobody is left to start generation 2: rank 1's replacement finds every slot of
    generation 1 registered and waits in its groups' rendezvous for the dead survivor, and rank
    0's respawn finds its slot held by it. At --join-timeout the respawn says at the store that
    the job falls back, so the replacement ends then too (it waited for its 300 s startup
    deadline) and mpickpt-run relaunches from the checkpoint to the failure-free digest."""
    flags = FLAGS[:-2]  # no parity on 2 ranks: a rollback in place
    clean = run_ranks(2, "mpickpt.train", *flags, "--ckpt-dir", str(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    job = Job(mpickpt_run("-n", "2", "--max-restarts", "1", "--", *flags, "--ckpt-dir",
                          str(tmp_path / "ckpt"), "--inject-kill", "30:1", "--join-timeout",
                          "10"))
    try:
        assert job.wait_for_line(r"wait for the replacement\(s\) \(generation 1\)", 60), \
            job.output
        time.sleep(0.3)  # registered in generation 1 by now, waiting for the replacement
        start = time.monotonic()
        job.kill_rank(pick=lambda pids: next(p for p in pids if rank_of(p) == 0))
        code = job.wait(200)
        took = time.monotonic() - start
    finally:
        job.stop()
    out = job.output
    assert code == 0 and digest_in(out) == digest_in(clean.stdout), out
    assert "relaunching (restart 1 of 1)" in out and "in-place recovery:" not in out, out
    assert took < 90, (took, out)  # the join timeout and a relaunch, not a startup deadline


def test_a_replacement_of_rank_0_goes_on_from_a_survivors_record_of_the_run(tmp_path,
                                                                             clean_digest):
    """Rank 0 killed at step 20 (4 ranks, parity; the generation agrees on step 19 or 20): the
    lowest survivor says the death, the replacement's run report and checkpoint summary cover
    the whole run (a survivor's record, handed over at the join), and a checkpoint rank 0 was
    to commit when it died leaves no directory behind."""
    report = tmp_path / "report.json"
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "0", "--", *FLAGS, "--ckpt-dir",
                          str(tmp_path / "ckpt"), "--inject-kill", "20:0", "--run-report",
                          str(report)))
    try:
        code = job.wait(200)
    finally:
        job.stop()
    out = job.output
    assert code == 0 and digest_in(out) == clean_digest, out
    assert re.search(r"rank\(s\) \[0\] died after step (19|20): the survivors keep their", out)
    joined = re.search(r"in-place recovery: generation 1 at step (19|20): rank\(s\) \[0\] "
                       r"replaced", out)
    assert joined, out
    doc = json.loads(report.read_text())
    steps = [s[0] for s in doc["steps"]]  # a step undone at the join is there twice
    assert doc["start_step"] == 0 and sorted(set(steps)) == list(range(1, 121)), doc
    assert len(steps) - 120 == 20 - int(joined.group(1)), doc
    saved = re.search(r"checkpoints: (\d+) saved, \d+ committed, \d+ abandoned since rank 0's "
                      rf"replacement joined at step {joined.group(1)},", out)
    assert saved and int(saved.group(1)) == doc["checkpoints"] >= 120 // 20, out
    assert not torn_dirs(str(tmp_path / "ckpt"), list_manifests(str(tmp_path / "ckpt"))), out


def test_a_death_nothing_in_place_can_recover_falls_back_to_a_relaunch_at_once(tmp_path):
    """No --ckpt-dir and no parity (2 ranks): a replacement could not recover the lost shard,
    so the survivors do not form a generation for it (it failed with a traceback before) and
    relaunch at once, saying why; the relaunch trains to the failure-free digest."""
    flags = FLAGS[:-4]  # no --ckpt-interval, no parity
    clean = run_ranks(2, "mpickpt.train", *flags)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    job = Job(mpickpt_run("-n", "2", "--max-restarts", "1", "--", *flags, "--inject-kill",
                          "30:1"))
    try:
        code = job.wait(200)
    finally:
        job.stop()
    out = job.output
    assert code == 0 and digest_in(out) == digest_in(clean.stdout), out
    assert "in-place recovery failed (nothing in place can recover it: ranks [1] lost their " \
           "shards after step 30: there is no checkpoint to fall back to (--ckpt-dir)); " \
           "falling back to a relaunch" in out, out
    assert "Traceback" not in out and "generation 1" not in out, out


def test_an_agent_without_respawns_left_lets_the_survivors_fall_back_at_once(tmp_path):
    """MPICKPT_RESPAWNS=0, rank 1 killed after step 30 (2 ranks, no parity): its agent cannot
    replace it, says so and ends as a lost agent, so the survivor gives up at once instead of
    waiting --join-timeout (60 s) for a respawn, and the relaunch resumes from its dump."""
    flags = FLAGS[:-2]
    clean = run_ranks(2, "mpickpt.train", *flags, "--ckpt-dir", str(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    job = Job(mpickpt_run("-n", "2", "--max-restarts", "1", "--", *flags, "--ckpt-dir",
                          str(tmp_path / "ckpt"), "--inject-kill", "30:1"),
              env=dict(os.environ, MPICKPT_RESPAWNS="0"))
    try:
        assert job.wait_for_line(r"wait for the replacement\(s\) \(generation 1\)", 60), \
            job.output
        start = time.monotonic()
        assert job.wait_for_line(r"relaunching \(restart 1 of 1\)", 50), job.output
        took = time.monotonic() - start
        code = job.wait(200)
    finally:
        job.stop()
    out = job.output
    assert "rank 1: no respawn left (0 made, MPICKPT_RESPAWNS allows 0)" in out, out
    assert "nobody can take rank(s) [1]" in out and took < 30, (took, out)
    assert code == 0 and digest_in(out) == digest_in(clean.stdout), out


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(90, 110))
def test_second_deaths_while_the_generation_forms_randomized(tmp_path, clean_digest, seed):
    rng = random.Random(seed)
    target = rng.choice(["replacement", "survivor"])
    job, t = _second_death_trial(tmp_path, seed, target,
                                 rng.uniform(0.0, 0.8 if target == "replacement" else 1.0))
    out = job.output
    assert t["during"], f"the second kill came after the recovery:\n{out}"
    assert f"its trainer (pid {t['victim']}) was killed by SIGKILL" in out, out
    assert t["code"] == 0 and digest_in(out) == clean_digest, out


SLOW_REBUILD = [*FLAGS, "--arch-embedding-size", "40000-30000-20000-10000-5000-1000-500-100",
                "--rebuild-budget", "0.001"]
"""Tables 10x the default and a small budget: a rank's rebuild takes about a dozen steps."""


@pytest.fixture(scope="module")
def slow_rebuild_digest(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("clean-slow-rebuild")
    proc = run_ranks(4, "mpickpt.train", *SLOW_REBUILD, "--ckpt-dir", str(root / "ckpt"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return digest_in(proc.stdout)


def _rebuild_death_trial(tmp_path, seed: int, target: str, pause: float) -> tuple[Job, dict]:
    """Kill a random trainer at a random step; once the next generation began the parity
    rebuild of its shard (`SLOW_REBUILD`), kill `target` ("replacement": the rank being
    rebuilt; "survivor": another trainer of its parity group) `pause` s later (a negative
    pause: after the next step instead)."""
    rng = random.Random(seed)

    def second(job, pid, rank, before):
        assert job.wait_for_line(rf"ranks \[{rank}\] lost their shards", 60), job.output
        if pause < 0:
            assert job.wait_for_step(job.step + 1), job.output
        else:
            time.sleep(pause)
        now = job.ranks()
        victim = rng.choice(sorted(set(now) - set(before)) if target == "replacement" else
                            [p for p in before if p != pid])
        # the rebuild still ran: its line comes at the lookup after its end (the report is
        # reduced beside training), a step late at most in a rebuild of about a dozen steps
        return victim, "parity: rebuilt ranks" not in job.output

    return _two_deaths(tmp_path, SLOW_REBUILD, rng, rng.randint(22, 30), second)


def test_a_second_death_during_the_parity_rebuild_rolls_back_in_place(tmp_path,
                                                                      slow_rebuild_digest):
    """A survivor killed while the replaced shard is still being rebuilt from parity: the rank
    being rebuilt is not whole, so the next generation recovers both (more than parity covers:
    a rollback to the checkpoint, in place, on every member alike, the fresh replacement
    included), and the job ends with the failure-free digest, without a relaunch."""
    job, t = _rebuild_death_trial(tmp_path, 6, "survivor", -1)
    out = job.output
    assert t["during"], f"the rebuild had ended before the second kill:\n{out}"
    assert f"its trainer (pid {t['victim']}) was killed by SIGKILL" in out, out
    assert f"rank(s) [{t['rank']}] lost their unfinished parity rebuild" in out, out
    assert "falling back to the latest checkpoint" in out, out
    assert len(_IN_PLACE.findall(out)) == 2 and "relaunching" not in out, out
    assert t["code"] == 0 and digest_in(out) == slow_rebuild_digest, out


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(110, 130))
def test_second_deaths_during_the_parity_rebuild_randomized(tmp_path, slow_rebuild_digest,
                                                           seed):
    """The second death anywhere from the rebuild's start (the new generation settling in, its
    watch forming) to its training steps, of the rank being rebuilt or another: the job
    recovers, in place or by a relaunch, to the failure-free digest and never hangs."""
    rng = random.Random(seed)
    job, t = _rebuild_death_trial(tmp_path, seed, rng.choice(["replacement", "survivor"]),
                                  rng.uniform(0.0, 0.2))
    out = job.output
    assert t["during"], f"the rebuild had ended before the second kill:\n{out}"
    assert f"its trainer (pid {t['victim']}) was killed by SIGKILL" in out, out
    assert t["code"] == 0 and digest_in(out) == slow_rebuild_digest, out


def _end_trial(tmp_path, pattern: str, rank: int, delay: float,
               flags=()) -> tuple[Job, int, int, float]:
    """Kill launcher rank `rank`'s trainer `delay` s after a line matching `pattern`, at the
    run's end (`flags` after FLAGS); (job, exit status, killed pid, seconds from the kill to the
    job's end). The
    kill must land: AssertionError where the trainer had already exited (a zombie its agent
    had not reaped yet takes a SIGKILL without effect)."""
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "1", "--", *FLAGS,
                          "--ckpt-dir", str(tmp_path / "ckpt"), *flags))
    try:
        assert job.wait_for_step(5), job.output
        pid = {rank_of(p): p for p in job.ranks()}[rank]
        assert job.wait_for_line(pattern), job.output
        time.sleep(delay)
        assert alive(pid), f"rank {rank}'s trainer had exited {delay:.2f} s after {pattern}"
        os.kill(pid, 9)
        killed = time.monotonic()
        code = job.wait(120)
        took = time.monotonic() - killed
    finally:
        job.stop()
    return job, code, pid, took


@pytest.mark.parametrize("pattern,rank", [(r"^checkpoints: \d+ saved", 0),
                                          pytest.param(r"^digest [0-9a-f]", 2,
                                                       marks=pytest.mark.slow)])
def test_a_death_at_the_runs_end_neither_hangs_nor_changes_the_digest(tmp_path, clean_digest,
                                                                       pattern, rank):
    """After the last checkpoint closed (the survivors and the replacement then agree on what
    of the run's end is left to do: the rebuild settled again, the report) and after the
    digest (the survivors end without MPI_Finalize, which waited for the dead rank: a hang)."""
    job, code, pid, took = _end_trial(tmp_path, pattern, rank, 0.0)
    out = job.output
    assert f"rank {rank}: its trainer (pid {pid}) was killed by SIGKILL" in out, out
    assert code == 0 and digest_in(out) == clean_digest, out
    assert "relaunching" not in out and took < 30, \
        f"{took:.1f} s after the kill\n" + _recovery_lines(out)


@pytest.mark.parametrize("recovery", ["full", pytest.param("partial", marks=pytest.mark.slow)])
def test_a_recovery_from_checkpoints_after_the_run_s_end_closed_them(tmp_path, clean_digest,
                                                                     recovery):
    """Killed after the close, the last checkpoint at step 100 of 120: the new generation's
    managers are all closed (a replacement's and a lagging survivor's stop before the
    recovery); a partial recovery reloads the lost shard from step 100, a full rollback
    replays steps 101-120 without saving and ends at the failure-free digest."""
    job, code, pid, _ = _end_trial(tmp_path, r"^checkpoints: \d+ saved", 1, 0.0,
                                   ("--recovery", recovery, "--ckpt-interval", "25"))
    out = job.output
    assert code == 0 and "relaunching" not in out and "Traceback" not in out, out
    assert re.search(r"in-place recovery: generation 1 at step 120: rank\(s\) \[1\] replaced",
                     out), _recovery_lines(out)
    if recovery == "full":
        assert "steps 101.. replay without checkpoints: the run's end had closed them" in out, out
        assert len(re.findall(r"^step 101/120 ", out, re.M)) == 2 and \
            digest_in(out) == clean_digest, out
    else:
        assert "reloaded from checkpoint step 100" in out and digest_in(out), out
    assert max(m.step for m in list_manifests(str(tmp_path / "ckpt"))) == 100, out


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(70, 90))
def test_deaths_at_the_runs_end_randomized(tmp_path, clean_digest, seed):
    """A random rank killed 0-0.4 s after the last step's line: in place or already done,
    exit 0 with the failure-free digest within seconds."""
    rng = random.Random(seed)
    rank, delay = rng.randrange(4), rng.uniform(0.0, 0.4)
    for attempt in range(3):  # a trainer that ended first (its run's end is ~0.3 s here) is
        try:                  # tried again, sooner: the kill must land
            (tmp_path / str(attempt)).mkdir()
            job, code, pid, took = _end_trial(tmp_path / str(attempt), r"^step 120/120",
                                              rank, delay)
            break
        except AssertionError as e:
            if "had exited" not in str(e) or attempt == 2:
                raise
            delay /= 2
    out = job.output
    assert f"its trainer (pid {pid}) was killed by SIGKILL" in out, out
    assert code == 0 and digest_in(out) == clean_digest, out
    assert "relaunching" not in out and took < 30, \
        f"{took:.1f} s after the kill\n" + _recovery_lines(out)


@pytest.mark.slow
@pytest.mark.timeout(900)  # up to 40 trials of ~12 s
def test_a_death_in_the_final_close_s_barrier_lets_the_survivors_that_lag_end_it_alone(
        tmp_path, clean_digest):
    """Rank 0 killed as it commits the last checkpoint: a death in the close's barrier lets
    some survivors through and not others (one trial in 5 to 15 here). Before, their
    different ends refused the generation and the job relaunched; now the others end the close
    alone and the job ends in place. Trials go on until that mix happened (the fault asserted)."""
    rng, mixes = random.Random(3), 0
    for trial in range(40):
        (tmp_path / str(trial)).mkdir()
        job, code, pid, took = _end_trial(tmp_path / str(trial), r"^checkpoint step 120 committed",
                                          0, rng.uniform(0.0, 0.02))
        out = job.output
        assert code == 0 and digest_in(out) == clean_digest, out
        assert "relaunching" not in out and took < 30, \
            f"{took:.1f} s after the kill\n" + _recovery_lines(out)
        mixes += "which this rank was ending: it ends it alone" in out
        if mixes:
            break
    assert mixes, f"no survivor lagged at the close's barrier in {trial + 1} trials"


def _recovery_lines(out: str) -> str:
    """The lines of a job's output that say how a death was handled (pytest shortens a long
    output to its start, which holds only the steps: these lines come first here)."""
    keys = ("in-place", "in place", "died", "peer", "exited", "relaunch", "generation", "dump")
    return "\n".join(line for line in out.splitlines() if any(k in line for k in keys)) + \
        "\n--- the whole output ---\n" + out


@pytest.mark.parametrize("seed", [5])
def test_a_trainer_killed_during_startup_ends_the_run_at_once(tmp_path, clean_digest, seed):
    job, t = _startup_trial(tmp_path, seed)
    _check_startup_trial(job, t, clean_digest)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40, 60))
def test_startup_kills_randomized(tmp_path, clean_digest, seed):
    job, t = _startup_trial(tmp_path, seed)
    _check_startup_trial(job, t, clean_digest)


NODES = ("--launcher-arg=-launcher", "--launcher-arg=fork", "--launcher-arg=-hosts",
         "--launcher-arg=127.0.0.1:2,127.0.0.2:2,127.0.0.3:2")
"""Hydra with one proxy per "host", all forked here: three emulated nodes of two processes
each (ranks 0-1, 2-3, and the spares 4-5 when there are two)."""


def _agent_of(job: Job, launcher_rank: int) -> int:
    """The pid of the node agent (rank wrapper) of `launcher_rank`."""
    for pid, cmd in descendants(job.proc.pid):
        if "mpickpt.launch.rank_wrapper" in cmd:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:
                continue
            if env.get(b"PMI_RANK") == str(launcher_rank).encode():
                return pid
    raise AssertionError(f"no agent of rank {launcher_rank}:\n{job.output[-2000:]}")


def _node_loss(tmp_path, node: int, spares: int) -> tuple[Job, int, list[int]]:
    """Lose emulated node `node` at a random step: SIGKILL the agents of its two ranks at once
    (each trainer dies with its agent); (job, exit status, the agents' pids)."""
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "1", *NODES, "--", *FLAGS,
                          "--ckpt-dir", str(tmp_path / "ckpt"), "--spares", str(spares)))
    try:
        assert job.wait_for_step(random.Random(node).randint(25, 45)), job.output
        agents = [_agent_of(job, rank) for rank in (2 * node, 2 * node + 1)]
        for agent in agents:
            os.kill(agent, 9)
        code = job.wait(240)
    finally:
        job.stop()
    return job, code, agents


def test_rank_0s_node_lost_with_spares_is_recovered_in_place(tmp_path, clean_digest):
    """The node of ranks 0 and 1 is lost (their agents SIGKILLed; the store lives in
    mpickpt-run, so the job goes on): the two spares on the third node take both ranks in one
    generation, two losses exceed parity's r=1 so the generation rolls back to the checkpoint
    in place, and the run counts as finished though hydra reports the killed agents."""
    job, code, agents = _node_loss(tmp_path, 0, spares=2)
    out = job.output
    assert code == 0, out
    found = re.findall(r"in-place recovery: generation 1 at step \d+: rank\(s\) \[0, 1\] "
                       r"replaced", out)
    assert len(found) == 1 and len(_IN_PLACE.findall(out)) == 0, out
    assert "spare: took rank 0 of generation 1" in out, out
    assert "spare: took rank 1 of generation 1" in out, out
    assert "relaunching" not in out and "exiting for a relaunch" not in out, out
    assert "the training completed (step 120)" in out and "agents lost: [0, 1]" in out, out
    assert digest_in(out) == clean_digest, out


@pytest.mark.slow
def test_a_lost_node_without_spares_falls_back_at_once(tmp_path, clean_digest):
    """No spare, the node of ranks 2-3 lost: nobody can take their ranks, so the survivors
    give up at once (not after --join-timeout) and the relaunch resumes from their dumps."""
    start = time.monotonic()
    job, code, agents = _node_loss(tmp_path, 1, spares=0)
    out = job.output
    assert code == 0 and "nobody can take rank(s) [2" in out, out
    assert "relaunching (restart 1 of 1)" in out, out
    assert "restored from their survivor dumps" in out, out
    assert digest_in(out) == clean_digest, out
    assert time.monotonic() - start < 100, "the survivors waited for a respawn"


def test_emulated_losses_fire_alike_on_a_replacement_and_the_survivors(tmp_path):
    """`--inject-failure` and a real death: the replacement goes on from the first survivor's
    record of the losses fired (`Rejoined.faults`), so the in-place rollback's replay does not
    fire step 25's loss again on it alone (the job hung in mismatched collectives); it ends
    with the digest of the same run without the death. The `--failure-model` emulator's clock
    is handed over the same way (`FailureEmulator.go_on_from`)."""
    small = ("--arch-embedding-size", "300-200-100-50", "--arch-sparse-feature-size", "8",
             "--arch-mlp-bot", "13-16-8", "--arch-mlp-top", "16-1", "--mini-batch-size", "32",
             "--num-batches", "60", "--ckpt-interval", "10", "--print-freq", "0",
             "--test-num-batches", "0", "--digest", "--recovery", "full",
             "--inject-failure", "25:1")
    want = run_ranks(2, "mpickpt.train", *small, "--ckpt-dir", str(tmp_path / "clean"))
    assert want.returncode == 0, want.stdout + want.stderr
    job = Job(mpickpt_run("-n", "2", "--max-restarts", "0", "--", *small, "--ckpt-dir",
                          str(tmp_path / "ckpt"), "--inject-kill", "28:1"))
    try:
        code = job.wait(90)
    finally:
        job.stop()
    out = job.output
    assert "in-place recovery: generation 1 at step 28: rank(s) [1] replaced" in out, out
    assert out.count("ranks [1] lost their shards after step 25") == 1, out
    assert code == 0 and digest_in(out) == digest_in(want.stdout), out


def test_a_replacement_goes_on_from_the_emulators_progress():
    """`FailureEmulator.go_on_from`: a fresh emulator given another's progress fires the same
    failures at the same executed steps from there on."""
    from mpickpt.faults.emulator import FailureEmulator
    from mpickpt.faults.process import FailureModel

    def emulator():
        return FailureEmulator(FailureModel.parse("exponential:5"), 1.0, 0.5, [100, 100], 3)

    first, second = emulator(), emulator()
    for step in range(1, 41):
        first.step_done(step)
    second.go_on_from(*first.progress())
    assert second.progress() == first.progress() and len(first.fired) > 2
    later = [(first.step_done(s), second.step_done(s)) for s in range(41, 121)]
    fired = [(a.after_step, a.shards) for a, b in later if a is not None]
    assert fired and fired == [(b.after_step, b.shards) for a, b in later if b is not None]
