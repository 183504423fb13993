"""The `mpickpt` command-line tool on a real checkpoint directory (serial tests; the CLI uses no MPI).

One 2-rank training run per module writes checkpoints at steps 10 and 20; tests that damage files
work on copies of it.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpickpt.cli import main
from tests.damage import edit_reader_position
from tests.launch import REPO, run_ranks

SIZES = [300, 200, 100, 50]
DIM = 8
TRAIN_FLAGS = ("--arch-embedding-size", "-".join(map(str, SIZES)),
               "--arch-sparse-feature-size", str(DIM), "--arch-mlp-bot", "13-16-8",
               "--arch-mlp-top", "16-1", "--mini-batch-size", "32", "--test-num-batches", "0",
               "--print-freq", "0", "--num-batches", "20", "--ckpt-interval", "10",
               "--ckpt-keep", "3")
OFFSETS = np.concatenate([[0], np.cumsum(SIZES)])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("cli") / "ckpt")
    proc = run_ranks(2, "mpickpt.train", *TRAIN_FLAGS, "--ckpt-dir", root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


@pytest.fixture
def copy(ckpt, tmp_path) -> str:
    """A private copy of the checkpoint directory, free to damage."""
    return shutil.copytree(ckpt, str(tmp_path / "copy"))


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "mpickpt.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def step_dir(root: str, step: int) -> str:
    (path,) = glob.glob(os.path.join(root, f"step-{step:012d}-*"))
    return path


def shard_files(root: str, step: int) -> list[str]:
    return sorted(glob.glob(os.path.join(step_dir(root, step), "rank-*.h5")))


def flip_weight_byte(path: str) -> str:
    """Flip one byte inside the data of the first `weight` dataset of `path`; returns its name."""
    with h5py.File(path, "r") as f:
        name = "rows/weight"
        ds = f[name]
        offset = ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + 13)
        byte = f.read(1)
        f.seek(offset + 13)
        f.write(bytes([byte[0] ^ 0xFF]))
    return name


def ls_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    assert lines[0].split()[:3] == ["STEP", "KIND", "RANKS"]
    return [line.split(None, 5) for line in lines[1:]]


# ---------------------------------------------------------------------------------------- ls

def test_ls_lists_committed_steps_and_torn_directory(copy):
    os.mkdir(os.path.join(copy, "step-000000000030-deadbeef"))
    proc = cli("ls", copy)
    assert proc.returncode == 0, proc.stderr
    rows = {int(r[0]): r for r in ls_rows(proc.stdout)}
    assert sorted(rows) == [10, 20, 30]
    for step in (10, 20):
        _, kind, ranks, files, size_mb, status = rows[step]
        assert (kind, ranks, files, status) == ("full", "2", "3", "committed")
        assert float(size_mb) > 0
    assert rows[30][5] == "torn (no manifest)"


def test_unreadable_manifest_is_listed_and_fails_verify(copy):
    with open(os.path.join(copy, "manifest-000000000005.json"), "w") as f:
        f.write('{"step": 5')
    assert ls_rows(cli("ls", copy).stdout)[0] == ["5", "-", "-", "0", "0.00", "unreadable manifest"]
    proc = cli("verify", copy)
    assert proc.returncode == 1 and "manifest-000000000005.json: not a valid" in proc.stdout
    assert cli("verify", copy, "--step", "20").returncode == 0


def test_ls_reports_missing_file_as_damaged(copy):
    victim = shard_files(copy, 10)[1]
    os.remove(victim)
    rows = {int(r[0]): r for r in ls_rows(cli("ls", copy).stdout)}
    assert rows[10][5].startswith("damaged (missing: ")
    assert os.path.basename(victim) in rows[10][5]
    assert rows[20][5] == "committed"


# ----------------------------------------------------------------------------------- inspect

def test_inspect_text_shows_the_newest_checkpoint(ckpt):
    proc = cli("inspect", ckpt)
    assert proc.returncode == 0, proc.stderr
    fields = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in proc.stdout.splitlines()
              if line and not line.startswith(" ") and len(line.split(None, 1)) == 2}
    assert fields["step"] == "20"
    assert "world size   2" in proc.stdout
    assert fields["dim"] == str(DIM)
    assert "300, 200, 100, 50" in fields["tables"]
    assert "param/bottom.0.weight  (16, 13)  float32" in proc.stdout


def test_inspect_json_parses_and_counts_rows(ckpt):
    proc = cli("inspect", ckpt, "--step", "10", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert (info["step"], info["world_size"], info["dim"]) == (10, 2, DIM)
    assert info["table_sizes"] == SIZES and info["total_rows"] == sum(SIZES)
    assert [t["rows_found"] for t in info["tables"]] == SIZES
    assert sum(v["rows"] for v in info["layout"].values()) == sum(SIZES)
    assert len(info["files"]) == 3 and all(f["state"] == "ok" for f in info["files"])
    dense = {d["name"]: d["shape"] for d in info["dense"]}
    assert dense["param/bottom.0.weight"] == [16, 13] and dense["param/bottom.2.weight"] == [8, 16]
    assert info["errors"] == [] and info["status"] == "committed"


def test_inspect_names_a_file_of_another_checkpoint_of_the_same_size(copy):
    """Step 10's rank-1 shard copied over step 20's: the sizes agree, its attributes name step
    10; inspect says so and exits 1 (it showed the file 'ok', exit 0)."""
    ours = shard_files(copy, 20)[1]
    shutil.copyfile(shard_files(copy, 10)[1], ours)
    proc = cli("inspect", copy, "--step", "20", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    info = json.loads(proc.stdout)
    said = f"{ours}: attribute step=10, the manifest of step 20 says 20"
    assert [f["state"] for f in info["files"] if ours.endswith(f["path"])] == \
        ["another checkpoint's file"]
    assert info["status"].startswith(f"damaged ({said}") and info["errors"][0].startswith(said)
    assert len(info["errors"]) == len(set(info["errors"]))  # each said once


# ------------------------------------------------------------------------------------ verify

def test_verify_pristine_directory(ckpt):
    proc = cli("verify", ckpt)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 10: OK" in proc.stdout and "step 20: OK" in proc.stdout


def test_verify_finds_flipped_byte_in_weight(copy):
    victim = shard_files(copy, 20)[0]
    dataset = flip_weight_byte(victim)
    proc = cli("verify", copy)
    assert proc.returncode == 1, proc.stdout
    bad = [line for line in proc.stdout.splitlines() if line.startswith("step 20: ")]
    assert any(victim in line and dataset in line and "checksum" in line for line in bad), bad
    assert "step 10: OK" in proc.stdout
    assert cli("verify", copy, "--step", "10").returncode == 0


def test_verify_finds_truncated_shard_file(copy):
    victim = shard_files(copy, 20)[1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    proc = cli("verify", copy)
    assert proc.returncode == 1
    assert any(line.startswith("step 20: ") and victim in line and "truncated" in line
               for line in proc.stdout.splitlines()), proc.stdout
    ok = cli("verify", copy, "--step", "10")
    assert ok.returncode == 0 and "step 10: OK" in ok.stdout


def test_verify_finds_deleted_shard_file_and_warns_on_torn(copy):
    victim = shard_files(copy, 10)[0]
    os.remove(victim)
    os.mkdir(os.path.join(copy, "step-000000000030-deadbeef"))
    proc = cli("verify", copy)
    assert proc.returncode == 1
    assert f"step 10: {victim}: file of checkpoint step 10 is missing" in proc.stdout
    assert "step 20: OK" in proc.stdout
    assert "warning:" in proc.stdout and "step-000000000030-deadbeef" in proc.stdout
    shutil.rmtree(step_dir(copy, 10))
    os.remove(os.path.join(copy, "manifest-000000000010.json"))
    # a torn directory alone is only a warning
    assert cli("verify", copy).returncode == 0


# ------------------------------------------------------------------------------------ export

def assemble_from_shards(root: str, step: int, name: str = "weight") -> list[np.ndarray]:
    """Each table's rows of `name`, read straight from the shard files by global id."""
    tables = [None] * len(SIZES)
    for path in shard_files(root, step):
        with h5py.File(path, "r") as f:
            group = f["rows"]
            for t, a, b, _, _ in group.attrs["tables"]:
                data = group[name][a:b]
                if tables[t] is None:
                    tables[t] = np.full((SIZES[t], *data.shape[1:]), np.nan, dtype=data.dtype)
                tables[t][group["gids"][a:b] - OFFSETS[t]] = data
    return tables


