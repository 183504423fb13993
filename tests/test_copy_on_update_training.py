"""Copy-on-update snapshots in real 2-rank training jobs (`--ckpt-snapshot copy-on-update`): a
rank SIGKILLed right after a checkpoint started (its rows still pending or being copied) leaves
that checkpoint uncommitted and the previous one the newest; the relaunch resumes from it to the
uninterrupted digest. (Byte equality with stop-the-world copies under every kind:
tests/mpi/test_copy_on_update.py.)"""
from mpickpt.store.manifest import list_manifests
from tests.launch import SMALL_MODEL, digest_of, resumed_step, run_ranks

RUN = (*SMALL_MODEL, "--num-batches", "24", "--digest")


def test_a_kill_during_the_copy_keeps_the_previous_checkpoint_and_resumes_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    args = (*RUN, "--ckpt-dir", ckpt, "--ckpt-interval", "4", "--ckpt-kind", "incrcp",
            "--ckpt-snapshot", "copy-on-update")
    killed = run_ranks(2, "mpickpt.train", *args, "--inject-kill", "12:1")
    assert killed.returncode != 0 and "digest" not in killed.stdout, killed.stdout
    steps = sorted(m.step for m in list_manifests(ckpt))
    # the checkpoint being copied never commits (8's commit may still have been in flight)
    assert 12 not in steps and steps[-1] in (4, 8), steps
    resumed = run_ranks(2, "mpickpt.train", *args)
    assert resumed_step(resumed.stdout) == steps[-1], resumed.stdout
    assert digest_of(resumed) == digest_of(run_ranks(2, "mpickpt.train", *RUN))
