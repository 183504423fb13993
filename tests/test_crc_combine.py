"""The writers' whole-file CRC32 comes from the blocks' CRCs and the bytes between them, never from
reading the data back: it must equal zlib's CRC32 of the file, for plain, quantized, ranged,
blob and empty datasets, packed or aligned."""
import os
import random
import zlib
from dataclasses import asdict

import numpy as np
import pytest

from mpickpt.engine.writer_process import write_file
from mpickpt.quant.codecs import Codec
from mpickpt.store.crc_combine import crc32_combine, file_crc32_from_regions
from mpickpt.store.durable import file_crc32
from mpickpt.store.file_spec import FileSpec
from mpickpt.store.shard_file import BLOCK_ROWS


def test_combine_equals_zlib_over_the_concatenation():
    rng = random.Random(7)
    for _ in range(300):
        a, b = rng.randbytes(rng.randrange(0, 5000)), rng.randbytes(rng.randrange(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_regions_that_overlap_or_run_past_the_file_are_refused(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(100))
    crc = zlib.crc32(bytes(10))
    assert file_crc32_from_regions(str(path), [(5, [(crc, 10)])]) == zlib.crc32(bytes(100))
    with pytest.raises(ValueError, match="overlaps"):
        file_crc32_from_regions(str(path), [(5, [(crc, 10)]), (10, [(crc, 10)])])
    with pytest.raises(ValueError, match="past the end"):
        file_crc32_from_regions(str(path), [(95, [(crc, 10)])])


@pytest.mark.parametrize("align", [0, 4096])
def test_the_file_crc_of_a_written_shard_is_zlibs(tmp_path, align):
    rng = np.random.default_rng(0)
    arrays = {"weight": rng.standard_normal((BLOCK_ROWS + 1000, 16)).astype(np.float32),
              "state": rng.random(BLOCK_ROWS + 1000).astype(np.float32),
              "quantized": rng.standard_normal((3000, 16)).astype(np.float32),
              "empty": np.zeros((0, 16), np.float32)}
    codec = asdict(Codec("adaptive", 4))
    spec = FileSpec(str(tmp_path), "rank-00000-part-0.h5", "shard", 0, 0, {"step": 3},
                    datasets=[("tables/0/weight", "weight", None),
                              ("tables/0/rows", "weight", [(5, 900), (BLOCK_ROWS, BLOCK_ROWS + 7)]),
                              ("optimizer/0/state", "state", None),
                              ("tables/1/weight", "quantized", None),
                              ("tables/2/weight", "empty", None)],
                    blobs={"rng/torch": os.urandom(5000)}, codecs={"quantized": codec})
    size, payload, crc = write_file(spec, arrays, align)
    assert size == os.path.getsize(spec.path) and payload > 0
    assert crc == file_crc32(spec.path)


def test_the_fast_crc_is_zlibs_crc32():
    """mpickpt.store.crc (zlib-ng where installed, as the package requires) gives zlib's values,
    whole and continued, on empty, odd-length, unaligned and large buffers."""
    import platform

    from mpickpt.store import crc

    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):  # where setup.py asks for it
        assert crc.IMPLEMENTATION == "zlib-ng"
    data = np.random.default_rng(3).integers(0, 256, (9 << 20) + 13, dtype=np.uint8).tobytes()
    for piece in (b"", data[:1], data[1:4096 + 7], data[5:], data):
        assert crc.crc32(piece) == zlib.crc32(piece)
    head, tail = data[:123457], data[123457:]
    assert crc.crc32(tail, crc.crc32(head)) == zlib.crc32(data)
    assert crc.crc32(memoryview(np.frombuffer(data, np.float32, 1000, 4))) == \
        zlib.crc32(data[4:4004])
