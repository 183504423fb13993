"""Background prefetching of a rank's batches with an exact reader state and an ``allow(n)`` bound.

A daemon thread calls ``source.read_slice`` ahead of the consumer and queues at most ``depth``
batches. The consumer-side `state()` is the position of the next batch `next()` will return, so a
checkpoint taken between batches records exactly what was consumed, whatever has been read ahead.

Gap control (Check-N-Run): ``allow(n)`` lets the consumer take only ``n`` more batches beyond those
delivered so far, and the producer read only ``read_ahead`` (0 by default) beyond those. With 0,
when the consumer has taken them nothing is in flight and nothing was read ahead, so the checkpoint
at that step neither waits for nor discards prefetched data; with the queue's depth (the trainer's),
the producer keeps its rhythm through the checkpoint instead of refilling the whole queue right
after it, and a stop after that checkpoint discards what was read ahead. Calling ``next()`` with
the allowance used up is a programming error and raises RuntimeError at once.
"""
from __future__ import annotations

import queue
import threading

from mpickpt.data.batch import Batch
from mpickpt.data.position import ReaderState
from mpickpt.data.source import SliceSource, local_slice

_POLL_S = 0.05
_JOIN_S = 5.0


class _Failure:
    """Queue item carrying an exception raised by the producer."""

    def __init__(self, error: BaseException):
        self.error = error


class _Gate:
    """How many reads the producer may do: shared by consumer and producer under one condition."""

    def __init__(self, bound: int | None, limit: int | None, ahead: int = 0):
        self.cond = threading.Condition()
        self.bound = bound  # total deliveries allowed so far (delivered + allowance); None = any
        self.ahead = ahead  # reads allowed beyond the bound
        self.limit = limit  # total reads ever (the reader's limit); None = until end of data
        self.produced = 0
        self.closed = False

    def acquire(self) -> bool:
        """Block until one more read is allowed; False once closed or at the limit. Local."""
        with self.cond:
            while not self.closed and self.bound is not None and \
                    self.produced >= self.bound + self.ahead:
                self.cond.wait()
            if self.closed or (self.limit is not None and self.produced >= self.limit):
                return False
            self.produced += 1
            return True

    def set_bound(self, bound: int | None) -> None:
        """Change the total number of reads allowed and wake the producer. Local."""
        with self.cond:
            self.bound = bound
            self.cond.notify_all()

    def close(self) -> None:
        """Stop granting reads and wake the producer. Local."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _put(items: queue.Queue, gate: _Gate, item) -> bool:
    """Queue ``item`` unless the reader closes first (then False). Local."""
    while not gate.closed:
        try:
            items.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False


def _produce(source: SliceSource, state: ReaderState, args: tuple[int, int, int],
             items: queue.Queue, gate: _Gate, place=None) -> None:
    """Producer thread body: read allowed slices into ``items``; end on None or an error. Local.

    Holds no reference to the PrefetchReader, so dropping the reader runs its ``__del__``.
    """
    try:
        if place is not None:
            place()
        while gate.acquire():
            batch, state = source.read_slice(state, *args)
            if not _put(items, gate, (batch, state)) or batch is None:
                return
    except BaseException as error:  # re-raised in the consumer's next()
        _put(items, gate, _Failure(error))


def _check_count(name: str, value, low: int, optional: bool) -> None:
    """Raise ValueError unless ``value`` is an int >= ``low`` (or None when optional). Local."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        expected = f"an integer >= {low}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")


class PrefetchReader:
    """One rank's batches from a `SliceSource`, read ahead by a daemon thread.

    ``state`` is the position of the first global batch to read; ``depth`` bounds the queue;
    ``limit`` (None = until the source ends) caps how many batches this reader delivers before
    `next()` returns None; ``allowance`` is the initial `allow` value (None = unbounded). Pass the
    allowance here rather than calling `allow` after construction when no read-ahead may happen.
    ``read_ahead``: batches the producer may read beyond the allowance (delivered only once `allow`
    raises it). ``place``: called on the producer thread when it starts (its cores: the whole
    share under a core split, `mpickpt.engine.core_split`).
    """

    def __init__(self, source: SliceSource, *, global_batch: int, rank: int, world: int,
                 state: ReaderState, depth: int = 4, limit: int | None = None,
                 allowance: int | None = None, read_ahead: int = 0, place=None):
        local_slice(global_batch, rank, world)
        _check_count("depth", depth, 1, optional=False)
        _check_count("limit", limit, 0, optional=True)
        _check_count("allowance", allowance, 0, optional=True)
        _check_count("read_ahead", read_ahead, 0, optional=False)
        self._state, self._delivered, self._limit = state, 0, limit
        self._ended, self._failure = False, None
        self._items: queue.Queue = queue.Queue(maxsize=depth)
        self._gate = _Gate(allowance, limit, read_ahead)
        self._thread = threading.Thread(
            target=_produce, args=(source, state, (global_batch, rank, world), self._items, self._gate,
                  place),
            name=f"mpickpt-prefetch-rank{rank}", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def delivered(self) -> int:
        """Batches returned by `next()` so far. Local."""
        return self._delivered

    def state(self) -> ReaderState:
        """Position of the next batch `next()` will return (after the last delivered one). Local."""
        return self._state

    def allow(self, n: int | None) -> None:
        """Let ``n`` more batches be delivered (and ``read_ahead`` more read) from now on; None
        removes the bound. Local.

        The producer never reads past the bound in force when it starts a read. Lowering a bound
        cannot un-read batches already queued: they stay queued and are delivered, in order, once
        allowed.
        """
        _check_count("allow(n)", n, 0, optional=True)
        self._gate.set_bound(None if n is None else self._delivered + n)

    def next(self) -> Batch | None:
        """The next batch, or None at the end of data or the limit. Local.

        Raises RuntimeError when the allowance is used up (call `allow` first) or after `close`,
        and re-raises any exception the source raised in the producer thread.
        """
        if self._closed:
            raise RuntimeError("PrefetchReader.next() called after close()")
        if self._failure is not None:
            raise self._failure
        if self._ended or (self._limit is not None and self._delivered >= self._limit):
            return None
        bound = self._gate.bound
        if bound is not None and self._delivered >= bound:
            raise RuntimeError(f"PrefetchReader allowance used up after {self._delivered} batches: "
                               f"call allow(n) before next()")
        return self._take(self._get())

    def _take(self, item) -> Batch | None:
        """Deliver one queue item: record the state, count it, or surface a failure. Local."""
        if isinstance(item, _Failure):
            self._failure = item.error
            raise item.error
        batch, state = item
        if batch is None:
            self._ended = True
            return None
        self._state, self._delivered = state, self._delivered + 1
        return batch

    def _get(self):
        """Wait for the producer's next item; RuntimeError if it died without one. Local."""
        while True:
            try:
                return self._items.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._items.empty():
                    raise RuntimeError("prefetch thread stopped without delivering a batch") from None

    def __iter__(self):
        """Yield batches until `next()` returns None. Local."""
        while (batch := self.next()) is not None:
            yield batch

    def close(self) -> None:
        """Stop the producer thread and drop queued batches; safe twice and from __del__. Local."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._gate.close()
        while True:
            try:
                self._items.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_S)

    def __enter__(self) -> PrefetchReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()
