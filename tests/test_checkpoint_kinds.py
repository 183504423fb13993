"""Every checkpoint kind restores every retained step exactly (in-process chains, hypothesis), and
the IncrCP chunk store survives retention, resharding and a crash in the middle of an extraction."""
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpickpt.kinds.registry import KINDS, kind_named
from tests.local_chain import LocalChain
from mpickpt.incrcp.extraction import Extractor, remove_orphans
from mpickpt.incrcp.extractor_process import column_refs
from mpickpt.store.chunk_index import generations, index_dir, load_index
from mpickpt.model.shard_plan import ShardPlan
from mpickpt.checkpoint.export import export_checkpoint
from mpickpt.store.manifest import list_manifests
from mpickpt.checkpoint.verify import verify_checkpoint

PLAN = ShardPlan.build((300, 200, 150, 40), 2)
EXACT = tuple(k for k in KINDS if kind_named(k).exact)
"""Kinds whose checkpoints hold every row's value at their step (all but prioritized saves)."""


def _assert_state(got, expected, what):
    for r, (g, e) in enumerate(zip(got, expected)):
        for name in e:
            assert np.array_equal(g[name], e[name]), f"{what}: rank {r} {name} differs"


def _stream(chain, rng, steps, hot, touched):
    """Random sparse updates: a hot set touched every step plus `touched` random rows per rank."""
    expected = {}
    for step in range(1, steps + 1):
        for r in range(PLAN.world_size):
            n = PLAN.local_rows(r)
            rows = np.concatenate([np.arange(min(hot, n)), rng.integers(0, n, touched)])
            chain.touch(r, rows, rng)
        chain.save(step)
        expected[step] = chain.snapshot()
    return expected


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(EXACT), seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 14),
       hot=st.integers(0, 20), touched=st.integers(0, 80),
       ratio=st.sampled_from([0.0, 0.02, 0.3]))
def test_every_kind_restores_every_step_exactly(tmp_path_factory, kind, seed, steps, hot, touched,
                                                ratio):
    root = str(tmp_path_factory.mktemp(kind))
    chain = LocalChain(root, PLAN, dim=3, policy=kind, ratio=ratio, seed=seed)
    expected = _stream(chain, np.random.default_rng(seed), steps, hot, touched)
    for step, state in expected.items():
        got, _ = chain.restore(step)
        _assert_state(got, state, f"{kind} step {step}")


def test_a_4bit_incrcp_chain_restores_every_step_as_its_codec_encodes_it(tmp_path):
    """Rows of an increment chain are stored at their last write, each encoded on its own, so the
    chain's restore at a step equals the codec's round trip of every row's value at that step,
    bit for bit, whatever the extractor moved (encoded rows are split and copied, never
    re-encoded), and the fp32 optimizer state is exact."""
    from mpickpt.quant.codecs import Codec

    codec = Codec(name="adaptive", bits=4)
    chain = LocalChain(str(tmp_path), PLAN, dim=8, policy="incrcp", ratio=0.02, seed=5,
                       incrcp_reset="never", bits=4)
    expected = _stream(chain, np.random.default_rng(5), 10, 12, 60)
    assert [h["kind"] for h in chain.history].count("incrcp") == 9
    assert chain.extracted_rows > 0  # encoded rows were split and moved
    for step, state in expected.items():
        got, _ = chain.restore(step)
        for r, (g, e) in enumerate(zip(got, state)):
            want = codec.decode(codec.encode(e["weight"]), 8)
            assert np.array_equal(g["weight"], want), f"step {step} rank {r}: weights differ"
            assert np.array_equal(g["state/sum"], e["state/sum"]), f"step {step} rank {r}"


