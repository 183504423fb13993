"""Packed shard files (format 3): one dataset per row array for all of a file's tables, the
tables' row ranges in ``rows/tables``. Written by the real writer in process, read back by every
reader path (restore's `load_rows`, `export`, IncrCP's column references), and compared with
files in the per-table layout of format 2, which the readers still read."""
from __future__ import annotations

from dataclasses import asdict

import h5py
import numpy as np
import pytest

from mpickpt.engine.writer_process import write_file
from mpickpt.model.shard_plan import Shard, ShardPlan
from mpickpt.quant.codecs import Codec
from mpickpt.store import h5_lowlevel
from mpickpt.store.file_spec import FileSpec, shard_attrs, shard_specs
from mpickpt.store.segments import Segment, load_rows
from mpickpt.store.shard_file import open_shard, verify_file
from mpickpt.store.tables import table_pieces

SIZES = [70_000, 300, 5, 90_000, 1_000, 17, 40_000, 2]
DIM = 4
NAMES = ["weight", "state/adagrad_sum"]
TEMPLATES = {"weight": ((DIM,), np.float32), "state/adagrad_sum": ((), np.float32)}


def rank_arrays(plan: ShardPlan, rank: int) -> tuple[np.ndarray, dict]:
    gids = plan.rank_global_ids(rank)
    rng = np.random.default_rng(rank)
    return gids, {"gids": gids, "weight": rng.standard_normal((len(gids), DIM), np.float32),
                  "state/adagrad_sum": rng.random(len(gids), np.float32)}


def write_packed(root, plan, rank, selected=None, parts=1, codecs=None) -> list[str]:
    gids, arrays = rank_arrays(plan, rank)
    specs = shard_specs(str(root), plan, rank, gids, NAMES, lambda j: f"packed-{rank}-{j}.h5",
                        "shard", lambda j: shard_attrs(7, "full", "fp32", rank, j, parts, 2),
                        selected=selected, codecs=codecs, parts=parts)
    for spec in specs:
        write_file(spec, arrays)
    return [spec.relpath for spec in specs]


def write_per_table(root, plan, rank, selected=None) -> str:
    """One file in format 2's layout: a group ``tables/<t>`` per table with gid_min/gid_max."""
    gids, arrays = rank_arrays(plan, rank)
    spec = FileSpec(str(root), f"per-table-{rank}.h5", "shard", rank, 0,
                    shard_attrs(7, "full", "fp32", rank, 0, 1, 2))
    for s in plan.shards_of(rank):
        rows = np.arange(s.local_start, s.local_start + s.rows)
        if selected is not None:
            rows = rows[np.isin(rows, selected)]
        if len(rows) == 0:
            continue
        group = f"tables/{s.table}"
        spec.group_attrs[group] = {"gid_min": int(gids[rows[0]]), "gid_max": int(gids[rows[-1]])}
        spec.datasets += [(f"{group}/{name}", name, rows) for name in ["gids", *NAMES]]
    write_file(spec, arrays)
    return spec.relpath


def loaded(root, files, plan, rank, **kw):
    return load_rows(str(root), [Segment(rel, order=7) for rel in files], plan, rank, TEMPLATES,
                     7, **kw)


@pytest.fixture
def plan():
    return ShardPlan.build(SIZES, 2)


@pytest.mark.parametrize("parts", [1, 3])
def test_a_packed_shard_reads_back_exactly_and_has_few_objects(tmp_path, plan, parts):
    for rank in range(2):
        files = write_packed(tmp_path, plan, rank, parts=parts)
        _, arrays = rank_arrays(plan, rank)
        rows = loaded(tmp_path, files, plan, rank)
        for name in NAMES:
            np.testing.assert_array_equal(rows[name], arrays[name])
        for rel in files:
            assert verify_file(str(tmp_path / rel)) == []
            with h5py.File(tmp_path / rel, "r") as f:
                objects = []
                f.visit(objects.append)
                pieces = table_pieces(f)
            # rows, rows/state, 3 datasets + their CRCs, the attribute digest and its CRC
            assert len(objects) == 10, objects
            assert [p.table for p in pieces] == sorted(p.table for p in pieces)
            assert pieces[0].start == 0 and all(p.stop == q.start
                                                for p, q in zip(pieces, pieces[1:]))


