"""O_DIRECT writes of large datasets (store.direct_io): the bytes land exactly, whole pages go
past the page cache, and files written that way read, verify and checksum like buffered ones."""
from __future__ import annotations

import ctypes
from dataclasses import asdict
import errno
import fcntl
import mmap
import os

import numpy as np
import pytest

from mpickpt.engine.writer_process import write_file
from mpickpt.model.shard_plan import ShardPlan
from mpickpt.quant.codecs import Codec
from mpickpt.store.direct_io import MIN_DIRECT, PAGE, DirectFile
from mpickpt.store.durable import file_crc32
from mpickpt.store.file_spec import dense_spec, shard_attrs, shard_specs
from mpickpt.store.shard_file import open_shard, verify_file
from mpickpt.store.row_arrays import open_rows

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def page_aligned(nbytes: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, max(nbytes, PAGE)), dtype=np.uint8)[:nbytes]


def resident_pages(path: str, start: int, stop: int) -> int:
    """How many pages of [start, stop) of the file are in the page cache (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    first, last = start // PAGE * PAGE, -(-stop // PAGE) * PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, last - first, mmap.PROT_READ, mmap.MAP_SHARED, fd, first)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        vec = (ctypes.c_ubyte * ((last - first) // PAGE))()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(last - first), vec) == 0
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(last - first))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


@pytest.fixture
def bypass(tmp_path):
    """Skip unless an O_DIRECT write here leaves the page cache alone (on tmpfs, which takes
    O_DIRECT on recent kernels, the pages are the page cache)."""
    path = str(tmp_path / "probe")
    open(path, "wb").close()
    out = DirectFile(path)
    out.write_at(0, page_aligned(MIN_DIRECT))
    out.close()
    if out.direct_bytes == 0 or resident_pages(path, 0, MIN_DIRECT):
        pytest.skip(f"O_DIRECT does not bypass the page cache in {tmp_path}")
    os.remove(path)


@pytest.mark.parametrize("offset,nbytes,shift", [
    (0, 1 << 20, 0),                 # all whole pages, from page-aligned memory
    (1234, (1 << 20) + 777, 0),      # partial pages at both ends
    (PAGE, 5 << 20, 8),              # memory not page-aligned: through the bounce buffer
    (100, 3 * PAGE, 0),              # fewer whole pages than MIN_DIRECT: buffered
])
def test_blocks_land_exactly_and_whole_pages_skip_the_page_cache(tmp_path, bypass, offset, nbytes,
                                                                 shift):
    path = str(tmp_path / "f")
    open(path, "wb").close()
    src = page_aligned(nbytes + shift)[shift:]
    src[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    out = DirectFile(path)
    out.write_at(offset, src)
    if offset:  # the bytes before it, as HDF5's metadata would be
        out.write_at(0, np.arange(offset, dtype=np.uint8))
    out.close()
    whole = (offset + nbytes) // PAGE - -(-offset // PAGE)
    if whole * PAGE >= MIN_DIRECT:
        assert out.direct_bytes == whole * PAGE
        assert resident_pages(path, -(-offset // PAGE) * PAGE, (offset + nbytes) // PAGE * PAGE) == 0
    else:
        assert out.direct_bytes == 0
    assert out.direct_bytes + out.buffered_bytes == nbytes + offset
    data = np.fromfile(path, dtype=np.uint8)
    assert len(data) == offset + nbytes
    assert np.array_equal(data[offset:], src)
    assert np.array_equal(data[:offset], np.arange(offset, dtype=np.uint8))


def fail_direct_writes(monkeypatch, code: int) -> None:
    """pwrite on an O_DIRECT descriptor raises OSError(code); others write. Nothing here fails on
    demand (every filesystem takes O_DIRECT, tmpfs too on this kernel), so the test makes the
    refusal (EINVAL: NFS without it, a device with larger sectors) or the device error (EIO)."""
    real = os.pwrite

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(code, os.strerror(code))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)


def test_a_filesystem_refusing_o_direct_gets_the_same_bytes_buffered(tmp_path, monkeypatch):
    fail_direct_writes(monkeypatch, errno.EINVAL)
    path = str(tmp_path / "f")
    open(path, "wb").close()
    src = page_aligned(2 << 20)
    src[:] = 7
    out = DirectFile(path)
    out.write_at(PAGE, src)
    out.write_at(PAGE + len(src), src)
    assert not out.direct and out.direct_bytes == 0
    out.close()
    assert np.array_equal(np.fromfile(path, dtype=np.uint8)[PAGE:], np.full(4 << 20, 7, np.uint8))


def test_o_direct_refused_at_open_writes_buffered(tmp_path, monkeypatch):
    real = os.open
    monkeypatch.setattr(os, "open", lambda p, flags, *a: (_ for _ in ()).throw(
        OSError(errno.EINVAL, "Invalid argument")) if flags & os.O_DIRECT else real(p, flags, *a))
    path = str(tmp_path / "f")
    open(path, "wb").close()
    out = DirectFile(path)
    assert not out.direct
    out.write_at(10, np.arange(1 << 20, dtype=np.uint32))
    out.close()
    assert np.array_equal(np.fromfile(path, dtype=np.uint8)[10:].view(np.uint32),
                          np.arange(1 << 20, dtype=np.uint32))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("shift", [0, 1])  # staged rows page-aligned, or not (bounce buffer)
def test_a_failing_direct_write_fails_the_job_with_its_error_and_leaves_nothing(
        tmp_path, monkeypatch, shift):
    """EIO from the device (made by the test: nothing here fails on demand) ends the writer's job
    with an error naming the file and the errno; no temporary, reservation or descriptor stays."""
    from mpickpt.engine.staging import StagingArea
    from mpickpt.engine.writer_process import run_job

    plan = ShardPlan.build([70_000, 50_000], 1)
    gids, arrays = shard_arrays(plan, 0)
    area = StagingArea({k: (a.shape, a.dtype.str) for k, a in arrays.items()})
    try:
        for k, a in arrays.items():
            area.arrays[k][...] = a
        [spec] = shard_specs(str(tmp_path), plan, 0, gids, NAMES, lambda j: "s.h5", "shard",
                             lambda j: shard_attrs(7, "full", "fp32", 0, j, 1, 1))
        if shift:  # rows from the second on: not page-aligned in memory
            spec.datasets = [(name, src, [(1, len(gids))]) for name, src, _ in spec.datasets]
        fail_direct_writes(monkeypatch, errno.EIO)
        before, attached = open_fds(), {}
        for _ in range(3):
            answer = run_job({"step": 7, "files": [spec], "staging": area.describe(),
                              "io": "direct"}, attached)
            assert not answer["ok"]
            assert spec.path in answer["error"] and "Input/output error" in answer["error"]
        attached.clear()
        assert open_fds() == before
        assert os.listdir(tmp_path) == []
        monkeypatch.undo()
        assert run_job({"step": 7, "files": [spec], "staging": area.describe(), "io": "direct"},
                       attached)["ok"]
        assert verify_file(spec.path) == []
    finally:
        area.close()


NAMES = ["weight", "state/adagrad_sum"]


def shard_arrays(plan: ShardPlan, rank: int) -> tuple[np.ndarray, dict]:
    gids = plan.rank_global_ids(rank)
    rng = np.random.default_rng(rank)
    return gids, {"gids": gids, "weight": rng.standard_normal((len(gids), 16), np.float32),
                  "state/adagrad_sum": rng.random(len(gids), np.float32)}


@pytest.mark.parametrize("align,codecs", [(1 << 20, None), (0, None),
                                          (1 << 20, {"weight": asdict(Codec("asym", 4))})])
def test_direct_and_buffered_files_hold_the_same_rows_and_checksums(tmp_path, bypass, align,
                                                                    codecs):
    plan = ShardPlan.build([70_000, 300, 90_000, 1_000, 40_000], 2)
    gids, arrays = shard_arrays(plan, 0)
    read = {}
    for mode in ("buffered", "direct"):
        [spec] = shard_specs(str(tmp_path), plan, 0, gids, NAMES, lambda j: f"{mode}.h5", "shard",
                             lambda j: shard_attrs(7, "full", "fp32", 0, j, 1, 2),
                             codecs=codecs)
        size, _, crc = write_file(spec, arrays, align, direct=mode == "direct")
        with open_shard(spec.path) as f:  # metadata only: the rows' pages are not read yet
            weight = f["rows/weight"]
            weight = weight if codecs is None else weight["codes"]
            offset = weight.id.get_offset()
            stop = offset + weight.id.get_storage_size()
        resident, pages = resident_pages(spec.path, offset, stop), (stop - offset) // PAGE
        if mode == "direct":  # the partial end pages, and readahead by the metadata reads
            assert pages > 150 and resident <= 32
        else:
            assert resident >= 0.9 * pages
        assert verify_file(spec.path) == []
        assert crc == file_crc32(spec.path) and size == os.path.getsize(spec.path)
        with open_shard(spec.path) as f:
            read[mode] = {name: open_rows(f["rows"], name, spec.path).rows(0, len(gids))
                          for name in ["gids", *NAMES]}
    for name, rows in read["buffered"].items():
        assert np.array_equal(read["direct"][name], rows), name
    assert np.array_equal(read["direct"]["gids"], gids)
    if codecs is None:
        assert np.array_equal(read["direct"]["weight"], arrays["weight"])


def test_a_dense_file_written_direct_reads_back(tmp_path, bypass):
    from mpickpt.store import dense_file

    arrays = {"dense/w": np.random.default_rng(1).standard_normal((1200, 600), np.float32),
              "dense/b": np.arange(300, dtype=np.float32), "dense/step": np.array(5)}
    spec = dense_spec(str(tmp_path), "ck", 5,
                      {k[6:]: (a.shape, str(a.dtype)) for k, a in arrays.items()}, ["w", "b"])
    write_file(spec, arrays, 1 << 20, direct=True)
    with open_shard(spec.path) as f:  # the pack (2.9 MB) starts at 1 MiB: its blocks go direct
        pack = f[dense_file.PACKED].id
        offset, stop = pack.get_offset(), pack.get_offset() + pack.get_storage_size()
    assert offset % (1 << 20) == 0 and resident_pages(spec.path, offset, stop) <= 32
    assert verify_file(spec.path) == []
    with open_shard(spec.path) as f:
        back = dense_file.dense_arrays(f, spec.path)
    for k, a in arrays.items():
        assert np.array_equal(back[k[6:]], a)


def test_training_writes_shards_past_the_page_cache_by_default(tmp_path, bypass):
    """One real 1-rank run (default --ckpt-io): the flag reaches the writers, whose shard rows
    are on disk and not in the page cache; `--ckpt-io` refuses an unknown mode by name."""
    import subprocess
    import sys

    from mpickpt.engine.config import CheckpointConfig
    from tests.launch import REPO

    with pytest.raises(ValueError, match=r"--ckpt-io must be one of direct, buffered, got 'mmap'"):
        CheckpointConfig(directory=str(tmp_path), io="mmap")
    root = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "mpickpt.train", "--arch-embedding-size",
                           "60000-30000", "--arch-sparse-feature-size", "16", "--arch-mlp-bot",
                           "13-16", "--arch-mlp-top", "16-1", "--mini-batch-size", "32",
                           "--test-num-batches", "0", "--print-freq", "0", "--num-batches", "3",
                           "--ckpt-interval", "3", "--ckpt-dir", str(root)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [path] = [str(p) for p in root.glob("step-*/rank-*-part-*.h5")]
    with open_shard(path) as f:
        weight = f["rows/weight"].id
        offset, stop = weight.get_offset(), weight.get_offset() + weight.get_storage_size()
    assert (stop - offset) // PAGE > 1000 and resident_pages(path, offset, stop) <= 32
    assert verify_file(path) == []


def test_incrcp_bundles_go_past_the_page_cache_when_asked(tmp_path, bypass, monkeypatch):
    """The extractor's bundles follow --ckpt-io (`BundleBuilder.write(direct=True)`); their
    chunks are joined into page-aligned memory, so that a dataset at an aligned offset (the
    weights, 5 MB at a multiple of --ckpt-align) goes out without the bounce buffer's copy."""
    from mpickpt.incrcp.extraction import BundleBuilder
    from mpickpt.store.row_arrays import EncodedRows

    bounced = []
    real = DirectFile._bounced
    monkeypatch.setattr(DirectFile, "_bounced",
                        lambda self, data, at: bounced.append(len(data)) or real(self, data, at))
    weight = np.random.default_rng(3).standard_normal((80_000, 16), np.float32)
    for direct in (False, True):
        bundle = BundleBuilder(f"bundle-{direct}.h5")
        for lo, hi in ((0, 30_000), (30_000, 80_000)):  # two chunks, joined in the file
            bundle.add(0, 5, {"gids": np.arange(lo, hi, dtype=np.int64),
                              "weight": EncodedRows(None, (16,), "float32",
                                                    {"values": weight[lo:hi]})}, None)
        bundle.write(str(tmp_path), 5, 1 << 20, direct)
        assert sum(bounced) <= 80_000 * 8, bounced  # at most the gids (under 1 MB: unaligned)
        path = str(tmp_path / bundle.relpath)
        with open_shard(path) as f:
            ds = f["rows/weight"].id
            offset, stop = ds.get_offset(), ds.get_offset() + ds.get_storage_size()
        resident = resident_pages(path, offset, stop)
        assert resident <= 32 if direct else resident >= 0.9 * (stop - offset) // PAGE
        assert verify_file(path) == []
        with open_shard(path) as f:
            assert np.array_equal(open_rows(f["rows"], "weight", path).rows(0, 80_000), weight)


def test_a_staging_area_matches_only_its_own_shapes_dtypes_and_order():
    """`matches` is asked in every stall: an area is reused for the same arrays, and laid out
    again when a shape, a dtype or the order changes (the writers read arrays by offset)."""
    from mpickpt.engine.staging import StagingArea

    specs = {"weight": ((10, 4), "float32"), "gids": ((10,), "int64"),
             "dense/param/w": ((3, 2), "float32")}
    area = StagingArea(specs)
    try:
        assert area.matches(dict(specs))
        assert not area.matches({**specs, "weight": ((11, 4), "float32")})
        assert not area.matches({**specs, "dense/param/w": ((3, 2), "float64")})
        assert not area.matches(dict(reversed(list(specs.items()))))
        assert not area.matches({**specs, "dense/opt/0/sum": ((3, 2), "float32")})
    finally:
        area.close()
