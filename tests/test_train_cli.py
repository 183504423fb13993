"""The trainer as users launch it: real `mpiexec` jobs, checked by their output."""
import json
import os
import re

import pytest

from mpickpt.store.manifest import list_manifests
from tests.launch import SHARED_CRITEO, digest_of, finish, run_ranks, start_ranks

SMALL = ("--arch-embedding-size", "300-200-100-50", "--arch-sparse-feature-size", "8",
         "--arch-mlp-bot", "13-16-8", "--arch-mlp-top", "16-1", "--mini-batch-size", "32",
         "--test-num-batches", "2", "--print-freq", "0")


def test_digest_is_reproducible_and_changes_with_one_more_step():
    jobs = [start_ranks(2, "mpickpt.train", *SMALL, "--num-batches", str(n), "--digest")
            for n in (6, 6, 7)]  # side by side
    a, b, c = (digest_of(finish(job)) for job in jobs)
    assert re.fullmatch(r"[0-9a-f]{64}", a)
    assert a == b
    assert c != a


def test_demo_job_learns_the_planted_model():
    proc = run_ranks(2, "mpickpt.train", "--num-batches", "200", "--print-freq", "50",
                     "--mini-batch-size", "256")
    assert proc.returncode == 0, proc.stderr
    steps = re.findall(r"^step (\d+)/200  loss ([0-9.]+)  ([0-9,]+) samples/s$", proc.stdout, re.M)
    assert [int(s[0]) for s in steps] == [50, 100, 150, 200]
    auc = float(re.search(r"test @ step 200: auc ([0-9.]+)", proc.stdout).group(1))
    assert auc > 0.68, proc.stdout
    assert float(steps[-1][1]) < float(steps[0][1])


@pytest.mark.skipif(not SHARED_CRITEO.exists(), reason="shared Criteo sample not present")
def test_trains_on_real_criteo_rows():
    proc = run_ranks(2, "mpickpt.train", "--data-generation", "criteo-tsv", "--raw-data-file",
                     str(SHARED_CRITEO), "--arch-embedding-size", "criteo-kaggle",
                     "--embedding-scale-down", "10000", "--mini-batch-size", "20",
                     "--num-batches", "100", "--print-freq", "5", "--test-num-batches", "10")
    assert proc.returncode == 0, proc.stderr
    assert "step 10/100" in proc.stdout
    assert "end of training data after 10 batches" in proc.stdout
    assert re.search(r"test @ step 10: auc [0-9.]+  logloss [0-9.]+  \(200 samples\)", proc.stdout)


END_TO_END_BAD_INPUTS = [
    (2, ["--mini-batch-size", "0"], r"--mini-batch-size: expected an integer >= 1, got 0"),
    (2, ["--mini-batch-size", "5"], r"--mini-batch-size 5 is not divisible by the world size 2"),
]
"""Every refusal is tested in process (tests/test_train_flags.py); these two launches check what a
user sees: one error line from rank 0, exit status 2, no traceback, no training."""


@pytest.mark.parametrize("ranks, flags, message", END_TO_END_BAD_INPUTS,
                         ids=[" ".join(b[1]) for b in END_TO_END_BAD_INPUTS])