def test_the_per_table_layout_of_format_2_reads_the_same(tmp_path, plan):
    selected = np.arange(0, plan.local_rows(1), 3)
    for sel in (None, selected):
        old = loaded(tmp_path, [write_per_table(tmp_path, plan, 1, sel)], plan, 1,
                     complete=sel is None, with_steps=True)
        new = loaded(tmp_path, write_packed(tmp_path, plan, 1, sel), plan, 1,
                     complete=sel is None, with_steps=True)
        for name in NAMES:
            np.testing.assert_array_equal(old[0][name][old[1] == 7], new[0][name][new[1] == 7])
        np.testing.assert_array_equal(old[1], new[1])
        assert (new[1] == 7).sum() == (plan.local_rows(1) if sel is None else len(sel))
        with open_shard(str(tmp_path / "per-table-1.h5")) as f_old, \
                open_shard(str(tmp_path / "packed-1-0.h5")) as f_new:
            a, b = table_pieces(f_old), table_pieces(f_new)
            assert [(p.table, p.rows, p.gid_min, p.gid_max) for p in a] == \
                [(p.table, p.rows, p.gid_min, p.gid_max) for p in b]
            assert not a[0].packed and b[0].packed


def test_a_selected_quantized_save_keeps_each_tables_rows(tmp_path, plan):
    selected = np.sort(np.random.default_rng(3).choice(plan.local_rows(0), 5_000, replace=False))
    files = write_packed(tmp_path, plan, 0, selected,
                         codecs={"weight": asdict(Codec("asym", 8))})
    rows, steps = loaded(tmp_path, files, plan, 0, complete=False, with_steps=True)
    _, arrays = rank_arrays(plan, 0)
    assert np.array_equal(np.nonzero(steps == 7)[0], selected)
    np.testing.assert_array_equal(rows["state/adagrad_sum"][selected],
                                  arrays["state/adagrad_sum"][selected])
    err = np.abs(rows["weight"][selected] - arrays["weight"][selected]).max()
    assert 0 < err < 0.02  # quantized: close, not equal
    with open_shard(str(tmp_path / files[0])) as f:
        counts = {p.table: p.rows for p in table_pieces(f)}
    owner_tables = {s.table: s for s in plan.shards_of(0)}
    for t, s in owner_tables.items():
        want = int(np.count_nonzero((selected >= s.local_start) &
                                    (selected < s.local_start + s.rows)))
        assert counts.get(t, 0) == want


@pytest.mark.parametrize("parts", [1, 3])
def test_rows_staged_compactly_write_the_files_rows_staged_in_place_write(tmp_path, plan, parts):
    """The CPU stall stages an incremental save's rows compactly (`Snapshotter.compact`): the
    k-th selected row at row k of each row array, the keys left in their places. Each part then
    reads one slice of the row arrays, and its file holds what a gather of the rows in their
    places writes, quantized rows included."""
    selected = np.sort(np.random.default_rng(4).choice(plan.local_rows(0), 9_000, replace=False))
    gids, arrays = rank_arrays(plan, 0)
    compact = {**arrays, **{n: np.zeros_like(arrays[n]) for n in NAMES}}
    for n in NAMES:  # rows past the selected ones hold stale values nobody may read
        compact[n][len(selected):] = 9
        compact[n][:len(selected)] = arrays[n][selected]
    codecs = {"weight": asdict(Codec("asym", 8))}
    contents = {}
    for mode, staged in (("placed", arrays), ("compact", compact)):
        specs = shard_specs(str(tmp_path), plan, 0, gids, NAMES, lambda j: f"{mode}-{j}.h5",
                            "shard", lambda j: shard_attrs(7, "full", "fp32", 0, j, parts, 2),
                            selected=selected, codecs=codecs, parts=parts,
                            compact=mode == "compact")
        if mode == "compact":
            for spec in specs:  # one slice per row array, a gather for the keys alone
                ranges = {src: rows for _, src, rows in spec.datasets}
                assert isinstance(ranges["gids"], np.ndarray)
                assert all(isinstance(ranges[n], list) and len(ranges[n]) == 1 for n in NAMES)
        for spec in specs:
            write_file(spec, staged)
        contents[mode] = [_datasets(str(tmp_path / spec.relpath)) for spec in specs]
    assert contents["placed"] == contents["compact"]
    rows, steps = loaded(tmp_path, [f"compact-{j}.h5" for j in range(parts)], plan, 0,
                         complete=False, with_steps=True)
    assert np.array_equal(np.nonzero(steps == 7)[0], selected)
    np.testing.assert_array_equal(rows["state/adagrad_sum"][selected],
                                  arrays["state/adagrad_sum"][selected])


