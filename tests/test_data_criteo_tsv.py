"""Raw Criteo TSV reader: parsing, errors with file and line, skip mode, positions, real rows."""
import csv
import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from mpickpt.data import (Batch, CriteoFormatError, CriteoTSVConfig, CriteoTSVSource, TSVPosition,
                          position_from_dict)

SIZES = tuple(range(101, 127))  # 26 distinct table sizes
SAMPLE = Path(__file__).parents[2] / "shared/data/criteo/sample_200.tsv"


def make_line(label, dense, cats) -> str:
    return "\t".join([str(label), *(str(x) for x in dense), *cats]) + "\n"


def hex_ids(k: int) -> list[str]:
    return [f"{(k * 7919 + t * 104729) * 2654435761 % (1 << 32):08x}" for t in range(26)]


def plain_line(k: int) -> str:
    return make_line(k % 2, [k + j for j in range(13)], hex_ids(k))


def write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(lines))
    return str(path)


def source(paths, skip=False) -> CriteoTSVSource:
    return CriteoTSVSource(CriteoTSVConfig(paths=tuple(paths), table_sizes=SIZES, skip_bad_lines=skip))


def assert_same(a: Batch, b: Batch):
    assert torch.equal(a.dense, b.dense) and torch.equal(a.sparse, b.sparse)
    assert torch.equal(a.labels, b.labels)


def test_known_values_empty_and_negative_fields(tmp_path):
    dense = [5, "", -3, 0, 1000, "", "", "", "", "", "", "", 1]
    cats = ["0000000a", "", *hex_ids(1)[2:]]
    path = write(tmp_path / "day_0", [make_line(1, dense, cats), make_line(0, [""] * 13, [""] * 26)])
    batch, pos = source([path]).read(TSVPosition(), 10)
    assert batch.size == 2 and batch.labels.tolist() == [1.0, 0.0]
    expected = [math.log1p(5), 0, 0, 0, math.log1p(1000)] + [0] * 7 + [math.log1p(1)]
    assert torch.allclose(batch.dense[0], torch.tensor(expected, dtype=torch.float32))
    assert batch.dense.dtype == torch.float32 and batch.dense[1].eq(0).all()
    want = [int(h, 16) % n if h else 0 for h, n in zip(cats, SIZES)]
    assert batch.sparse.shape == (2, 26, 1) and batch.sparse[0, :, 0].tolist() == want
    assert batch.sparse[1].eq(0).all()
    last = make_line(0, [""] * 13, [""] * 26).encode()
    assert pos == TSVPosition(byte_offset=os.path.getsize(path), line_number=3, sample_index=2,
                              tail_length=len(last), tail_crc=zlib.crc32(last))


@pytest.mark.parametrize("line, problem", [
    ("1\t2\t3\n", "found 3 tab-separated fields, expected 40"),
    (make_line(2, [1] * 13, hex_ids(0)), "label must be 0 or 1, got '2'"),
    (make_line(1, [1, 2, "x7"] + [1] * 10, hex_ids(0)),
     "I3 is not an integer of at most 18 digits: 'x7'"),
    (make_line(1, [1] * 12 + ["9" * 19], hex_ids(0)), "I13 is not an integer of at most 18 digits"),
    (make_line(0, [1] * 13, hex_ids(0)[:4] + ["zz12"] + hex_ids(0)[5:]), "C5 is not a hex id"),
    ("\n", "found 1 tab-separated fields"),
])
def test_malformed_line_names_file_line_and_problem(tmp_path, line, problem):
    path = write(tmp_path / "day_1", [plain_line(0), plain_line(1), line, plain_line(3)])
    src = source([path])
    with pytest.raises(CriteoFormatError) as info:
        src.read(TSVPosition(), 4)
    message = str(info.value)
    assert path in message and "line 3" in message and problem in message
    assert info.value.line_number == 3 and isinstance(info.value, ValueError)


def test_skip_mode_counts_bad_lines(tmp_path):
    bad_label = make_line(3, [1] * 13, hex_ids(2))
    lines = [plain_line(0), "garbage\n", plain_line(1), bad_label, plain_line(2)]
    path = write(tmp_path / "day", lines)
    batch, pos = source([path], skip=True).read(TSVPosition(), 10)
    clean_path = write(tmp_path / "clean", [plain_line(k) for k in range(3)])
    clean, _ = source([clean_path]).read(TSVPosition(), 9)
    assert_same(batch, clean)
    assert pos.bad_lines == 2 and pos.sample_index == 3 and pos.line_number == 6


