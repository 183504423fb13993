"""Files the IncrCP extractor keeps open between ingestions (`store.open_files.VerifiedFiles`):
each opened and checked once while it stays the same file, opened again when the path names a
new one, closed (its lookups and verified blocks dropped) before it goes, and all of them
forgotten after a failed ingestion."""
import os
from collections import Counter

import numpy as np
import pytest

from mpickpt.model.shard_plan import ShardPlan
from mpickpt.store import shard_file
from mpickpt.store.block_cache import BlockCache
from mpickpt.store.errors import CheckpointError
from mpickpt.store.open_files import VerifiedFiles
from mpickpt.store.shard_file import (FORMAT_VERSION, open_hdf5, read_rows, seal_attributes,
                                      write_dataset)
from tests.local_chain import LocalChain

PLAN = ShardPlan.build((300, 200, 150, 40), 2)


def _write(path, values) -> None:
    with open_hdf5(f"{path}.tmp", "w") as f:
        f.attrs["format_version"] = FORMAT_VERSION
        write_dataset(f, "x", np.asarray(values))
        seal_attributes(f)
    os.replace(f"{path}.tmp", path)


def test_a_file_stays_open_until_it_changes_or_goes(tmp_path):
    _write(tmp_path / "a.h5", np.arange(10))
    _write(tmp_path / "b.h5", np.arange(5))
    blocks = BlockCache()
    files = VerifiedFiles(str(tmp_path), limit=1, blocks=blocks)
    f, lookups = files.get("a.h5")
    lookups["x"] = f["x"]
    assert read_rows(f["x"], 0, 10, "a.h5", cache=blocks).tolist() == list(range(10))
    assert files.get("a.h5") == (f, lookups) and files.opened == 1
    _write(tmp_path / "a.h5", np.arange(10) + 100)  # a retried ingestion rewrites it
    g, fresh = files.get("a.h5")
    assert files.opened == 2 and fresh == {} and not f.id.valid
    assert not blocks.blocks  # the old file's verified blocks went with it
    assert read_rows(g["x"], 0, 10, "a.h5", cache=blocks)[0] == 100
    files.get("b.h5")
    assert g.id.valid  # nothing is closed during a visit...
    files.trim()  # ...only between visits: past the limit of 1, the least recently used goes
    assert list(files.entries) == ["b.h5"] and not g.id.valid and not blocks.blocks
    files.keep_only({"a.h5"})
    assert not files.entries
    with pytest.raises(CheckpointError, match="missing"):
        files.get("gone.h5")
    with pytest.raises(ValueError, match="limit"):
        VerifiedFiles(str(tmp_path), limit=-1)


def test_the_extractor_opens_each_chunk_file_once_across_ingestions(tmp_path, monkeypatch):
    opens = Counter()
    real = shard_file.open_shard
    monkeypatch.setattr(shard_file, "open_shard", lambda path, *a, **k: opens.update(
        [path]) or real(path, *a, **k))
    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy="incrcp", seed=4, incrcp_reset="never")
    rng = np.random.default_rng(4)
    expected = {}
    for step in range(1, 9):
        for r in range(PLAN.world_size):
            chain.touch(r, np.concatenate([np.arange(20), rng.integers(0, 60, 25)]), rng)
        chain.save(step)
        expected[step] = chain.snapshot()
    extractor = chain.extractors[0]
    kept = set(extractor.opened.entries)
    assert len(kept) >= 2 and any("bundle-" in f for f in kept)  # older chunks' files stay open
    visited = {p: n for p, n in opens.items() if "/rank-00000/" in p}
    assert visited and max(visited.values()) == 1, visited  # each opened once over 7 ingestions
    for step, state in expected.items():  # and what they extracted restores every step exactly
        got, _ = chain.restore(step)
        for g, e in zip(got, state):
            for name in e:
                assert np.array_equal(g[name], e[name]), (step, name)


def test_a_failed_ingestion_forgets_the_files_it_kept(tmp_path, monkeypatch):
    from mpickpt.incrcp import extraction

    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy="incrcp", seed=5, incrcp_reset="never")
    rng = np.random.default_rng(5)
    for step in range(1, 6):
        for r in range(PLAN.world_size):
            chain.touch(r, np.concatenate([np.arange(20), rng.integers(0, 60, 25)]), rng)
        if step == 5:
            assert chain.extractors[0].opened.entries

            def boom(*args):
                raise OSError(5, "injected commit failure")

            monkeypatch.setattr(extraction, "commit_index", boom)
            with pytest.raises(OSError, match="injected"):
                chain.save(step)
        else:
            chain.save(step)
    extractor = chain.extractors[0]
    assert not extractor.opened.entries and not extractor.blocks.blocks