def test_the_cpu_stall_stages_selected_rows_compactly_and_says_so():
    """`Snapshotter.stage` on the CPU: every row in its place for a full save, the selected
    rows compactly for an incremental one (rows that require grad included), and with a
    copy-on-update copier nothing compact (the copier puts rows in their places)."""
    from types import SimpleNamespace

    import torch

    from mpickpt.engine.snapshot import Snapshotter

    rng = np.random.default_rng(6)
    weight = torch.tensor(rng.standard_normal((500, DIM)), dtype=torch.float32,
                          requires_grad=True)
    state = torch.tensor(rng.random(500), dtype=torch.float32)
    model = SimpleNamespace(
        topo=SimpleNamespace(device=torch.device("cpu")),
        embeddings=SimpleNamespace(local_gids=np.arange(1000, 1500)),
        row_state=lambda: {"weight": weight, "state/adagrad_sum": state},
        dense_state=lambda: {})
    snaps = Snapshotter(model, with_dense=False)
    try:
        snaps.stage()
        staged = snaps.area.arrays
        assert not snaps.compact
        np.testing.assert_array_equal(staged["weight"], weight.detach().numpy())
        selected = np.sort(rng.choice(500, 120, replace=False))
        _, nbytes = snaps.stage(selected=selected)
        assert snaps.compact and nbytes == 120 * (DIM + 1) * 4
        np.testing.assert_array_equal(staged["weight"][:120], weight.detach().numpy()[selected])
        np.testing.assert_array_equal(staged["state/adagrad_sum"][:120], state.numpy()[selected])
        np.testing.assert_array_equal(staged["gids"], np.arange(1000, 1500))  # keys in place
        started = []
        copier = SimpleNamespace(start=lambda rows, targets, sel: started.append(sel))
        snaps.stage(copier, selected)
        assert not snaps.compact and started[0] is selected
    finally:
        snaps.close()


