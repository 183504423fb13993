"""The writers' quantizer threads are the rank's free cores over its writers, and they reach the
codec: a quantized shard written on 3 threads is the same file content as on 1 thread."""
from dataclasses import asdict

import h5py
import numpy as np
import pytest

from mpickpt.engine.free_cores import MAX_THREADS, codec_threads, free_cores, rank_share
from mpickpt.quant import search as rs
from mpickpt.quant.codecs import Codec


@pytest.mark.parametrize("local_size,device,torch_threads,cores,writers,want", [
    (1, "cuda", 16, 16, 1, 15),   # one GPU rank on 16 cores: all but its feeding thread
    (8, "cuda", 16, 64, 1, 7),    # 8 GPU ranks on 64 cores: 8 each, 7 free
    (8, "cuda", 16, 64, 2, 3),    # ... split over 2 writers
    (8, "cuda", 16, 16, 1, 1),    # 2 cores a rank: 1 free
    (4, "cuda", 1, 4, 1, 1),      # 1 core a rank: none free, still 1 thread
    (2, "cpu", 2, 2, 1, 1),       # CPU training on its torch threads: nothing free
    (1, "cpu", 4, 16, 1, 12),     # CPU training on 4 of 16 cores
    (1, "cuda", 1, 128, 1, MAX_THREADS),  # capped
])
def test_codec_threads_are_the_free_cores_over_the_writers(local_size, device, torch_threads,
                                                           cores, writers, want):
    """Unbound ranks: every rank's mask is the whole node."""
    assert codec_threads(local_size, writers, device, torch_threads, cores, node_cores=cores) == want


@pytest.mark.parametrize("local_size,cores,node_cores,want", [
    (8, 2, 16, 1),    # bound to 2 cores of its own: 1 free
    (8, 1, 16, 1),    # bound to 1 core: none free, still 1 thread
    (8, 8, 16, 1),    # socket binding, 4 ranks on each 8-core socket: 2 each, 1 free
    (8, 32, 64, 7),   # socket binding, 4 ranks on each 32-core socket: 8 each
    (1, 8, 16, 7),    # one rank bound to half the node
])
def test_a_bound_rank_s_mask_is_shared_only_by_the_ranks_bound_to_it(local_size, cores,
                                                                    node_cores, want):
    assert codec_threads(local_size, 1, "cuda", 1, cores, node_cores) == want


def test_free_cores_never_negative():
    assert free_cores(4, "cpu", 8, cores=4, node_cores=4) == 0
    assert rank_share(4, 1, 4) == 1


def test_the_writer_encodes_on_its_threads_and_writes_the_same_rows(tmp_path, monkeypatch):
    from mpickpt.engine.writer_process import write_file
    from mpickpt.store.file_spec import FileSpec

    seen = []
    real = rs.search_encode

    def spy(*args, **kwargs):
        seen.append(kwargs.get("threads"))
        return real(*args, **kwargs)

    monkeypatch.setattr(rs, "search_encode", spy)
    w = np.random.default_rng(0).standard_normal((200_000, 16)).astype(np.float32)
    fields = {k: v for k, v in asdict(Codec("adaptive", 4)).items() if k != "threads"}
    contents = []
    for threads in (1, 3):
        spec = FileSpec(str(tmp_path), f"rank-00000-part-{threads}.h5", "shard", 0,
                        datasets=[("tables/0/weight", "weight", None)], codecs={"weight": fields})
        write_file(spec, {"weight": w}, codec_threads=threads)
        with h5py.File(spec.path, "r") as f:
            group = f["tables/0/weight"]
            contents.append({k: group[k][()] for k in group if not k.startswith("_")})
    assert set(seen) == {1, 3}
    assert contents[0].keys() == contents[1].keys() and "codes" in contents[0]
    assert all(np.array_equal(contents[0][k], contents[1][k]) for k in contents[0])