def test_exports_are_byte_identical_across_kinds(tmp_path):
    exports = {}
    for kind in EXACT:
        root = tmp_path / kind
        chain = LocalChain(str(root), PLAN, dim=3, policy=kind, seed=7)
        _stream(chain, np.random.default_rng(7), 9, 5, 40)
        kinds = {m.step: m.kind for m in list_manifests(str(root))}
        for m in list_manifests(str(root)):
            out = tmp_path / f"{kind}-{m.step}.h5"
            export_checkpoint(str(root), m, str(out), with_optimizer=True)
            exports.setdefault(m.step, {})[kind] = out.read_bytes()
            assert verify_checkpoint(str(root), m) == [], (kind, m.step)
        if kind != "full":
            assert set(kinds.values()) - {"full"}, f"{kind} never wrote an increment: {kinds}"
    for step, by_kind in exports.items():
        assert len(by_kind) == len(EXACT)
        reference = by_kind["full"]
        for kind, data in by_kind.items():
            assert data == reference, f"export of step {step} under {kind} differs from full"


@pytest.mark.parametrize("kind", ["differential", "consecutive", "incrcp"])
def test_restore_reshards_to_other_rank_counts(tmp_path, kind):
    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy=kind, seed=3)
    expected = _stream(chain, np.random.default_rng(3), 6, 4, 30)
    for world in (1, 3):
        other = ShardPlan.build(PLAN.table_sizes, world)
        for step in (2, 6):
            got, _ = chain.restore(step, other)
            rows = {}
            for r in range(PLAN.world_size):
                for gid, w in zip(PLAN.local_to_global(r, np.arange(PLAN.local_rows(r))),
                                  expected[step][r]["weight"]):
                    rows[int(gid)] = w
            for r in range(world):
                gids = other.local_to_global(r, np.arange(other.local_rows(r)))
                want = np.stack([rows[int(g)] for g in gids])
                assert np.array_equal(got[r]["weight"], want), (kind, world, step, r)


@pytest.mark.parametrize("kind", ["full", "differential", "incrcp"])
def test_a_rank_restores_without_opening_other_ranks_shard_files(tmp_path, kind):
    """Under the writing plan, each rank reads only its own shard files (the manifest's plan says
    which global ids each writer held): damage to rank 1's files, or their loss, does not reach
    rank 0's restore.
    A manifest whose plan does not list its shards (older ones) opens every file, as before."""
    import dataclasses

    from mpickpt.checkpoint.load import load_checkpoint
    from mpickpt.store.errors import CheckpointError

    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy=kind, seed=5)
    expected = _stream(chain, np.random.default_rng(5), 4, 4, 30)
    manifests = {m.step: m for m in list_manifests(str(tmp_path))}
    for m in manifests.values():
        for rel, meta in m.files.items():
            if meta["role"] == "shard" and meta["rank"] == 1:
                with open(os.path.join(str(tmp_path), rel), "r+b") as f:
                    f.write(b"\0" * 64)  # the HDF5 superblock: unreadable, size unchanged
    templates = {"weight": ((3,), np.dtype(np.float32)), "state/sum": ((), np.dtype(np.float32))}
    got = load_checkpoint(str(tmp_path), manifests[4], PLAN, 0, 3, templates, manifests).rows
    _assert_state([got], [expected[4][0]], f"{kind} rank 0")
    with pytest.raises(CheckpointError, match="rank-00001"):
        load_checkpoint(str(tmp_path), manifests[4], PLAN, 1, 3, templates, manifests)
    for m in manifests.values():  # a missing file too is its reader's to report
        for rel, meta in m.files.items():
            if meta["role"] == "shard" and meta["rank"] == 1:
                os.remove(os.path.join(str(tmp_path), rel))
    got = load_checkpoint(str(tmp_path), manifests[4], PLAN, 0, 3, templates, manifests).rows
    _assert_state([got], [expected[4][0]], f"{kind} rank 0, rank 1's files gone")
    with pytest.raises(CheckpointError, match="rank-00001.*missing"):
        load_checkpoint(str(tmp_path), manifests[4], PLAN, 1, 3, templates, manifests)
    unlisted = {step: dataclasses.replace(m, plan={k: v for k, v in m.plan.items()
                                                   if k != "shards"})
                for step, m in manifests.items()}
    with pytest.raises(CheckpointError, match="rank-00001"):
        load_checkpoint(str(tmp_path), unlisted[4], PLAN, 0, 3, templates, unlisted)