def test_position_round_trip_equals_reading_all(tmp_path):
    path = write(tmp_path / "day", [plain_line(k) for k in range(10)])
    whole, end = source([path]).read(TSVPosition(), 10)
    first, pos = source([path]).read(TSVPosition(), 3)
    saved = pos.to_dict()
    assert position_from_dict(saved) == pos and TSVPosition.from_dict(saved) == pos
    rest, end2 = source([path]).read(TSVPosition.from_dict(saved), 100)
    assert_same(Batch.cat([first, rest]), whole)
    assert end2 == end


def test_a_saved_position_names_files_changed_since(tmp_path):
    """A position records its last line: a resume over the same files, or over a file that only
    grew, goes on; over a file changed before the position, shorter than it, or with fewer
    files, it names the file and line."""
    lines = [plain_line(k) for k in range(10)]
    day, other = tmp_path / "day_0", tmp_path / "day_1"
    write(day, lines)
    write(other, lines[:2])
    _, pos = source([day, other]).read(TSVPosition(), 6)
    assert pos.tail_length == len(lines[5]) and pos.line_number == 7
    saved = TSVPosition.from_dict(pos.to_dict())
    assert source([day, other]).changed_since(saved) is None
    write(day, lines + [plain_line(10)])  # appended after the position: the data it read stands
    assert source([day]).changed_since(saved) is None
    write(day, lines[:5] + [plain_line(99)] + lines[6:])  # the position's own last line
    with pytest.raises(CriteoFormatError, match=rf"{day}, line 6: this line differs"):
        raise source([day]).changed_since(saved)
    write(day, lines[:4] + [plain_line(5), plain_line(4)] + lines[6:])  # same bytes, reordered
    assert source([day]).changed_since(saved) is not None
    write(day, lines[:5])
    with pytest.raises(CriteoFormatError, match=rf"{day}, line 7: the file has \d+ bytes"):
        raise source([day]).changed_since(saved)
    second = TSVPosition(file_index=1, byte_offset=3, line_number=2, sample_index=11)
    with pytest.raises(CriteoFormatError, match=r"in data file 2, at line 2, but 1 file"):
        raise source([day]).changed_since(second)


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_lines_appended_to_a_file_without_a_last_line_end_are_read_on(tmp_path, ending):
    """A file that ended without a line end, then appended to (its last line completed first,
    as an editor or ``echo >>`` does): the resume skips that line end rather than reading it
    as an empty line, and its position still checks as unchanged."""
    lines = [plain_line(k) for k in range(6)]
    day = tmp_path / "day"
    write(day, lines[:4] + [lines[4].rstrip("\n")])
    src = source([day])
    _, pos = src.read(TSVPosition(), 10)
    assert pos.sample_index == 5 and src.completed_line(pos) == pos  # nothing appended yet
    write(day, lines[:4] + [lines[4].rstrip("\n"), ending, lines[5]])
    assert src.changed_since(pos) is None
    resumed = src.completed_line(pos)
    assert resumed.byte_offset == pos.byte_offset + len(ending)
    assert src.changed_since(resumed) is None and src.completed_line(resumed) == resumed
    batch, end = src.read(resumed, 10)
    clean, _ = source([write(tmp_path / "clean", lines[5:])]).read(TSVPosition(), 10)
    assert_same(batch, clean)
    assert end.sample_index == 6 and end.bad_lines == 0


def test_a_position_saved_without_its_last_line_still_loads(tmp_path):
    """Checkpoints written before positions recorded their last line resume unchecked."""
    path = write(tmp_path / "day", [plain_line(k) for k in range(10)])
    _, pos = source([path]).read(TSVPosition(), 4)
    old = {k: v for k, v in pos.to_dict().items() if not k.startswith("tail_")}
    loaded = position_from_dict(old)
    assert loaded.tail_length == 0 and loaded.byte_offset == pos.byte_offset
    write(Path(path), [plain_line(k + 1) for k in range(10)])
    assert source([path]).changed_since(loaded) is None
    with pytest.raises(ValueError, match="missing byte_offset"):
        position_from_dict({k: v for k, v in old.items() if k != "byte_offset"})


def test_multi_file_continuation(tmp_path):
    a = write(tmp_path / "day_0", [plain_line(k) for k in range(5)])
    b = write(tmp_path / "day_1", [plain_line(k) for k in range(5, 9)])
    c = write(tmp_path / "day_2", [plain_line(k) for k in range(9, 12)])
    joined = write(tmp_path / "all", [plain_line(k) for k in range(12)])
    whole, _ = source([joined]).read(TSVPosition(), 12)
    src, pos, parts = source([a, b, c]), TSVPosition(), []
    for count in (4, 4, 4):
        part, pos = src.read(pos, count)
        parts.append(part)
    assert_same(Batch.cat(parts), whole)
    assert pos.file_index == 2 and pos.sample_index == 12
    tail, end = src.read(pos, 5)
    assert tail.size == 0 and end == pos


