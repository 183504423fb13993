"""PrefetchReader: same sequence as direct reads, exact restart state, allow(n) gap control, errors."""
import threading
import time

import pytest
import torch

from mpickpt.data import (Batch, CriteoFormatError, CriteoTSVConfig, CriteoTSVSource, PrefetchReader,
                          SyntheticConfig, SyntheticPosition, SyntheticStream, TSVPosition,
                          criteo_kaggle_sizes, position_from_dict)

GLOBAL, WORLD = 32, 4


class CountingSource:
    """Wraps a source and counts read_slice calls (thread-safe)."""

    def __init__(self, inner, fail_at=None):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0
        self.lock = threading.Lock()

    def read_slice(self, state, global_batch, rank, world):
        with self.lock:
            self.calls += 1
            if self.calls == self.fail_at:
                raise CriteoFormatError("day_7", 12, "label must be 0 or 1, got '5'")
        return self.inner.read_slice(state, global_batch, rank, world)


@pytest.fixture(scope="module")
def stream():
    return SyntheticStream(SyntheticConfig(table_sizes=criteo_kaggle_sizes(10_000), seed=5))


def direct(source, state, count, rank=1):
    out = []
    for _ in range(count):
        batch, state = source.read_slice(state, GLOBAL, rank, WORLD)
        out.append(batch)
    return out, state


def assert_same(a: Batch, b: Batch):
    assert torch.equal(a.dense, b.dense) and torch.equal(a.sparse, b.sparse)
    assert torch.equal(a.labels, b.labels)


def reader(source, state, **kwargs):
    return PrefetchReader(source, global_batch=GLOBAL, rank=1, world=WORLD, state=state, **kwargs)


def wait_for(predicate, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_sequence_equals_direct_reads(stream):
    expected, end = direct(stream, SyntheticPosition(sample_index=64), 10)
    with reader(stream, SyntheticPosition(sample_index=64), depth=3, limit=10) as r:
        got = list(r)
        assert r.delivered == 10 and r.state() == end and r.next() is None
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_restart_from_state_continues_exactly(stream):
    expected, _ = direct(stream, SyntheticPosition(), 9)
    first = reader(stream, SyntheticPosition(), depth=4)
    got = [first.next() for _ in range(4)]
    saved = first.state().to_dict()  # producer has read ahead; state is the consumer's
    assert saved == {"kind": "synthetic", "sample_index": 4 * GLOBAL}
    first.close()
    with reader(stream, position_from_dict(saved), limit=5) as second:
        got += list(second)
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_allow_bounds_delivery_and_reads(stream):
    counting = CountingSource(stream)
    expected, _ = direct(stream, SyntheticPosition(), 5)
    with reader(counting, SyntheticPosition(), depth=8, allowance=0) as r:
        time.sleep(0.05)
        assert counting.calls == 0
        r.allow(3)
        got = [r.next() for _ in range(3)]
        with pytest.raises(RuntimeError, match="allow"):
            r.next()
        time.sleep(0.05)
        assert counting.calls == 3 and r.state() == SyntheticPosition(sample_index=3 * GLOBAL)
        r.allow(2)
        got += [r.next(), r.next()]
        with pytest.raises(RuntimeError, match="allow"):
            r.next()
        r.allow(None)
        wait_for(lambda: counting.calls > 5)
        assert counting.calls > 5
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_producer_error_surfaces_in_next(stream):
    with reader(CountingSource(stream, fail_at=3), SyntheticPosition()) as r:
        assert r.next() is not None and r.next() is not None
        with pytest.raises(CriteoFormatError, match="day_7, line 12"):
            r.next()
        with pytest.raises(CriteoFormatError):
            r.next()
        assert r.delivered == 2


def test_tsv_end_of_data_and_bad_line(tmp_path):
    sizes = (1000,) * 26
    line = "1" + "\t7" * 13 + "\t0000abcd" * 26 + "\n"
    good = tmp_path / "good"
    good.write_text(line * (2 * GLOBAL + 5))
    src = CriteoTSVSource(CriteoTSVConfig(paths=(str(good),), table_sizes=sizes))
    with reader(src, TSVPosition()) as r:
        assert [b.size for b in r] == [GLOBAL // WORLD] * 2
        assert r.next() is None and r.state().sample_index == 2 * GLOBAL
    bad = tmp_path / "bad"
    bad.write_text(line * (GLOBAL // WORLD) + "oops\n" + line * GLOBAL)
    src = CriteoTSVSource(CriteoTSVConfig(paths=(str(bad),), table_sizes=sizes))
    with reader(src, TSVPosition()) as r:  # rank 1's slice holds line 9
        with pytest.raises(CriteoFormatError, match="line 9"):
            r.next()


def test_close_twice_and_after_close(stream):
    r = reader(stream, SyntheticPosition(), depth=1)
    r.next()
    r.close()
    r.close()
    assert not r._thread.is_alive()
    with pytest.raises(RuntimeError, match="close"):
        r.next()


def test_read_ahead_reads_past_the_allowance_but_delivers_only_within_it(stream):
    counting = CountingSource(stream)
    expected, _ = direct(stream, SyntheticPosition(), 4)
    with reader(counting, SyntheticPosition(), depth=8, allowance=2, read_ahead=1) as r:
        wait_for(lambda: counting.calls == 3)
        time.sleep(0.05)
        assert counting.calls == 3  # the allowance's 2 and one more
        got = [r.next(), r.next()]
        with pytest.raises(RuntimeError, match="allow"):
            r.next()  # the third was read but is not delivered
        assert r.state() == SyntheticPosition(sample_index=2 * GLOBAL)  # the consumer's
        r.allow(2)
        got += [r.next(), r.next()]
        wait_for(lambda: counting.calls == 5)
        time.sleep(0.05)
        assert counting.calls == 5
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_dropped_reader_stops_its_thread(stream):
    r = reader(stream, SyntheticPosition(), depth=1)
    thread = r._thread
    del r
    thread.join(timeout=2.0)
    assert not thread.is_alive()


@pytest.mark.parametrize("kwargs, word", [(dict(depth=0), "depth"), (dict(limit=-1), "limit"),
                                          (dict(allowance=-2), "allowance"),
                                          (dict(read_ahead=-1), "read_ahead")])
def test_rejects_bad_arguments(stream, kwargs, word):
    with pytest.raises(ValueError, match=word):
        reader(stream, SyntheticPosition(), **kwargs)
    with pytest.raises(ValueError, match="multiple"):
        PrefetchReader(stream, global_batch=30, rank=0, world=4, state=SyntheticPosition())


def test_place_runs_on_the_producer_thread_before_its_first_read(stream):
    """`place` (a core split's widening) runs once, on the producer thread, not the caller's."""
    placed = []
    with reader(stream, SyntheticPosition(), limit=3,
                place=lambda: placed.append(threading.get_ident())) as r:
        assert len(list(r)) == 3
    assert len(placed) == 1 and placed[0] != threading.get_ident()