def test_retention_keeps_what_retained_checkpoints_need(tmp_path):
    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy="incrcp", keep=3, seed=5,
                       incrcp_reset="never")
    expected = _stream(chain, np.random.default_rng(5), 12, 6, 40)
    steps = [m.step for m in list_manifests(str(tmp_path))]
    assert steps[-3:] == [10, 11, 12] and 1 in steps  # the baseline stays as a parent
    assert not set(steps) & set(range(2, 10)), steps
    for step in steps:
        got, _ = chain.restore(step)
        _assert_state(got, expected[step], f"step {step}")
    index = load_index(str(tmp_path), list_manifests(str(tmp_path))[-1].chain, 0)
    # chunks needed only by retired checkpoints are gone, and so are their files
    assert all(any(r.column <= s < r.until for s in steps) for r in index.refs() if r.until)
    on_disk = set(os.listdir(index_dir(str(tmp_path), index.chain, 0)))
    referenced = {os.path.basename(f) for f in index.refcounts()}
    assert {f for f in on_disk if f.endswith(".h5")} == referenced


def test_crash_before_index_commit_keeps_every_checkpoint_restorable(tmp_path):
    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy="incrcp", seed=9, incrcp_reset="never")
    expected = _stream(chain, np.random.default_rng(9), 6, 8, 40)
    # the next checkpoint is written, then its extraction dies after the bundles, before the commit
    rng = np.random.default_rng(10)
    for r in range(2):
        chain.touch(r, np.arange(30), rng)
    real_ingest = chain._ingest

    def crashing_ingest(step, save):
        index = load_index(chain.root, save.chain, 0)
        gens = generations(index_dir(chain.root, save.chain, 0))
        refs = column_refs(chain.root, save.chain, 0, step, 1)
        with pytest.raises(RuntimeError):
            Extractor(chain.root).ingest(index, step, refs, ["state/sum", "weight"], None,
                                         before_commit=_boom)
        assert generations(index_dir(chain.root, save.chain, 0)) == gens  # nothing committed
        bundles = [f for f in os.listdir(index_dir(chain.root, save.chain, 0)) if "bundle-" in f
                   and f"{step:012d}" in f]
        assert bundles, "the crash should leave the new bundles behind"
        return 0.0

    chain._ingest = crashing_ingest
    chain.save(7)
    expected[7] = chain.snapshot()
    for step, state in expected.items():
        got, _ = chain.restore(step)
        _assert_state(got, state, f"after the crash, step {step}")
    chain._ingest = real_ingest  # a restarted extractor ingests the column again, then the next
    chain.indexes = {}
    real_ingest(7, SimpleNamespace(chain=chain.planners[0].chain))
    for r in range(2):
        chain.touch(r, np.arange(50), rng)
    chain.save(8)
    expected[8] = chain.snapshot()
    for step, state in expected.items():
        got, _ = chain.restore(step)
        _assert_state(got, state, f"after re-ingestion, step {step}")