def test_bad_input_stops_before_training(ranks, flags, message):
    proc = run_ranks(ranks, "mpickpt.train", "--num-batches", "3", *flags, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert proc.stderr.count("mpickpt-train: error:") == 1
    assert "step " not in proc.stdout


def test_malformed_line_mid_file_names_file_and_line(tmp_path):
    good = "\t".join(["1"] + ["3"] * 13 + ["0a0b0c0d"] * 26)
    path = tmp_path / "day_0"
    path.write_text("\n".join([good] * 7 + ["1\t2\t3"] + [good] * 4 + ["x"]) + "\n")
    args = ("--data-generation", "criteo-tsv", "--raw-data-file", str(path), "--arch-embedding-size",
            "criteo-kaggle", "--embedding-scale-down", "100000", "--mini-batch-size", "2",
            "--num-batches", "5", "--test-num-batches", "0")
    proc = run_ranks(2, "mpickpt.train", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert re.search(rf"{path}.*line 8", proc.stderr), proc.stderr
    # the checkpoint in flight at the error (step 3, while step 4 read line 8) is committed
    ckpt = tmp_path / "ckpt"
    saved = run_ranks(2, "mpickpt.train", *args, "--ckpt-dir", str(ckpt), "--ckpt-interval", "3")
    assert saved.returncode == 2 and re.search(rf"{path}.*line 8", saved.stderr), saved.stderr
    assert [m.step for m in list_manifests(str(ckpt))] == [3], saved.stdout
    report = tmp_path / "report.json"
    skipped = run_ranks(2, "mpickpt.train", *args, "--skip-bad-lines", "--print-freq", "1",
                        "--run-report", str(report), "--num-batches", "6")
    assert skipped.returncode == 0, skipped.stderr
    assert "step 5/6" in skipped.stdout and "step 6/6" not in skipped.stdout
    # the last line, malformed, lies among those the end of the data leaves untrained
    assert "end of training data after 5 batches (the last 1 valid line(s), fewer than a " \
           "global batch of 2, not trained on; 1 malformed line(s) among them skipped)" \
           in skipped.stdout, skipped.stdout
    assert skipped.stdout.count("--skip-bad-lines: 2 malformed line(s) of the training data "
                                "skipped so far") == 1, skipped.stdout
    assert json.loads(report.read_text())["skipped_lines"] == 2


def test_a_resume_over_a_changed_data_file_names_it(tmp_path):
    """A resume reads on from the saved byte offset: over a file that only grew it goes on;
    over a file whose lines before that offset changed it stops before training (exit 2),
    naming the file and the line, and keeps the checkpoints; a resume of them on synthetic
    data is refused alike."""
    lines = ["\t".join([str(k % 2)] + [str(k)] * 13 + [f"{k:08x}"] * 26) for k in range(20)]
    path, ckpt = tmp_path / "day_0", str(tmp_path / "ckpt")
    path.write_text("\n".join(lines[:12]) + "\n")
    args = ("--data-generation", "criteo-tsv", "--raw-data-file", str(path),
            "--arch-embedding-size", "criteo-kaggle", "--embedding-scale-down", "100000",
            "--mini-batch-size", "2", "--test-num-batches", "0", "--ckpt-dir", ckpt,
            "--ckpt-final")
    first = run_ranks(1, "mpickpt.train", *args, "--num-batches", "3")
    assert first.returncode == 0, first.stderr
    path.write_text("\n".join(lines) + "\n")  # 8 more lines after the 12 the run knew
    grown = run_ranks(1, "mpickpt.train", *args, "--num-batches", "5")
    assert grown.returncode == 0 and "step 5/5" in grown.stdout, grown.stdout + grown.stderr
    path.write_text("\n".join(lines[:9] + [lines[15]] + lines[10:]) + "\n")  # line 10 of 10 read
    changed = run_ranks(1, "mpickpt.train", *args, "--num-batches", "7")
    assert changed.returncode == 2 and "Traceback" not in changed.stderr, changed.stderr
    assert f"mpickpt-train: error: {path}, line 10: this line differs from the one read when " \
           f"the checkpoint was saved" in changed.stderr, changed.stderr
    assert [m.step for m in list_manifests(ckpt)] == [3, 5]
    synthetic = run_ranks(1, "mpickpt.train", *args[4:], "--num-batches", "7")
    assert synthetic.returncode == 2 and "Traceback" not in synthetic.stderr, synthetic.stderr
    assert "the resumed checkpoint's reader read tsv data, and this run reads synthetic data " \
           "(--data-generation synthetic)" in synthetic.stderr, synthetic.stderr


def test_training_data_shorter_than_one_batch_is_bad_input(tmp_path):
    """Nothing to train is an error (exit 2), not a run that ends at once with status 0."""
    good = "\t".join(["1"] + ["3"] * 13 + ["0a0b0c0d"] * 26)
    path = tmp_path / "day_0"
    path.write_text("\n".join([good] * 3 + ["1\t2\t3"]) + "\n")
    proc = run_ranks(1, "mpickpt.train", "--data-generation", "criteo-tsv", "--raw-data-file",
                     str(path), "--arch-embedding-size", "criteo-kaggle", "--embedding-scale-down",
                     "100000", "--mini-batch-size", "4", "--num-batches", "5",
                     "--test-num-batches", "0", "--skip-bad-lines")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"mpickpt-train: error: --raw-data-file {path}: fewer valid lines than one global " \
           f"batch (--mini-batch-size 4): nothing to train" in proc.stderr, proc.stderr


def test_a_run_that_ends_before_its_first_checkpoint_says_so(tmp_path):
    """--ckpt-dir with the default interval (100) on a 3-step run: nothing would be saved, and
    the start says it; with --ckpt-final the last step is saved and nothing is said."""
    ckpt = str(tmp_path / "ckpt")
    jobs = [start_ranks(1, "mpickpt.train", *SMALL, "--num-batches", "3", "--ckpt-dir", d, *more)
            for d, more in ((ckpt, ()), (ckpt + "-final", ("--ckpt-final",)))]
    silent, final = (finish(job) for job in jobs)
    said = ("no checkpoint is due in this run: the next one at step 100, after its end at step 3 "
            "(--ckpt-interval 100); only a stop signal would save one, --ckpt-final saves the "
            "last step")
    assert said in silent.stdout and not list_manifests(ckpt), silent.stdout
    assert "no checkpoint is due" not in final.stdout, final.stdout
    assert [m.step for m in list_manifests(ckpt + "-final")] == [3], final.stdout
    done = finish(start_ranks(1, "mpickpt.train", *SMALL, "--num-batches", "2", "--ckpt-dir",
                              ckpt + "-final"))
    assert done.returncode == 0 and "nothing left to train: resumed at step 3, at or past " \
        "--num-batches 2 (raise it to train on)" in done.stdout, done.stdout + done.stderr


def test_a_run_that_goes_back_replaces_the_later_checkpoints_of_the_run_before(tmp_path):
    """--resume STEP (or none) over newer checkpoints starts another timeline: once the restore
    is agreed the newer checkpoints go (manifests and directories), so that they neither stay
    the newest nor have retention delete the new run's own as older; the next launch then
    resumes the new timeline, as an uninterrupted run of the same length would end."""
    ckpt = str(tmp_path / "ckpt")
    common = (*SMALL, "--ckpt-dir", ckpt, "--ckpt-interval", "4", "--ckpt-kind", "consecutive",
              "--digest")
    first = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "12"))
    assert [m.step for m in list_manifests(ckpt)] == [4, 8, 12], first.stdout + first.stderr
    old = {m.step: m.ckpt_id for m in list_manifests(ckpt)}
    look = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "4", "--resume", "4"))
    assert "nothing left to train" in look.stdout and "retired" not in look.stdout, look.stdout
    assert {m.step: m.ckpt_id for m in list_manifests(ckpt)} == old  # it trained nothing
    back = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "8", "--resume", "4"))
    assert back.returncode == 0 and "--resume 4: retired the checkpoint(s) of step(s) [8, 12], " \
        "past step 4 where this run starts (the timeline it replaces)" in back.stdout, \
        back.stdout + back.stderr
    now = {m.step: m.ckpt_id for m in list_manifests(ckpt)}
    assert now[4] == old[4] and now[8] != old[8] and 12 not in now, now
    dirs = sorted(d for d in os.listdir(ckpt) if d.startswith("step-"))
    assert dirs == sorted({old[4], now[8]}), dirs  # nothing torn left behind
    again = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "8"))
    assert "resumed from checkpoint step 8 " in again.stdout and "torn" not in again.stdout
    straight = finish(start_ranks(1, "mpickpt.train", *SMALL, "--num-batches", "8", "--digest"))
    assert digest_of(again) == digest_of(back) == digest_of(straight)