def test_export_assembles_the_model(ckpt, tmp_path):
    from mpickpt.model.embedding import init_rows

    out = str(tmp_path / "model.h5")
    proc = cli("export", ckpt, "-o", out, "--with-optimizer")
    assert proc.returncode == 0, proc.stderr
    expected = assemble_from_shards(ckpt, 20)
    sums = assemble_from_shards(ckpt, 20, "state/adagrad_sum")
    with h5py.File(out, "r") as f:
        assert (f.attrs["step"], f.attrs["dim"], f.attrs["optimizer"]) == (20, DIM, "adagrad")
        assert list(f.attrs["table_sizes"]) == SIZES
        for t, size in enumerate(SIZES):
            weight = f[f"embeddings/table_{t}"][:]
            assert weight.shape == (size, DIM) and weight.dtype == np.float32
            np.testing.assert_array_equal(weight, expected[t])
            np.testing.assert_array_equal(f[f"optimizer/table_{t}/adagrad_sum"][:], sums[t])
        gids = np.arange(SIZES[0])
        init = init_rows(0, gids, np.full(SIZES[0], SIZES[0]), DIM)
        weight, untouched = f["embeddings/table_0"][:], sums[0] == 0
        # rows training never touched (zero Adagrad sum) still hold their initial values
        np.testing.assert_array_equal((weight == init).all(axis=1), untouched)
        assert untouched.mean() > 0.3
        assert f["dense/bottom.0.weight"].shape == (16, 13)
        assert f["dense/bottom.0.bias"].shape == (16,)
        assert f["dense/bottom.2.weight"].shape == (8, 16)
        assert f["dense/top.0.weight"].shape == (16, 4 * 5 // 2 + DIM)  # pairs of 5 vectors + dense
        with h5py.File(os.path.join(step_dir(ckpt, 20), "dense.h5"), "r") as d:
            pack, params = d["dense/packed"][:], 0
            for name, dtype, shape, offset in json.loads(d["dense"].attrs["arrays"]):
                if name.startswith("param/"):
                    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
                    stored = pack[offset:offset + n].view(dtype).reshape(shape)
                    np.testing.assert_array_equal(f[f"dense/{name[6:]}"][()], stored)
                    params += 1
            assert params >= 4


def test_export_older_step_without_optimizer(ckpt, tmp_path):
    out = str(tmp_path / "m10.h5")
    assert cli("export", ckpt, "--step", "10", "-o", out).returncode == 0
    expected = assemble_from_shards(ckpt, 10)
    with h5py.File(out, "r") as f:
        assert f.attrs["step"] == 10 and "optimizer" not in f
        for t in range(len(SIZES)):
            np.testing.assert_array_equal(f[f"embeddings/table_{t}"][:], expected[t])


def test_export_of_corrupted_checkpoint_fails_without_output(copy, tmp_path):
    victim = shard_files(copy, 20)[1]
    flip_weight_byte(victim)
    out = tmp_path / "out" / "model.h5"
    out.parent.mkdir()
    proc = cli("export", copy, "--step", "20", "-o", str(out))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"mpickpt: error: {victim}: ") and "weight" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert os.listdir(out.parent) == []


