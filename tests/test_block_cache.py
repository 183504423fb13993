"""A reader's BlockCache returns exactly what read_rows returns, reads and checks each block once,
still refuses damaged blocks, hands out read-only rows and stays within its byte limit."""
import numpy as np
import pytest

from mpickpt.store import h5_lowlevel
from mpickpt.store.block_cache import BlockCache
from mpickpt.store.errors import CheckpointCorruptError
from mpickpt.store.shard_file import BLOCK_ROWS, open_hdf5, read_rows, write_dataset

ROWS = 3 * BLOCK_ROWS + 123


@pytest.fixture
def shard(tmp_path):
    path = str(tmp_path / "s.h5")
    data = np.arange(ROWS * 2, dtype=np.int32).reshape(ROWS, 2)
    with open_hdf5(path, "w") as f:
        write_dataset(f.require_group("rows"), "x", data)
    return path, data


def test_cached_rows_equal_read_rows_and_each_block_is_read_once(shard):
    path, data = shard
    rng = np.random.default_rng(0)
    cache = BlockCache()
    with open_hdf5(path) as f:
        ds = f["rows/x"]
        for _ in range(60):
            a = int(rng.integers(0, ROWS))
            b = int(min(ROWS, a + rng.integers(0, 2 * BLOCK_ROWS)))
            got = cache.rows(ds, a, b, path)
            np.testing.assert_array_equal(got, read_rows(ds, a, b, path))
            np.testing.assert_array_equal(got, data[a:b])
            np.testing.assert_array_equal(read_rows(ds, a, b, path, cache=cache), data[a:b])
        assert cache.misses == 4 and cache.hits > 60  # 4 blocks, each read and checked once
        with pytest.raises(ValueError, match="read-only"):
            cache.rows(ds, 5, 9, path)[0, 0] = 1


def test_a_damaged_block_is_refused_through_the_cache(shard):
    path, data = shard
    _flip_a_bit_of_block_1(path, data)
    cache = BlockCache()
    with open_hdf5(path) as f:
        ds = f["rows/x"]
        np.testing.assert_array_equal(cache.rows(ds, 0, 10, path), data[:10])
        with pytest.raises(CheckpointCorruptError, match=f"{path}.*fails its checksum"):
            cache.rows(ds, BLOCK_ROWS + 5, BLOCK_ROWS + 9, path)


def _flip_a_bit_of_block_1(path, data):
    with open_hdf5(path) as f:
        offset = f["rows/x"].id.get_offset() + BLOCK_ROWS * data[0].nbytes + 17
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("a,b,direct", [(0, ROWS, True), (BLOCK_ROWS, 3 * BLOCK_ROWS, True),
                                        (3 * BLOCK_ROWS, ROWS, True), (5, 2 * BLOCK_ROWS, False),
                                        (BLOCK_ROWS, BLOCK_ROWS + 9, False)])
def test_rows_read_into_their_destination(shard, a, b, direct, monkeypatch):
    """Whole blocks are read straight into the destination; other ranges and other dtypes are
    copied (and cast) into it; a damaged block is refused either way."""
    path, data = shard
    into = []
    slab = h5_lowlevel.read_slab
    monkeypatch.setattr(h5_lowlevel, "read_slab",
                        lambda ds, lo, hi, out=None: into.append(out is not None) or
                        slab(ds, lo, hi, out))
    with open_hdf5(path) as f:
        out = np.full((b - a, 2), -1, dtype=np.int32)
        got = read_rows(f["rows/x"], a, b, path, out=out)
        assert got is out or np.shares_memory(got, out)
        assert into[0] == direct
        np.testing.assert_array_equal(out, data[a:b])
        wide = np.zeros((b - a, 2), dtype=np.float64)
        np.testing.assert_array_equal(read_rows(f["rows/x"], a, b, path, out=wide), data[a:b])
    _flip_a_bit_of_block_1(path, data)
    with open_hdf5(path) as f:
        out = np.empty((b - a, 2), dtype=np.int32)
        if a < 2 * BLOCK_ROWS and b > BLOCK_ROWS:
            with pytest.raises(CheckpointCorruptError, match="fails its checksum"):
                read_rows(f["rows/x"], a, b, path, out=out)
        else:
            np.testing.assert_array_equal(read_rows(f["rows/x"], a, b, path, out=out), data[a:b])


def test_the_cache_keeps_within_its_limit(shard):
    path, _ = shard
    block_bytes = BLOCK_ROWS * 2 * 4
    cache = BlockCache(limit_bytes=2 * block_bytes)
    with open_hdf5(path) as f:
        ds = f["rows/x"]
        for block in (0, 1, 2, 0):
            cache.rows(ds, block * BLOCK_ROWS, block * BLOCK_ROWS + 1, path)
    assert cache.bytes <= 2 * block_bytes and len(cache.blocks) == 2
    assert cache.misses == 4  # block 0 was evicted by block 2 and read again