def test_an_ingestion_on_a_full_disk_names_its_file_and_leaves_no_debris(small_tmpfs):
    """The extractor's bundle write fails on a full disk: its error names the file (it said
    only 'No space left on device'), and its temporaries and unindexed bundles go at once,
    not at the chain's next ingestion, which may never come."""
    from mpickpt.incrcp.extractor_process import run_ingest

    root = str(small_tmpfs / "ckpt")
    chain = LocalChain(root, PLAN, dim=64, policy="incrcp", seed=9, incrcp_reset="never")
    rng = np.random.default_rng(3)
    for step in (1, 2):
        for r in range(2):
            chain.touch(r, np.arange(PLAN.local_rows(r)), rng)  # every row: all extracted next
        chain.save(step)
    for r in range(2):
        chain.touch(r, np.arange(PLAN.local_rows(r)), rng)
    chain._ingest = lambda step, save: 0.0  # written, not ingested: the job below does it
    chain.save(3)
    save_chain = chain.planners[0].chain
    folder = index_dir(root, save_chain, 0)
    before = sorted(os.listdir(folder))
    free = os.statvfs(small_tmpfs)
    with open(small_tmpfs / "filler", "wb") as f:
        f.write(bytes(max(0, free.f_bavail * free.f_frsize - 4096)))
    answer = run_ingest({"root": root, "chain": save_chain, "rank": 0, "step": 3, "parts": 1,
                         "row_names": ["state/sum", "weight"], "time_restore": False},
                        {"extractor": Extractor(root), "indexes": {}, "probe": None})
    assert not answer["ok"] and "No space left on device" in answer["error"], answer
    assert f"{folder}/bundle-000000000003-" in answer["error"], answer["error"]
    assert sorted(os.listdir(folder)) == before  # no .tmp, no bundle without an index


def _boom():
    raise RuntimeError("injected crash before the index commit")


def test_orphan_sweep_spares_column_files_a_writer_is_still_writing(tmp_path):
    """A restarted extractor sweeps its own crash debris, never a checkpoint writer's column file
    in flight (deleting that one made the writer's rename fail and abandoned a checkpoint)."""
    index = load_index(str(tmp_path), "chain-x", 0)
    folder = index_dir(str(tmp_path), "chain-x", 0)
    os.makedirs(folder)
    debris = ["bundle-000000000008-0.h5", "bundle-000000000008-1.h5.tmp",
              "index-00000003.json.tmp-4242"]
    spared = ["col-000000000012-part-0.h5.tmp", "col-000000000008-part-0.h5", "notes.txt"]
    for name in debris + spared:
        open(os.path.join(folder, name), "w").close()
    assert remove_orphans(str(tmp_path), index) == len(debris)
    assert sorted(os.listdir(folder)) == sorted(spared)