def test_an_export_into_the_checkpoint_directory_is_refused(copy):
    """-o naming a file of the checkpoint (its manifest, a shard) or any place under its root
    is bad input: nothing is written, the checkpoint stays whole."""
    manifest = os.path.join(copy, "manifest-000000000020.json")
    before = open(manifest, "rb").read()
    for out in (manifest, shard_files(copy, 10)[0], os.path.join(copy, "model.h5")):
        proc = cli("export", copy, "-o", out)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr == f"mpickpt: error: {out}: cannot write the export there (it is " \
                              f"inside the checkpoint directory {copy}: export elsewhere)\n"
    assert open(manifest, "rb").read() == before and cli("verify", copy).returncode == 0


def test_an_export_that_cannot_be_written_names_its_output(ckpt, small_tmpfs):
    """Too little room, or a read-only folder: one error line naming the output, before
    anything is written (HDF5 would fail a full disk only as it closes the file)."""
    out = small_tmpfs / "model.h5"
    free = os.statvfs(small_tmpfs)
    with open(small_tmpfs / "filler", "wb") as f:
        f.write(bytes(free.f_bavail * free.f_frsize - (512 << 10)))
    full = cli("export", ckpt, "-o", str(out))
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr
    assert full.stderr.startswith(f"mpickpt: error: {out}: no room for the export: it needs "
                                  f"about 1.1 MB, and 0.5 MB are free there"), full.stderr
    assert full.stderr.count("\n") == 1 and os.listdir(small_tmpfs) == ["filler"]
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    proc = cli("export", ckpt, "-o", str(out))
    assert proc.returncode == 2 and proc.stderr == (
        f"mpickpt: error: {out}: cannot write the export there (its folder is not writable "
        f"(read-only?))\n"), proc.stderr


