"""`--ckpt-align`: datasets at least that large start at a multiple of it in every file a checkpoint
writes (shard, dense and column files through the writer, IncrCP bundles through the extractor),
so that on a striped filesystem no two datasets share a stripe; 0 packs them.

The writer is driven in process on real HDF5 files; one single-rank IncrCP training run checks
that the flag reaches the writers and the extractor.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpickpt.engine.writer_process import write_file
from mpickpt.store.file_spec import FileSpec
from mpickpt.store.shard_file import open_shard, verify_file
from tests.launch import REPO, SMALL_MODEL

KIB = 1024


def dataset_extents(path: str) -> dict[str, tuple[int, int]]:
    """name -> (file offset, bytes) of every dataset of `path` (all are contiguous)."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and obj.id.get_storage_size():
                offset = obj.id.get_offset()
                assert offset is not None, f"{path}:{name} is not contiguous"
                out[name] = (offset, obj.id.get_storage_size())
        f.visititems(visit)
    return out


def large_ones(path: str, align: int) -> dict[str, int]:
    """name -> offset of the datasets of `path` of at least `align` bytes."""
    return {n: off for n, (off, size) in dataset_extents(path).items() if size >= align}


ARRAYS = {"big": np.arange(300 * KIB // 4, dtype=np.float32).reshape(-1, 64),
          "mid": np.arange(100 * KIB // 8, dtype=np.int64),
          "small": np.arange(100, dtype=np.float32)}


def write(root: str, align: int) -> str:
    spec = FileSpec(root, f"align-{align}/rank-00000-part-0.h5", "shard", 0, 0, {"step": 1},
                    datasets=[(f"tables/{i}/{name}", name, None) for i, name in enumerate(ARRAYS)])
    size, payload, _ = write_file(spec, ARRAYS, align)
    assert payload == sum(a.nbytes for a in ARRAYS.values())
    assert size == os.path.getsize(spec.path)
    return spec.path


@pytest.mark.parametrize("align", [4 * KIB, 64 * KIB])
def test_large_datasets_start_at_multiples_of_the_alignment(tmp_path, align):
    path = write(str(tmp_path), align)
    large = large_ones(path, align)
    # big and mid, with their CRC datasets too small to count
    assert {"tables/0/big", "tables/1/mid"} <= set(large), large
    assert {n: off % align for n, off in large.items()} == {n: 0 for n in large}
    assert verify_file(path) == []
    with open_shard(path) as f:
        np.testing.assert_array_equal(f["tables/0/big"][:], ARRAYS["big"])


def test_align_zero_packs_the_file(tmp_path):
    packed, aligned = write(str(tmp_path), 0), write(str(tmp_path), 64 * KIB)
    payload = sum(a.nbytes for a in ARRAYS.values())
    assert os.path.getsize(packed) < payload + 16 * KIB  # only HDF5 metadata and CRCs beyond it
    offsets = [off for off, _ in dataset_extents(packed).values()]
    assert any(off % (4 * KIB) for off in offsets), offsets  # nothing was aligned
    assert os.path.getsize(aligned) > os.path.getsize(packed)
    assert verify_file(packed) == []


def test_training_aligns_shards_columns_and_bundles(tmp_path):
    align = 2 * KIB  # the small model's datasets are a few KiB
    root = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "mpickpt.train", *SMALL_MODEL, "--num-batches",
                           "12", "--ckpt-interval", "4", "--ckpt-kind", "incrcp",
                           "--incrcp-ratio", "0", "--incrcp-reset", "never", "--ckpt-align",
                           "2K", "--ckpt-dir", root], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kinds = {"shard": glob.glob(f"{root}/step-*/rank-*-part-*.h5"),
             "column": glob.glob(f"{root}/chains/*/rank-*/col-*.h5"),
             "bundle": glob.glob(f"{root}/chains/*/rank-*/bundle-*.h5")}
    for kind, paths in kinds.items():
        assert paths, f"no {kind} file in {root}"
        large = {f"{os.path.basename(p)}:{n}": off for p in paths
                 for n, off in large_ones(p, align).items()}
        assert large, f"no {kind} dataset of {align} bytes or more"
        misaligned = {n: off for n, off in large.items() if off % align}
        assert not misaligned, f"{kind} datasets not at multiples of {align}: {misaligned}"