def test_damaged_bundle_is_found_by_verify_and_restore(tmp_path):
    import subprocess
    import sys

    from mpickpt.store.errors import CheckpointError

    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy="incrcp", seed=11, incrcp_reset="never")
    expected = _stream(chain, np.random.default_rng(11), 6, 10, 40)
    manifests = list_manifests(str(tmp_path))
    index = load_index(str(tmp_path), manifests[-1].chain, 0)
    bundle = sorted(f for f in index.refcounts() if "row1" in f)[0]
    users = [m.step for m in manifests if m.kind == "incrcp"
             and any(r.file == bundle for r in index.rectangle(m.step))]
    assert users and users[-1] < 6, users  # deep rows serve older checkpoints only
    path = tmp_path / bundle
    ref = next(r for r in index.rectangle(users[0]) if r.file == bundle)
    import h5py

    with h5py.File(path, "r") as f:  # a byte inside a row that restoring users[0] reads
        ds = f[f"{ref.where}/weight"]
        at = ds.id.get_offset() + ref.start * ds.dtype.itemsize * ds.shape[1]
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    cli = [sys.executable, "-m", "mpickpt.cli"]
    bad = subprocess.run([*cli, "verify", str(tmp_path), "--step", str(users[0])],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and bundle in bad.stdout, bad.stdout
    good = subprocess.run([*cli, "verify", str(tmp_path), "--step", "6"], capture_output=True,
                          text=True)
    assert good.returncode == 0, good.stdout  # the newest step does not read the deep row
    with pytest.raises(CheckpointError, match=bundle.split("/")[-1]):
        chain.restore(users[0])
    got, _ = chain.restore(6)
    _assert_state(got, expected[6], "step 6")
    shown = subprocess.run([*cli, "inspect", str(tmp_path), "--step", "6"], capture_output=True,
                           text=True)
    assert "chunk store" in shown.stdout and "index generation" in shown.stdout, shown.stdout


def test_bloom_filter_has_no_false_negatives_and_few_false_positives():
    from mpickpt.incrcp.bloom import BloomFilter

    rng = np.random.default_rng(0)
    keys = rng.choice(10**9, 20_000, replace=False)
    f = BloomFilter.of(keys)
    assert f.contains(keys).all()
    others = rng.choice(10**9, 20_000, replace=False) + 10**9
    assert f.contains(others).mean() < 0.02  # ~0.8% expected at 10 bits per key


def test_the_extractor_keeps_the_bloom_filters_of_the_chunks_it_makes(tmp_path, monkeypatch):
    """A chunk's Bloom filter is built from the keys at hand when the chunk is made (a new
    column's chunks, the rows a split leaves in row 0), never by reading its keys back at a later
    ingestion; and it equals the filter of the keys on disk."""
    from mpickpt.incrcp import extraction
    from mpickpt.incrcp.bloom import BloomFilter

    from mpickpt.incrcp.bloom_stage import BloomStage

    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy="incrcp", seed=3, ratio=0.0,
                       incrcp_reset="never")
    for e in chain.extractors:  # with hot rows the stage would go off (next test)
        e.bloom_stage = BloomStage.always()
    reads = []
    real = extraction.ChunkReader.gids
    monkeypatch.setattr(extraction.ChunkReader, "gids",
                        lambda self, ref: reads.append(ref.file) or real(self, ref))
    rng = np.random.default_rng(3)
    for step in range(1, 7):
        for r in range(PLAN.world_size):
            chain.touch(r, np.concatenate([np.arange(10), rng.integers(0, 60, 30)]), rng)
        del reads[:]
        chain.save(step)
        # the only keys read: the new column's own (its file), never an older chunk's (step 1
        # is the chain's baseline, which is not ingested)
        assert step == 1 or reads and all(f"col-{step:012d}" in f for f in reads), (step, reads)
    extractor = chain.extractors[0]
    index = load_index(chain.root, list_manifests(chain.root)[-1].chain, 0)
    live = [r for t in index.cells for c in index.cells[t] for r in index.row0(t, c)]
    assert any("bundle-" in r.file for r in live)  # splits happened: row-0 chunks in bundles
    reader = extraction.ChunkReader(chain.root)
    try:
        for ref in live:
            kept = extractor.blooms[(ref.file, ref.table, ref.start)]
            assert np.array_equal(kept.bits, BloomFilter.of(real(reader, ref)).bits), ref
    finally:
        reader.close()