def test_error_line_number_is_per_file(tmp_path):
    a = write(tmp_path / "day_0", [plain_line(0), plain_line(1)])
    b = write(tmp_path / "day_1", [plain_line(2), "bad\n"])
    with pytest.raises(CriteoFormatError, match=r"day_1, line 2"):
        source([a, b]).read(TSVPosition(), 4)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_read_slice_ranks_tile_global_batches(tmp_path, world):
    path = write(tmp_path / "day", [plain_line(k) for k in range(19)])
    src = source([path])
    whole, _ = src.read(TSVPosition(), 16)
    parts, state = [], TSVPosition()
    for _ in range(2):
        nexts = []
        for rank in range(world):
            part, nxt = src.read_slice(state, 8, rank, world)
            parts.append(part)
            nexts.append(nxt)
        assert all(n == nexts[0] for n in nexts)
        state = nexts[0]
    assert_same(Batch.cat(parts), whole)
    assert src.read_slice(state, 8, 0, world) == (None, state)  # 3 lines left: tail dropped


def test_skip_mode_slices_agree_across_ranks(tmp_path):
    good = [plain_line(k) for k in range(5)]
    lines = [good[0], "bad\n", good[1], good[2], "bad\n", good[3], good[4]]
    path = write(tmp_path / "day", lines)
    src = source([path], skip=True)
    (r0, s0), (r1, s1) = src.read_slice(TSVPosition(), 4, 0, 2), src.read_slice(TSVPosition(), 4, 1, 2)
    assert s0 == s1 and s0.bad_lines == 2 and s0.line_number == 7
    clean, _ = source([write(tmp_path / "clean", good[:4])]).read(TSVPosition(), 4)
    assert_same(Batch.cat([r0, r1]), clean)
    # the one valid line left (and the malformed one after it) make no global batch of 4
    assert src.read_slice(s0, 4, 0, 2) == (None, s0)
    assert src.leftover(s0, 4) == (1, 0) and src.leftover(TSVPosition(), 4) == (4, 2)
    tail = write(tmp_path / "tail", lines + ["bad\n"])
    assert source([tail], skip=True).leftover(s0, 4) == (1, 1)
    with pytest.raises(CriteoFormatError, match="line 8"):
        source([tail]).leftover(s0, 4)


def test_strict_mode_every_rank_raises_on_the_same_line(tmp_path):
    path = write(tmp_path / "day", [plain_line(0), plain_line(1), "bad\n", plain_line(3)])
    src = source([path])
    for rank in range(2):  # the bad line is in rank 1's slice; rank 0 must stop too
        with pytest.raises(CriteoFormatError, match="line 3"):
            src.read_slice(TSVPosition(), 4, rank, 2)


def test_config_checks(tmp_path):
    with pytest.raises(ValueError, match="26"):
        CriteoTSVConfig(paths=("x",), table_sizes=(10,) * 25)
    with pytest.raises(ValueError, match="at least one"):
        CriteoTSVConfig(paths=(), table_sizes=SIZES)
    missing = str(tmp_path / "nope.tsv")
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        source([missing])
    with pytest.raises(ValueError, match="not a regular file"):
        source([str(tmp_path)])
    packed = tmp_path / "day_0.gz"
    with gzip.open(packed, "wt") as f:
        f.write(plain_line(0) + "\n")
    with pytest.raises(ValueError, match=r"day_0.gz is compressed; expected plain tab-separated "
                                         r"text \(decompress it first"):
        source([str(packed)])


def test_unreadable_file_named(tmp_path, monkeypatch):
    path = write(tmp_path / "locked", [plain_line(0)])
    os.chmod(path, 0)
    if os.access(path, os.R_OK):  # root reads anything: pretend it cannot
        monkeypatch.setattr(os, "access", lambda p, mode: False)
    with pytest.raises(PermissionError, match="locked"):
        source([path])


@pytest.mark.skipif(not SAMPLE.exists(), reason="shared Criteo sample not present")
def test_real_sample_matches_csv():
    config = CriteoTSVConfig(paths=(str(SAMPLE),), table_sizes=SIZES)
    batch, pos = CriteoTSVSource(config).read(TSVPosition(), 500)
    assert batch.size == 200 and pos.sample_index == 200 and pos.bad_lines == 0
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    with open(SAMPLE.with_suffix(".csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 200
    labels = [float(r["label"]) for r in rows]
    dense = [[math.log1p(max(float(r[f"I{k}"] or 0), 0)) for k in range(1, 14)] for r in rows]
    sparse = [[int(r[f"C{k}"], 16) % n if r[f"C{k}"] else 0 for k, n in zip(range(1, 27), SIZES)]
              for r in rows]
    assert batch.labels.tolist() == labels
    assert np.allclose(batch.dense.numpy(), np.array(dense), rtol=1e-6)
    assert batch.sparse[:, :, 0].tolist() == sparse
