"""Leftovers (`store.leftovers`) on a real IncrCP checkpoint directory: what `mpickpt ls` lists and
what the next run removes, when manifests are damaged and when survivor dumps are stale.

One single-rank IncrCP run per module writes a baseline (step 4) and an increment (step 8), so
``chains/<chain>/`` exists and only those two manifests use it. Tests work on copies.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mpickpt import cli
from mpickpt.store import leftovers
from mpickpt.store.catalog import scan
from mpickpt.survivors.dump import DumpHeader, lineage, write_dump
from tests.launch import REPO, SMALL_MODEL

INCRCP = ("--ckpt-kind", "incrcp", "--incrcp-ratio", "0", "--ckpt-interval", "4")


def train(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "mpickpt.train", *SMALL_MODEL, *INCRCP, *args],
                          capture_output=True, text=True, timeout=180, env=env)


@pytest.fixture(scope="module")
def incrcp_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("leftovers") / "ckpt")
    proc = train("--num-batches", "8", "--ckpt-dir", root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root


@pytest.fixture
def copy(incrcp_dir, tmp_path) -> str:
    return shutil.copytree(incrcp_dir, str(tmp_path / "ckpt"))


def chain_dirs(root: str) -> list[str]:
    return sorted(os.listdir(os.path.join(root, "chains")))


def tree(path: str) -> dict[str, int]:
    return {os.path.relpath(os.path.join(d, n), path): os.path.getsize(os.path.join(d, n))
            for d, _, names in os.walk(path) for n in names}


def damage_manifests(root: str) -> list[str]:
    """Change one digit of the step of every manifest (each then fails its checksum)."""
    out = []
    for name in sorted(os.listdir(root)):
        if name.startswith("manifest-"):
            path = os.path.join(root, name)
            text = open(path).read()
            edited = text.replace('"step": ', '"step": 1', 1)
            assert edited != text
            with open(path, "w") as f:
                f.write(edited)
            out.append(path)
    return out


def ls(root: str, capsys) -> str:
    assert cli.main(["ls", root]) == 0
    return capsys.readouterr().out


def test_a_chain_used_only_by_damaged_manifests_is_kept(copy, capsys):
    (chain,) = chain_dirs(copy)
    before = tree(os.path.join(copy, "chains", chain))
    assert any(rel.endswith(".h5") for rel in before) and any("index-" in r for r in before)
    assert len(damage_manifests(copy)) == 2  # the only manifests that use the chain
    cat = scan(copy)
    assert cat.manifests == [] and len(cat.bad_manifests) == 2
    assert leftovers.find(copy, [], chains=False) == []
    listed = ls(copy, capsys)
    assert listed.count("unreadable manifest") == 2 and "leftover:" not in listed, listed
    proc = train("--num-batches", "3", "--ckpt-dir", copy)  # no fresh start over them
    assert proc.returncode == 2 and "every manifest there is unreadable" in proc.stderr, \
        proc.stderr[-2000:]
    assert tree(os.path.join(copy, "chains", chain)) == before
    proc = train("--num-batches", "3", "--ckpt-dir", copy, "--resume", "none")  # by choice
    assert proc.returncode == 0, proc.stderr[-2000:]  # (no checkpoint of its own)
    assert "leftovers of earlier runs" not in proc.stdout, proc.stdout
    assert tree(os.path.join(copy, "chains", chain)) == before


def test_an_unused_chain_is_listed_when_every_manifest_reads(copy, capsys):
    stray = os.path.join(copy, "chains", "chain-000000000099-deadbeef", "rank-00000")
    os.makedirs(stray)
    with open(os.path.join(stray, "col-000000000099-part-0.h5"), "wb") as f:
        f.write(b"z" * 300)
    listed = ls(copy, capsys)
    assert listed.count("leftover:") == 1, listed
    assert "chain no committed checkpoint uses" in listed and "chain-000000000099" in listed
    assert [f.path for f in leftovers.find(copy, scan(copy).manifests, chains=False)] == []


def write_survivor_dump(folder: str, step: int, line: str) -> None:
    header = DumpHeader(rank=0, world_size=1, plan_id="p", step=step, reader_state={}, pls={},
                        lineage=line)
    write_dump(folder, header, {"weight": np.arange(6, dtype=np.float32)}, durable=False)


def test_stale_survivor_dumps_are_listed_not_removed(copy, capsys):
    here = lineage(copy)
    dumps = os.path.join(copy, "survivors")
    write_survivor_dump(os.path.join(dumps, "rank-00000"), 8, here)  # as new as step 8
    write_survivor_dump(os.path.join(dumps, "rank-00001"), 9, here)  # newer: a relaunch uses it
    write_survivor_dump(os.path.join(dumps, "rank-00002"), 9, "an-earlier-job")
    write_survivor_dump(os.path.join(dumps, "rank-00003.tmp-4000000"), 9, here)  # writer gone
    write_survivor_dump(os.path.join(dumps, f"rank-00004.tmp-{os.getpid()}"), 9, here)  # writing
    listed = [line for line in ls(copy, capsys).splitlines() if "leftover:" in line]
    assert len(listed) == 3, listed
    why = {line.split("(")[-1].split(";")[0]: line for line in listed}
    assert "no newer than the newest committed checkpoint (step 8)" in why["survivors/rank-00000"]
    assert "left by an earlier job" in why["survivors/rank-00002"]
    assert "survivor dump write interrupted (process 4000000" in \
        why["survivors/rank-00003.tmp-4000000"]
    assert all("relaunch with --survivor-dumps" in line for line in listed)
    # the restore's removal (`find`) never touches survivor dumps
    assert not [f for f in leftovers.find(copy, scan(copy).manifests) if "survivors" in f.path]