# ------------------------------------------------------------------------- damaged manifests

def test_a_chosen_step_with_a_damaged_manifest_is_an_error_naming_it(copy, tmp_path, capsys):
    path = edit_reader_position(copy, 20)
    out = str(tmp_path / "x.h5")
    for args in (["inspect", copy], ["export", copy, "-o", out]):
        assert main([*args, "--step", "20"]) == 1, args
        err = capsys.readouterr().err
        assert err.startswith(f"mpickpt: error: checkpoint step 20 cannot be used: {path}: ")
        assert "fails its checksum" in err and "no committed checkpoint" not in err, err
    assert not os.path.exists(out)
    assert main(["verify", copy, "--step", "20"]) == 1
    said = capsys.readouterr().out
    assert f"error: {path}: not a valid mpickpt manifest: content fails its checksum" in said
    assert "1 checkpoint(s) checked, 1 with problems" in said and "step 10" not in said


def test_a_manifest_of_other_fields_is_named_without_internals_or_warnings(tmp_path, recwarn):
    from mpickpt.store.manifest import list_manifests, load_manifest

    cases = {10: ("{}", r"no step, kind, ckpt_id, .*, reader_state$"),
             11: ('{"step": 11, "extra": 1}', r"no kind, .*; unknown fields extra$"),
             12: ("[1]", r"expected a JSON object, found list$")}
    for step, (text, said) in cases.items():
        path = tmp_path / f"manifest-{step:012d}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"^{path}: not a valid mpickpt manifest: {said}"):
            load_manifest(str(path))
    damaged = []
    assert list_manifests(str(tmp_path)) == [] == list_manifests(str(tmp_path), damaged)
    assert sorted(step for step, _ in damaged) == [10, 11, 12]
    assert "__init__" not in repr(damaged) and len(recwarn) == 0  # skipped in silence