def _datasets(path: str) -> dict:
    """Every dataset's bytes and every attribute of the file at `path`, by name."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            attrs = {k: np.asarray(v).tobytes() for k, v in obj.attrs.items()}
            out[name] = (obj[()].tobytes() if isinstance(obj, h5py.Dataset) else None, attrs)
        f.visititems(visit)
    return out


def test_a_whole_packed_shard_is_read_once_straight_into_place(tmp_path, plan, monkeypatch):
    files = write_packed(tmp_path, plan, 0)
    reads = []
    real = h5_lowlevel.read_slab

    def counting(ds_id, a, b, out=None):
        reads.append((h5py.h5i.get_name(ds_id).decode(), a, b, out is not None))
        return real(ds_id, a, b, out)

    monkeypatch.setattr(h5_lowlevel, "read_slab", counting)
    n = plan.local_rows(0)
    into = {"weight": np.zeros((n, DIM), np.float32), "state/adagrad_sum": np.zeros(n, np.float32)}
    loaded(tmp_path, files, plan, 0, into=into)
    data = [r for r in reads if r[0].startswith("/rows/") and not r[0].endswith(".crc")]
    assert sorted(data) == [("/rows/gids", 0, n, False), ("/rows/state/adagrad_sum", 0, n, True),
                            ("/rows/weight", 0, n, True)]
    np.testing.assert_array_equal(into["weight"], rank_arrays(plan, 0)[1]["weight"])


def test_a_piece_list_that_does_not_tile_the_rows_is_an_error_naming_the_group(tmp_path, plan):
    [rel] = write_packed(tmp_path, plan, 1)
    with h5py.File(tmp_path / rel, "r+") as f:
        lines = f["rows"].attrs["tables"]
        lines[-1, 2] -= 1  # the last table ends a row early
        f["rows"].attrs["tables"] = lines
    with h5py.File(tmp_path / rel, "r") as f, pytest.raises(ValueError, match=r"/rows: its "
                                                             r"tables' rows end at"):
        table_pieces(f)


def test_column_refs_point_into_the_packed_group(tmp_path, plan):
    from mpickpt.incrcp.extractor_process import column_refs
    from mpickpt.store.file_spec import column_relpath

    gids, arrays = rank_arrays(plan, 0)
    selected = np.arange(0, plan.local_rows(0), 7)
    [spec] = shard_specs(str(tmp_path), plan, 0, gids, NAMES,
                         lambda j: column_relpath("c1", 0, 7, j), "chunk",
                         lambda j: shard_attrs(7, "incrcp", "fp32", 0, j, 1, 2), selected=selected)
    write_file(spec, arrays)
    refs = column_refs(str(tmp_path), "c1", 0, 7, 1)
    assert {r.group for r in refs} == {"rows"} and sum(r.rows for r in refs) == len(selected)
    with h5py.File(spec.path, "r") as f:
        for r in refs:
            got = f["rows/gids"][r.start:r.stop]
            assert (got[0], got[-1]) == (r.gid_min, r.gid_max)
            assert np.all(plan.split_global(got)[0] == r.table)


DENSE = {"param/bot.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
         "param/bot.0.bias": np.array([1.5, -2.0, 3.25], dtype=np.float32),
         "opt/0/step": np.array(7.0, dtype=np.float32),
         "opt/0/sum": np.full((3, 4), 0.5, dtype=np.float64),
         "opt/1/count": np.array([3], dtype=np.int64)}


def test_a_packed_dense_file_reads_back_every_array_exactly(tmp_path):
    from mpickpt.store import dense_file
    from mpickpt.store.file_spec import dense_spec

    spec = dense_spec(str(tmp_path), "step-1", 1,
                      {k: (v.shape, str(v.dtype)) for k, v in DENSE.items()}, ["bot.0.weight"])
    write_file(spec, {f"dense/{k}": v for k, v in DENSE.items()})
    with open_shard(spec.path) as f:
        got = dense_file.dense_arrays(f, spec.path)
        listing = dense_file.dense_listing(f, spec.path)
        objects = []
        f.visit(objects.append)
    assert list(got) == list(DENSE) and len(objects) == 5, objects
    for name, value in DENSE.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value)
    assert listing == [(k, v.shape, str(v.dtype)) for k, v in DENSE.items()]
    assert verify_file(spec.path) == []


def test_a_per_array_dense_file_of_format_2_reads_the_same(tmp_path):
    from mpickpt.store import dense_file

    spec = FileSpec(str(tmp_path), "dense.h5", "dense", 0, 0, {"step": 1},
                    datasets=[(f"dense/{k}", k, None) for k in DENSE])
    write_file(spec, DENSE)
    with open_shard(spec.path) as f:
        got = dense_file.dense_arrays(f, spec.path)
        listing = dense_file.dense_listing(f, spec.path)
    assert sorted(got) == sorted(DENSE)
    for name, value in DENSE.items():
        np.testing.assert_array_equal(got[name], value)
        assert got[name].shape == value.shape, name
    assert sorted(listing) == sorted((k, v.shape, str(v.dtype)) for k, v in DENSE.items())


def test_a_dense_index_outside_the_pack_is_an_error_naming_the_file(tmp_path):
    from mpickpt.store import dense_file
    from mpickpt.store.file_spec import dense_spec

    spec = dense_spec(str(tmp_path), "step-1", 1,
                      {k: (v.shape, str(v.dtype)) for k, v in DENSE.items()}, [])
    write_file(spec, {f"dense/{k}": v for k, v in DENSE.items()})
    with h5py.File(spec.path, "r+") as f:
        f["dense"].attrs["arrays"] = f["dense"].attrs["arrays"].replace("[3, 4], 0]",
                                                                        "[300, 4], 0]")
    with h5py.File(spec.path, "r") as f, pytest.raises(ValueError, match=r"dense arrays "
                                                        r"\['param/bot.0.weight'\] lie outside"):
        dense_file.dense_arrays(f, spec.path)


def by_gid(gids: np.ndarray, version: int) -> dict:
    """Row values that name their global id and the step that wrote them."""
    return {"gids": gids,
            "weight": (gids[:, None] * 10 + np.arange(DIM) + version * 1e6).astype(np.float32),
            "state/adagrad_sum": (gids + version * 1e6).astype(np.float32)}


def write_plan(root, plan, tag, version, parts=1, every=1) -> list[str]:
    """Every rank's packed files under `plan`, of every `every`-th local row."""
    files = []
    for rank in range(plan.world_size):
        gids = plan.rank_global_ids(rank)
        sel = None if every == 1 else np.arange(0, len(gids), every)
        specs = shard_specs(str(root), plan, rank, gids, NAMES,
                            lambda j, r=rank: f"{tag}-{r}-{j}.h5", "shard",
                            lambda j, r=rank: shard_attrs(version, "full", "fp32", r, j, parts,
                                                          plan.world_size),
                            selected=sel, parts=parts)
        for spec in specs:
            write_file(spec, by_gid(gids, version))
        files += [spec.relpath for spec in specs]
    return files


