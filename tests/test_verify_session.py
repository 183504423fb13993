"""`mpickpt verify DIR` opens and checksums each file once, however many checkpoints share it: a
consecutive chain of 10 retained checkpoints lists its baseline (and each earlier increment) as a
layer of every later one. Opens are counted at `h5py.File`, below every mpickpt helper."""
import os
import subprocess
import sys

import h5py
import pytest

from mpickpt import cli
from mpickpt.checkpoint import verify_session
from mpickpt.store.manifest import list_manifests
from tests.launch import REPO, SMALL_MODEL


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("chain") / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "mpickpt.train", *SMALL_MODEL, "--num-batches",
                           "10", "--ckpt-dir", str(root), "--ckpt-interval", "1", "--ckpt-keep",
                           "10", "--ckpt-kind", "consecutive"], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return str(root)


def test_each_file_is_opened_once(chain, monkeypatch, capsys):
    manifests = list_manifests(chain)
    assert len(manifests) == 10 and manifests[-1].parents  # a chain: layers are shared
    uses = sum(len(m.parents) + 1 for m in manifests)
    opened: list[str] = []
    real = h5py.File

    def counting(name, *args, **kwargs):
        opened.append(os.path.abspath(str(name)))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(h5py, "File", counting)
    read: list[str] = []
    real_crc = verify_session.file_crc32

    def counting_crc(path, *args, **kwargs):
        read.append(os.path.abspath(path))
        return real_crc(path, *args, **kwargs)

    monkeypatch.setattr(verify_session, "file_crc32", counting_crc)
    assert cli.main(["verify", chain]) == 0
    out = capsys.readouterr().out
    files = {os.path.abspath(os.path.join(chain, rel)) for m in manifests for rel in m.files}
    assert sorted(read) == sorted(files)  # every file's bytes read exactly once
    assert set(opened) <= files and opened  # the shards, for structure and coverage
    assert len(opened) == len(set(opened)), sorted(p for p in opened if opened.count(p) > 1)[:5]
    assert uses > 3 * len(manifests)  # without sharing, verify would open far more
    assert "10 checkpoint(s) checked, 0 with problems" in out and " s in all (" in out, out
    assert f"checksums of {len(files)} files" in out, out  # each file's bytes checked once


def test_jobs_give_the_same_verdict(chain, capsys):
    assert cli.main(["verify", chain, "--jobs", "2"]) == 0
    assert "0 with problems" in capsys.readouterr().out
    damaged = os.path.join(chain, list_manifests(chain)[0].shard_files()[0])
    with h5py.File(damaged, "r") as f:  # a byte inside the first table's weights
        offset = f["rows/weight"].id.get_offset()
    with open(damaged, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cli.main(["verify", chain, "--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert os.path.basename(damaged) in out and "checksum" in out, out


def test_bad_jobs_value_is_refused(chain, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", chain, "--jobs", "0"])
    assert e.value.code == 2 and "--jobs" in capsys.readouterr().err