def test_inspect_and_export_say_they_skip_a_damaged_newest_manifest(copy, tmp_path, capsys):
    path = edit_reader_position(copy, 20)
    assert main(["inspect", copy, "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["step"] == 10
    assert got.err.startswith(f"mpickpt: note: skipped checkpoint step 20: {path}: ")
    assert "fails its checksum" in got.err and got.err.rstrip().endswith("using step 10")
    out = str(tmp_path / "m.h5")
    assert main(["export", copy, "-o", out]) == 0
    got = capsys.readouterr()
    assert got.out.startswith("exported step 10") and f"skipped checkpoint step 20: {path}" in got.err
    os.remove(os.path.join(copy, "manifest-000000000010.json"))  # the only readable one
    assert main(["inspect", copy]) == 1
    err = capsys.readouterr().err
    assert "no readable manifest" in err and path in err


# --------------------------------------------------------------------------------- bad args

def test_missing_directory_is_a_usage_error(tmp_path):
    missing = str(tmp_path / "nowhere")
    for args in (["ls", missing], ["inspect", missing], ["verify", missing],
                 ["export", missing, "-o", str(tmp_path / "x.h5")]):
        proc = cli(*args)
        assert proc.returncode == 2, args
        assert proc.stderr.startswith("mpickpt: error: ") and missing in proc.stderr
        assert "Traceback" not in proc.stderr


def test_unknown_step_lists_committed_steps(ckpt, tmp_path):
    for args in (["inspect", ckpt], ["verify", ckpt], ["export", ckpt, "-o", str(tmp_path / "x")]):
        proc = cli(*args, "--step", "999")
        assert proc.returncode == 2
        assert "step 999" in proc.stderr and "committed steps: 10, 20" in proc.stderr
    assert not os.path.exists(tmp_path / "x")


def test_cli_imports_neither_mpi4py_nor_torch(ckpt):
    code = ("import sys; from mpickpt.cli import main; rc = main(['verify', sys.argv[1]]); "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'torch')]; "
            "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, ckpt], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------ leftovers
def test_leftovers_of_killed_jobs_are_listed_then_removed_by_the_next_run(copy):
    dead = 4_000_000  # above the default pid_max: no process of that id exists
    junk = {os.path.join(copy, f".manifest-000000000030.json.tmp-{dead}"): b"{",
            os.path.join(copy, f".mpickpt-replacing.tmp-{dead}"): b"{",
            os.path.join(step_dir(copy, 20), "rank-00001-part-0.h5.tmp"): b"x" * 1000,
            os.path.join(step_dir(copy, 20), "rank-00001-part-0.h5.reserve"): b"",
            os.path.join(copy, "chains", "c0ffee", "rank-00000", "col-30-part-0.h5"): b"y" * 500}
    for path, data in junk.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    live = os.path.join(copy, f".manifest-000000000040.json.tmp-{os.getpid()}")  # still writing
    open(live, "w").close()
    listed = cli("ls", copy).stdout
    assert listed.count("leftover:") == 5, listed
    assert "a record of a chosen start interrupted" in listed
    assert "manifest write interrupted" in listed and "chain no committed checkpoint uses" in listed
    assert os.path.basename(live) not in listed
    proc = run_ranks(2, "mpickpt.train", *TRAIN_FLAGS[:-6], "--num-batches", "21",
                     "--ckpt-interval", "10", "--ckpt-dir", copy)
    assert proc.returncode == 0, proc.stderr
    assert "removed 5 leftovers of earlier runs (0.0 MB)" in proc.stdout, proc.stdout
    assert not any(os.path.exists(p) for p in junk)
    assert not os.path.exists(os.path.join(copy, "chains", "c0ffee"))
    assert os.path.exists(live)
    assert "leftover:" not in cli("ls", copy).stdout.replace(os.path.basename(live), "")


def test_an_increment_whose_parent_another_run_rewrote_is_refused():
    """Every run starts its chains with a baseline of its own, so a parent of another run (its
    step rewritten by a later run) would layer the increment's rows on another model."""
    from types import SimpleNamespace

    from mpickpt.store.errors import CheckpointError
    from mpickpt.store.manifest import parent_manifests

    def manifest(step, attempt, parents=()):
        return SimpleNamespace(step=step, kind="consecutive" if parents else "full",
                               ckpt_id=f"step-{step:012d}-{attempt}", parents=list(parents))

    child = manifest(12, "aaaa", [4, 8])
    ours = {4: manifest(4, "aaaa"), 8: manifest(8, "aaaa", [4])}
    assert parent_manifests(child, ours) == [ours[4], ours[8]]
    with pytest.raises(CheckpointError, match=r"^checkpoint step 12 \(consecutive\) needs step 8 "
                                              r"of its own run \(aaaa\), but step 8 was rewritten "
                                              r"by another run \(bbbb\)"):
        parent_manifests(child, {**ours, 8: manifest(8, "bbbb")})


def test_retiring_the_checkpoints_past_a_chosen_start(tmp_path):
    """retire_after: readable manifests past the start go, newest first, then the directories
    (and chains) no remaining manifest needs; an unreadable manifest past it stays, reported as
    before; nothing at or before the start changes."""
    from mpickpt.store.manifest import (Manifest, list_manifests, manifest_path, remove_folders,
                                        retire_after, write_manifest)

    def commit(step, attempt, chain=""):
        ckpt_id = f"step-{step:012d}-{attempt}"
        os.makedirs(tmp_path / ckpt_id)
        files = {f"{ckpt_id}/dense.h5": {"role": "dense"}}
        if chain:
            os.makedirs(tmp_path / "chains" / chain, exist_ok=True)
        write_manifest(str(tmp_path), Manifest(step=step, kind="full", ckpt_id=ckpt_id,
                                               world_size=1, dim=4, plan={}, optimizer="sgd",
                                               files=files, reader_state={}, chain=chain))

    commit(10, "aaaa", "c1")
    commit(20, "aaaa", "c1")
    commit(30, "aaaa", "c2")
    commit(40, "aaaa")
    with open(manifest_path(str(tmp_path), 50), "w") as f:
        f.write("{damaged")
    assert retire_after(str(tmp_path), 20) == ([30, 40], [], [
        "step-000000000030-aaaa", "step-000000000040-aaaa"])  # chains kept: 50 is unreadable
    assert [m.step for m in list_manifests(str(tmp_path))] == [10, 20]
    remove_folders(str(tmp_path), ["step-000000000030-aaaa", "step-000000000040-aaaa",
                                   "chains/c2", "step-000000000099-gone"])
    assert sorted(os.listdir(tmp_path)) == ["chains", "manifest-000000000010.json",
                                            "manifest-000000000020.json",
                                            "manifest-000000000050.json",
                                            "step-000000000010-aaaa", "step-000000000020-aaaa"]
    assert os.listdir(tmp_path / "chains") == ["c1"]  # still needed by steps 10 and 20
    assert retire_after(str(tmp_path), 20) == ([], [], [])
    os.remove(manifest_path(str(tmp_path), 50))
    # chains/c1 still needed by step 10
    assert retire_after(str(tmp_path), 10) == ([20], [], ["step-000000000020-aaaa"])
    assert retire_after(str(tmp_path), 0) == ([10], [], ["chains/c1", "step-000000000010-aaaa"])


def test_a_chosen_resume_applies_to_the_first_launch_only():
    """A relaunch of the same command (mpickpt-run's restarts, a requeued Slurm job) resumes
    the newest checkpoint: going back to the chosen step again would drop what it trained."""
    from mpickpt.engine.config import CheckpointConfig

    chosen = CheckpointConfig(directory="/tmp/x", resume="400")
    assert chosen.resume_in_force({}) == ("400", None)
    assert chosen.resume_in_force({"MPICKPT_RESTART": "0", "SLURM_RESTART_COUNT": "0"}) == \
        ("400", None)
    assert chosen.resume_in_force({"MPICKPT_RESTART": "2"}) == (
        "latest", "--resume 400 applies to the job's first launch; this is a relaunch "
                  "(MPICKPT_RESTART=2): it resumes as relaunches do")
    none = CheckpointConfig(directory="/tmp/x", resume="none")
    assert none.resume_in_force({"SLURM_RESTART_COUNT": "1"})[0] == "latest"
    assert CheckpointConfig(directory="/tmp/x").resume_in_force({"MPICKPT_RESTART": "3"}) == \
        ("latest", None)
    # a run that trains nothing past its chosen step (a digest of it) replaces nothing
    assert chosen.resume_in_force({"MPICKPT_RESTART": "1"}, train_until=400) == (
        "400", "--resume 400: this is a relaunch (MPICKPT_RESTART=1) of a run that trains "
               "nothing past step 400 (its last step is 400): it starts there again")
    assert chosen.resume_in_force({"MPICKPT_RESTART": "1"}, train_until=401)[0] == "latest"
    assert none.resume_in_force({"MPICKPT_RESTART": "1"}, train_until=0)[0] == "latest"


def test_a_relaunch_reads_whether_its_first_launch_carried_its_chosen_start_out(tmp_path):
    """`store.replacing`: a record of the same --resume makes the relaunch start there again;
    another value, or none, resumes as relaunches do; a damaged record says so and resumes as
    relaunches do; `end` removes it, and twice is fine."""
    from mpickpt.engine.config import CheckpointConfig
    from mpickpt.store import replacing
    from mpickpt.store.sealed_json import DamagedRecord

    root, again = str(tmp_path), {"MPICKPT_RESTART": "1"}
    chosen = CheckpointConfig(directory=root, resume="400")
    assert replacing.pending(root) is None and chosen.resume_in_force(again)[0] == "latest"
    replacing.begin(root, "400", 400)
    assert replacing.pending(root) == "400" and os.listdir(root) == [replacing.NAME]
    resume, note = chosen.resume_in_force(again)
    assert resume == "400" and note.startswith("--resume 400: this is a relaunch "
                                               "(MPICKPT_RESTART=1) of a launch that ended "), note
    assert chosen.resume_in_force({}) == ("400", None)  # a first launch: its own flag
    assert CheckpointConfig(directory=root, resume="7").resume_in_force(again)[0] == "latest"
    replacing.end(root)
    replacing.end(root)
    assert os.listdir(root) == []
    with open(replacing.path_of(root), "w") as f:
        f.write('{"resume": "400"}')
    with pytest.raises(DamagedRecord, match=r"\.mpickpt-replacing: no checksum"):
        replacing.pending(root)
    resume, note = chosen.resume_in_force(again)
    assert resume == "latest" and "is unreadable" in note and replacing.NAME in note, note
    listed = cli("ls", root).stdout
    assert listed.splitlines()[-1].startswith(f"note: {replacing.path_of(root)}: unreadable ("), \
        listed
    replacing.begin(root, "400", 400)
    assert cli("ls", root).stdout.splitlines()[-1] == (
        f"note: a launch with --resume 400 ended before it had retired the checkpoints past its "
        f"start ({replacing.path_of(root)}): a relaunch of the same command starts there again "
        f"and retires them")


def test_a_first_launch_records_its_chosen_start_before_its_slow_start_up(tmp_path):
    """`replacing.settle` (rank 0, flags agreed): recorded where the chosen step is
    committed (its manifest named, readable or not) under newer ones and the run trains past
    it; 'none' under any; not for 'latest', a missing step, nothing newer, or a run that
    trains nothing (which leaves a record as it is, where a launch that replaces nothing
    removes a stale one); a launch resuming the newest removes any record, damaged or not,
    where it trains past the newest (a look at the newest leaves it)."""
    from mpickpt.store import replacing
    from mpickpt.store.manifest import manifest_path

    root = str(tmp_path)
    for step in (4, 8):
        with open(manifest_path(root, step), "w") as f:
            f.write("{damaged")  # only the names count here
    for resume, until in (("latest", 100), ("5", 100), ("8", 100), ("4", 4)):
        assert replacing.settle(root, resume, until) is None
        assert replacing.pending(root) is None, (resume, until)
    assert replacing.settle(root, "4", 5) is None and replacing.pending(root) == "4"
    assert replacing.settle(root, "4", 4) is None and replacing.pending(root) == "4"  # left
    assert replacing.settle(root, "5", 100) is None and replacing.pending(root) is None  # stale
    assert replacing.settle(root, "none", 1) is None and replacing.pending(root) == "none"
    assert replacing.settle(root, "latest", 8) is None and replacing.pending(root) == "none"
    assert replacing.settle(root, "latest", 100) is None and replacing.pending(root) is None
    with open(replacing.path_of(root), "w") as f:
        f.write("garbage")  # a damaged record: a job resuming the newest removes it too
    assert replacing.settle(root, "latest", 100) is None
    assert not os.path.exists(replacing.path_of(root))
    os.mkdir(replacing.path_of(root))  # the record cannot replace a folder: a warning, no error
    assert replacing.settle(root, "latest", 9).startswith(
        f"could not remove {replacing.path_of(root)} (")
    assert replacing.settle(root, "none", 9).startswith(
        f"could not write {replacing.path_of(root)} (")


def test_only_directories_named_as_checkpoints_are_taken_for_torn_ones(tmp_path):
    """A checkpoint's directory is `step-<12 digits>-<8 hex digits>` (`file_spec.checkpoint_id`);
    a user's folder that merely starts with "step-" is never removed as torn."""
    from mpickpt.store.manifest import torn_dirs

    for name in ("step-000000000030-deadbeef", "step-000000000007-zzz", "step-7-deadbeef",
                 "step-000000000040-DEADBEEF", "step-000000000050-deadbeef.old"):
        os.mkdir(tmp_path / name)
    (tmp_path / "step-000000000060-cafef00d").write_text("a file, not a folder")
    assert torn_dirs(str(tmp_path), []) == ["step-000000000030-deadbeef"]