def test_a_relaunch_carries_out_a_chosen_start_its_first_launch_did_not(tmp_path, monkeypatch):
    """A first launch with --resume STEP records that it replaces the newer checkpoints as soon
    as its flags are agreed (`store.replacing`) and retires them only after its restore: one
    that ends in between (here its model cannot be built: 90G rows) leaves them and the record,
    and so does a run that trains nothing past the step (a look at it). The relaunch of the
    same command then starts at the chosen step again, not at the newest checkpoint of the
    timeline the user left, and the record goes with the retirement; a later relaunch resumes
    the new timeline."""
    from mpickpt.exit_codes import EXIT_STARTUP_FAILED
    from mpickpt.store import replacing

    ckpt = str(tmp_path / "ckpt")
    common = (*SMALL, "--ckpt-dir", ckpt, "--ckpt-interval", "4", "--ckpt-kind", "consecutive")
    first = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "12"))
    old = {m.step: m.ckpt_id for m in list_manifests(ckpt)}
    assert sorted(old) == [4, 8, 12] and replacing.pending(ckpt) is None, first.stdout
    failed = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "8",
                                "--resume", "4", "--arch-embedding-size", "90000000000-50"))
    assert failed.returncode == EXIT_STARTUP_FAILED, failed.stderr
    assert "startup failed in building the model" in failed.stderr
    assert replacing.pending(ckpt) == "4" and sorted(m.step for m in list_manifests(ckpt)) == \
        [4, 8, 12]
    look = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "4", "--resume", "4"))
    assert "nothing left to train" in look.stdout and replacing.pending(ckpt) == "4", \
        look.stdout  # a run that trains nothing replaces nothing and leaves the record alone
    monkeypatch.setenv("MPICKPT_RESTART", "1")
    back = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "8",
                              "--resume", "4"))
    said = back.stdout + back.stderr
    assert back.returncode == 0 and "--resume 4: this is a relaunch (MPICKPT_RESTART=1) of a " \
        "launch that ended before it had retired the newer checkpoints it replaces" in said, said
    assert "retired the checkpoint(s) of step(s) [8, 12]" in said, said
    assert replacing.pending(ckpt) is None
    now = {m.step: m.ckpt_id for m in list_manifests(ckpt)}
    assert sorted(now) == [4, 8] and now[8] != old[8], now
    monkeypatch.setenv("MPICKPT_RESTART", "2")
    again = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "8",
                               "--resume", "4"))
    said = again.stdout + again.stderr
    assert "it resumes as relaunches do" in said and "resumed from checkpoint step 8 " in said \
        and "retired" not in said, said
    monkeypatch.setenv("MPICKPT_RESTART", "3")  # a relaunched look at step 4 looks at step 4
    look = finish(start_ranks(1, "mpickpt.train", *common, "--num-batches", "4", "--resume", "4"))
    said = look.stdout + look.stderr
    assert "trains nothing past step 4" in said and "resumed from checkpoint step 4 " in said, \
        said


def test_a_malformed_test_file_line_stops_the_job_before_training(tmp_path):
    """--raw-test-file's lines that the tests will read are checked at the start: a malformed
    one is bad input before the first step, not an error after the whole training."""
    good = "\t".join(["1"] + ["3"] * 13 + ["0a0b0c0d"] * 26)
    train, test = tmp_path / "day_0", tmp_path / "day_1"
    train.write_text("\n".join([good] * 40) + "\n")
    test.write_text("\n".join([good] * 5 + ["1\t2\t3"] + [good] * 10) + "\n")
    proc = run_ranks(2, "mpickpt.train", "--data-generation", "criteo-tsv", "--raw-data-file",
                     str(train), "--raw-test-file", str(test), "--arch-embedding-size",
                     "criteo-kaggle", "--embedding-scale-down", "100000", "--mini-batch-size",
                     "4", "--num-batches", "5", "--test-num-batches", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(rf"mpickpt-train: error: {test}, line 6: found 3 tab-separated fields",
                     proc.stderr), proc.stderr
    assert "step " not in proc.stdout, proc.stdout