@pytest.mark.parametrize("parts", [1, 3])
def test_any_plan_reads_rows_written_under_another_with_newer_layers_winning(tmp_path, parts):
    old = ShardPlan.build(SIZES, 2)
    base = write_plan(tmp_path, old, "base", 7, parts)
    newer = write_plan(tmp_path, old, "newer", 8, parts, every=3)
    for plan in (ShardPlan.build(SIZES, 3), ShardPlan.build(SIZES, 1), old,
                 ShardPlan.from_shards(SIZES, 2, _reversed_shards(old))):
        for rank in range(plan.world_size):
            segs = [Segment(rel, order=7) for rel in base] + \
                [Segment(rel, order=8) for rel in newer]
            rows, steps = load_rows(str(tmp_path), segs[::-1] if rank % 2 else segs, plan,
                                    rank, TEMPLATES, 8, with_steps=True)
            gids = plan.rank_global_ids(rank)
            _, written_at = old.owner_of(gids)  # the local row each was written from
            want_steps = np.where(written_at % 3 == 0, 8, 7)
            np.testing.assert_array_equal(steps, want_steps)
            for version in (7, 8):
                mask = want_steps == version
                want = by_gid(gids[mask], version)
                for name in NAMES:
                    np.testing.assert_array_equal(rows[name][mask], want[name])


def _reversed_shards(plan: ShardPlan) -> list[Shard]:
    """The same shards, each rank's tables in reverse local order (a fused module's order)."""
    out = []
    for rank in range(plan.world_size):
        at = 0
        for s in reversed(plan.shards_of(rank)):
            out.append(Shard(s.table, s.row_start, s.row_end, rank, at))
            at += s.rows
    return out


def test_a_file_with_two_shards_of_one_table_verifies_and_exports(tmp_path):
    from types import SimpleNamespace

    from mpickpt.checkpoint.export import assemble_table
    from mpickpt.checkpoint.verify import table_gids
    from mpickpt.checkpoint.verify_session import VerifySession

    sizes = [100, 50]  # rank 0 holds table 0's rows 0..39 and 70..99, apart
    shards = [Shard(0, 0, 40, 0, 0), Shard(1, 0, 50, 0, 40), Shard(0, 70, 100, 0, 90),
              Shard(0, 40, 70, 1, 0)]
    plan = ShardPlan.from_shards(sizes, 2, shards)
    files = write_plan(tmp_path, plan, "two", 7)
    with open_shard(str(tmp_path / files[0])) as f:
        assert [p.table for p in table_pieces(f)] == [0, 1, 0]
    session = VerifySession()
    try:
        gids, problems = table_gids(str(tmp_path / files[0]), 0, 0, 100, session)
    finally:
        session.close()
    assert problems == [] and sorted(gids.tolist()) == list(range(40)) + list(range(70, 100))
    manifest = SimpleNamespace(plan={"table_sizes": sizes}, step=7)
    got = assemble_table(manifest, 0, [str(tmp_path / r) for r in files for _ in (0, 1)], NAMES)
    np.testing.assert_array_equal(got["weight"], by_gid(np.arange(100), 7)["weight"])


def test_dense_files_of_repeated_and_changed_shapes_each_read_back_exactly(tmp_path):
    """The dense layout is laid out once per set of shapes and reused: a second save with the
    same shapes, then one whose shapes and order changed (an optimizer state appearing, a
    resized layer), each get their own layout, not a stale one."""
    from mpickpt.store import dense_file
    from mpickpt.store.file_spec import dense_spec

    changed = {"opt/1/count": np.array([3, 4], dtype=np.int64),
               "param/bot.0.weight": np.arange(15, dtype=np.float32).reshape(5, 3),
               "param/bot.0.bias": np.ones(5, dtype=np.float32)}
    for step, arrays in enumerate([DENSE, DENSE, changed], start=1):
        spec = dense_spec(str(tmp_path), f"step-{step}", step,
                          {k: (v.shape, str(v.dtype)) for k, v in arrays.items()},
                          [k[len("param/"):] for k in arrays if k.startswith("param/")])
        write_file(spec, {f"dense/{k}": v for k, v in arrays.items()})
        with open_shard(spec.path) as f:
            got = dense_file.dense_arrays(f, spec.path)
        assert list(got) == list(arrays), step
        for name, value in arrays.items():
            assert got[name].dtype == value.dtype, (step, name)
            np.testing.assert_array_equal(got[name], value)