def test_the_bloom_stage_goes_off_where_it_skips_nothing_and_extracts_the_same(tmp_path):
    """Hot rows in every interval: Bloom tests skip no chunk, and after two such ingestions the
    stage goes off (no filters built or tested) except for a probe every third; cold rows (new
    keys inside old chunks' key ranges but none of their keys): a probe skips chunks and the
    stage is on again. The index, the extracted rows and every restored step equal those of an
    extractor whose stage always runs."""
    from mpickpt.incrcp.bloom_stage import BloomStage

    def run(root, stage):
        chain = LocalChain(str(root), PLAN, dim=3, policy="incrcp", seed=5,
                           incrcp_reset="never")
        for e in chain.extractors:
            e.bloom_stage = stage()
        rng, expected = np.random.default_rng(5), {}
        for step in range(1, 17):
            for r in range(PLAN.world_size):
                n = PLAN.local_rows(r)
                parity = 0 if step <= 8 else 1  # even rows hot, then odd rows only
                rows = np.arange(parity, n, 2)
                chain.touch(r, rows if step <= 8 else rng.choice(rows, len(rows) // 4), rng)
            chain.save(step)
            expected[step] = chain.snapshot()
        return chain, expected

    always, _ = run(tmp_path / "always", BloomStage.always)
    adaptive, expected = run(tmp_path / "adaptive", lambda: BloomStage(quiet=2, probe_every=3,
                                                                    longest=3))
    backing_off, _ = run(tmp_path / "backing-off", lambda: BloomStage(quiet=1, probe_every=2,
                                                                      longest=4))
    assert backing_off.extracted_rows == always.extracted_rows
    probes = [i for i, s in enumerate(backing_off.ingestions[::PLAN.world_size]) if s.bloom]
    assert probes[:4] == [0, 1, 3, 7], probes  # off from step 3: probes 2 then 4 apart
    ran = [s.bloom for s in adaptive.ingestions[::PLAN.world_size]]  # rank 0's ingestions
    assert all(s.bloom for s in always.ingestions)
    # step 2 tests no chunk (its only older column is the baseline's), steps 3 and 4 skip none:
    # off from step 5, a probe at step 7 (skips none), off at steps 8 and 9, a probe at step 10
    assert ran[:8] == [True, True, True, False, False, True, False, False], ran
    skipping = [i for i, s in enumerate(always.ingestions[::PLAN.world_size]) if s.skipped_bloom]
    assert skipping and min(skipping) == 7, skipping  # the cold phase (step 9 on) skips
    assert all(ran[8:]), ran  # the probe at step 10 skipped: on again
    assert adaptive.ingestions[2 * 8].skipped_bloom > 0
    assert adaptive.ingestions[2 * 7].skipped_ratio > 0  # step 9: stage 3 kept those chunks
    assert adaptive.extracted_rows == always.extracted_rows > 0
    for rank in range(PLAN.world_size):
        chain = list_manifests(str(tmp_path / "adaptive"))[-1].chain
        assert chain == list_manifests(str(tmp_path / "always"))[-1].chain
        got = load_index(str(tmp_path / "adaptive"), chain, rank).to_json()
        want = load_index(str(tmp_path / "always"), chain, rank).to_json()
        assert got == want, f"rank {rank}: the chunk index differs"
    for step in (3, 8, 12, 16):
        _assert_state(adaptive.restore(step)[0], expected[step], f"step {step}")


def test_the_bloom_stage_refuses_a_non_positive_setting():
    from mpickpt.incrcp.bloom_stage import BloomStage

    with pytest.raises(ValueError, match="quiet and probe_every must be >= 1, got 0 and 8"):
        BloomStage(quiet=0)
    with pytest.raises(ValueError, match=r"longest \(4\) must be at least probe_every \(8\)"):
        BloomStage(longest=4)


def test_bloom_probes_that_skip_nothing_double_the_gap_to_the_next_until_a_skip():
    """While off, probes run 3, 6, 12, 12 ingestions apart as long as they skip nothing; a
    probe that skips turns the stage on (it runs at every ingestion) and the next time it goes
    off, the first probe is 3 ingestions away again."""
    from mpickpt.incrcp.bloom_stage import BloomStage

    stage = BloomStage(quiet=1, probe_every=3, longest=12)

    def feed(n, skipped=0):
        ran = []
        for _ in range(n):
            runs = stage.runs()
            ran.append(runs)
            stage.record(runs, tested=5, skipped=skipped if runs else 0)
        return [i for i, r in enumerate(ran) if r]

    assert feed(1) == [0] and stage.off  # skipped nothing: off
    assert feed(3 + 6 + 12 + 12) == [2, 8, 20, 32]
    assert stage.gap == 12
    assert feed(12, skipped=1) == [11]  # the probe skips: on again
    assert not stage.off and stage.gap == 3
    assert feed(3, skipped=1) == [0, 1, 2]  # on: every ingestion
    assert feed(1) == [0] and stage.off  # off again; the first probe 3 away
    assert feed(3) == [2] and stage.gap == 6


def test_chunk_refs_serialize_as_their_fields():
    from dataclasses import asdict

    from mpickpt.store.chunk_index import ChunkRef

    for ref in (ChunkRef("a.h5", 3, 0, 9, 10, 18, 4), ChunkRef("b.h5", 0, 5, 7, 1, 2, 6, 9, "rows")):
        assert ref.to_json() == asdict(ref) and list(ref.to_json()) == list(asdict(ref))
        assert ChunkRef(**ref.to_json()) == ref


def test_dropping_chunks_trims_the_empty_rows_after_a_columns_last_chunk():
    """Rows emptied by retention go from the end of a column's list, not from between rows
    that still hold chunks; row 0 always stays, and the index reads back as it was."""
    from mpickpt.store.chunk_index import ChunkIndex, ChunkRef

    index = ChunkIndex("chain-x", 0)
    index.add_column(10, [ChunkRef("c10.h5", 0, 0, 8, 0, 7, 10)])
    for step in (20, 30, 40):  # three rounds, each moving one chunk of column 10 to its row 1
        index.add_column(step, [])
        index.push_row1(0, 10, index.row0(0, 10), [ChunkRef("b.h5", 0, step, step + 1, 1, 1,
                                                             10, step)])
    assert [len(r) for r in index.cells[0][10]] == [1, 1, 1, 1]
    assert index.drop(lambda r: r.until != 30) == 1  # a middle row runs empty: it stays
    assert [len(r) for r in index.cells[0][10]] == [1, 1, 0, 1]
    assert index.drop(lambda r: r.until is None) == 2  # every row past 0 runs empty
    assert index.cells[0][10] == [[ChunkRef("c10.h5", 0, 0, 8, 0, 7, 10)]]
    assert index.cells[0][20] == [[]] and index.depth(0) == 1
    assert ChunkIndex.from_json(index.to_json()) == index


def test_intermittent_predictor_and_incrcp_cost_model():
    from mpickpt.kinds.planner import KindPlanner
    from mpickpt.kinds.registry import kind_named

    def planner(policy):
        counts = {}
        p = KindPlanner(kind_named(policy, total_rows=100), 100, lambda v: counts["sums"],
                        lambda v: v)
        return p, counts

    p, counts = planner("intermittent")
    kinds = []
    for step, since_base in enumerate([100, 20, 35, 45, 52, 58, 20], start=1):
        counts["sums"] = np.array([10, since_base])
        kinds.append(p.plan(step, np.arange(10), "a").kind)
    # increments of 0.20, 0.35, 0.45, 0.52 of the model: F_c = 1.2 > I_c = 0.4; 1.55 > 1.05;
    # 2.0 > 1.8; then F_c = 2.52 <= I_c = 5 * 0.52 = 2.6 -> a new baseline, and a new history
    assert kinds == ["full", "differential", "differential", "differential", "differential",
                     "full", "differential"], kinds
    assert "F_c 2.520 <= I_c 2.600" in p.decisions[5]["reason"]
    p, counts = planner("incrcp")
    counts["sums"] = np.array([10, 10])
    assert p.plan(1, np.arange(10), "a").kind == "full"
    p.record_write("full", 1.0)
    p.record_write("incrcp", 0.1)
    assert p.plan(2, np.arange(10), "a").kind == "incrcp"
    p.record_restore(p.chain, 2, 0.3)
    p.record_restore(p.chain, 3, 0.7)
    assert p.kind.cost.predicted_restore() == pytest.approx(1.1)  # linear in the last two restores
    assert p.plan(3, np.arange(10), "a").kind == "full"  # C_base 1.0 < 0.1 + 1.1
    assert "cost model" in p.decisions[-1]["reason"]


@pytest.mark.parametrize("rule", ["mfu", "ssu", "scar"])
def test_prioritized_checkpoints_restore_each_row_as_last_written(tmp_path, rule):
    """A prioritized checkpoint is approximate: each row holds its value at the newest save that
    wrote it (the baseline, or a partial save that chose it), never a value it never saved."""
    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy="full", seed=13, priority=rule,
                       save_fraction=0.2)
    rng = np.random.default_rng(13)
    saved = None  # per rank: the values as of the last save that wrote each row
    stale = 0
    for step in range(1, 12):
        for r in range(PLAN.world_size):
            chain.touch(r, rng.integers(0, PLAN.local_rows(r), 60), rng)
        chain.save(step)
        now = chain.snapshot()
        if saved is None or all(p.rows is None for p in chain.last_plans):
            saved = now
        else:
            for r, p in enumerate(chain.last_plans):
                assert len(p.rows) <= sum(math.ceil(0.2 * s.rows) for s in PLAN.shards_of(r))
                for name in saved[r]:
                    saved[r][name][p.rows] = now[r][name][p.rows]
        got, _ = chain.restore(step)
        _assert_state(got, saved, f"{rule} step {step}")
        stale += sum(int((g["weight"] != n["weight"]).any(axis=1).sum()) for g, n in zip(got, now))
    kinds = {m.kind for m in list_manifests(str(tmp_path))}
    assert kinds == {"full", "priority"} and stale > 0  # partial saves left changed rows behind


def test_inspect_and_export_pass_over_an_incrcp_step_whose_chain_file_is_gone(tmp_path, capsys):
    """A chain file no manifest lists (here the newest step's column) is part of whether its
    checkpoint can be read: `inspect` and `export` take the newest one that can, saying why
    they passed the newer one over, and `inspect --step` of the damaged one shows the error
    and exits 1."""
    from mpickpt.cli import main

    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy="incrcp", seed=11, incrcp_reset="never")
    _stream(chain, np.random.default_rng(11), 6, 10, 40)
    manifests = list_manifests(str(tmp_path))
    assert [m.step for m in manifests][-2:] == [5, 6]
    index = load_index(str(tmp_path), manifests[-1].chain, 0)
    gone = sorted({r.file for r in index.rectangle(6)} - {r.file for r in index.rectangle(5)})[0]
    os.remove(tmp_path / gone)
    folder = index_dir(str(tmp_path), manifests[-1].chain, 0)
    named_by = os.path.join(folder, f"index-{index.generation:08d}.json")
    why = (f"{named_by}: chunk index generation {index.generation} names missing files: "
           f"{tmp_path / gone}")
    assert main(["inspect", str(tmp_path)]) == 0
    got = capsys.readouterr()
    assert "\nstep         5\n" in got.out, got.out
    assert got.err.strip() == f"mpickpt: note: skipped checkpoint step 6: {why}; using step 5", \
        got.err
    assert main(["inspect", str(tmp_path), "--step", "6"]) == 1
    shown = capsys.readouterr().out
    assert "status       damaged (" in shown and "\nerror: " in shown and gone in shown, shown
    out = tmp_path.parent / f"{tmp_path.name}-model.h5"  # not inside the checkpoint directory
    assert main(["export", str(tmp_path), "-o", str(out)]) == 0
    assert capsys.readouterr().out.startswith("exported step 5") and out.exists()


def test_ls_keeps_its_columns_under_long_kind_names(tmp_path, capsys):
    from mpickpt import cli

    chain = LocalChain(str(tmp_path), PLAN, dim=3, policy="consecutive", seed=3)
    _stream(chain, np.random.default_rng(3), 3, 4, 30)
    assert cli.main(["ls", str(tmp_path)]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert {row.split()[1] for row in rows} == {"full", "consecutive"}, rows
    for column in ("RANKS", "FILES", "SIZE_MB"):  # right-aligned under their headings
        end = header.index(column) + len(column)
        assert all(row[end - 1] != " " and row[end] == " " for row in rows), (column, rows)
    assert all(row.index(row.split()[-1]) == header.index("STATUS") for row in rows), rows
