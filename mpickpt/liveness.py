"""PeerWatch: every rank learns within seconds that a peer died, and which one.

The collectives of a job do not say it: MPICH's collectives wait forever for a dead peer, gloo and
NCCL for their timeouts (minutes), and a launcher that kills every rank when one dies leaves
nothing to learn. So the ranks form a ring of TCP connections of their own (addresses agreed over
the control channel at start): each rank watches its two neighbours on a background thread, sends
a heartbeat every `HEARTBEAT` seconds and expects one within `timeout`. A neighbour whose
connection closes (the kernel closes a killed process's sockets at once) or falls silent (its
node is gone) is dead.
The rank that sees a death tells its other neighbour, which passes the word on around the ring,
so every survivor knows within a few round trips. A rank that ends normally says goodbye first,
so its neighbours do not mistake a finished job for a dead peer.

`on_death(dead_ranks)` runs on the watch thread of every survivor. Local after the collective
construction.
"""
from __future__ import annotations

import os
import re
import select
import socket
import threading
import time

HEARTBEAT = 0.5
"""Seconds between heartbeats on each connection."""
DEFAULT_TIMEOUT = 10.0
"""Seconds of silence after which a neighbour counts as dead (its node is gone)."""
_BEAT, _BYE, _DEAD = b"h", b"b", b"d"
_DEAD_RE = re.compile(rb"d([0-9,]+);")


class PeerWatch:
    """The watch of one rank: its ring connections and the thread that watches them."""

    def __init__(self, control, on_death=None, timeout: float = DEFAULT_TIMEOUT):
        """Collective over `control` (the topology's control channel): listen, agree on
        addresses, connect to the next rank, accept the previous one, start the watch thread."""
        self.rank, self.size = control.Get_rank(), control.Get_size()
        self.on_death, self.timeout = on_death, timeout
        self.dead: set[int] = set()
        self.finished: set[int] = set()  # said goodbye: their closing is no death
        self.how = ""
        self.closed = False
        self._heard = threading.Event()
        self._lock = threading.Lock()
        self.links: list[tuple[int, socket.socket]] = []
        if self.size > 1:
            self._connect(control)
            self._thread = threading.Thread(target=self._watch, name="mpickpt-peer-watch",
                                            daemon=True)
            self._thread.start()

    # ---- setup -----------------------------------------------------------------------------
    def _connect(self, control) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen(2)
        addresses = control.allgather((_host(), listener.getsockname()[1]))
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        out = socket.create_connection(addresses[nxt], timeout=60)
        out.sendall(self.rank.to_bytes(4, "little"))
        listener.settimeout(60)
        inc, _ = listener.accept()
        who = int.from_bytes(_recv_exact(inc, 4), "little")
        listener.close()
        assert who == prev, (who, prev)
        self.links = [(nxt, out), (prev, inc)]  # with two ranks, both lead to the other one
        for _, sock in self.links:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        control.Barrier()

    # ---- the watch thread --------------------------------------------------------------------
    def _watch(self) -> None:
        last = {peer: time.monotonic() for peer, _ in self.links}
        next_beat = 0.0
        while not self.closed:
            now = time.monotonic()
            if now >= next_beat:
                self._broadcast(_BEAT)
                next_beat = now + HEARTBEAT
            live = self._live()
            if not live:
                return
            readable, _, _ = select.select([s for _, s in live], [], [], HEARTBEAT / 2)
            for peer, sock in [(p, s) for p, s in live if s in readable]:
                if (peer, sock) not in self._live():
                    continue  # it said goodbye on its other connection
                message = _read(sock)
                if message is None:
                    self._died({peer}, "its connection closed")
                    continue
                last[peer] = time.monotonic()
                self._handle(peer, message)
            for peer, seen in last.items():
                if any(p == peer for p, _ in self._live()) and \
                        time.monotonic() - seen > self.timeout:
                    self._died({peer}, f"silent for {self.timeout:.0f} s")

    def _live(self) -> list:
        """The connections still watched: neither dead nor finished."""
        with self._lock:
            return [(p, s) for p, s in self.links if p not in self.dead | self.finished]

    def _handle(self, peer: int, message: bytes) -> None:
        for ranks in _DEAD_RE.findall(message):
            self._died({int(r) for r in ranks.split(b",") if r}, f"reported by rank {peer}")
        if _BYE in message:
            with self._lock:  # it finished: its closing connection is not a death
                self.finished.add(peer)

    def _died(self, ranks: set[int], how: str) -> None:
        with self._lock:
            new = set(ranks) - self.dead - {self.rank}
            if not new or self.closed:  # past close, this rank's own work is done
                return
            self.dead |= new
            self.how = how
        self._broadcast(_DEAD + ",".join(str(r) for r in sorted(self.dead)).encode() + b";")
        self._heard.set()
        if self.on_death is not None:
            self.on_death(set(self.dead))

    def _broadcast(self, message: bytes, to_finished: bool = False) -> None:
        with self._lock:
            targets = [s for p, s in self.links
                       if p not in self.dead and (to_finished or p not in self.finished)]
        for sock in targets:
            try:
                sock.send(message)
            except OSError:
                pass  # its death shows up as a closed connection

    # ---- the main thread's side ----------------------------------------------------------------
    def wait_for_death(self, timeout: float) -> set[int]:
        """The dead ranks once one is known, waiting up to `timeout` s; empty if none. Local."""
        self._heard.wait(timeout)
        return set(self.dead)

    def close(self, goodbye: bool = True) -> None:
        """Say goodbye to the neighbours and stop watching. Local. Safe twice.

        `goodbye=False` leaves as a failed rank does (the neighbours count it dead): for a rank
        that ends on an error of its own while its peers still need it."""
        if self.closed:
            return
        with self._lock:
            self.closed = True
        if goodbye:  # every neighbour hears it, those that already said goodbye too: their
            # watch threads may still be reading, and a connection closing unannounced is a death
            self._broadcast(_BYE, to_finished=True)
        for _, sock in self.links:
            try:  # the end of the stream follows the goodbye, not a reset that may overtake it
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        time.sleep(HEARTBEAT / 10)
        for _, sock in self.links:
            try:
                sock.close()
            except OSError:
                pass


def _host() -> str:
    """An address the other ranks can reach this host at (override: MPICKPT_MASTER_ADDR, as for
    the training process group's rendezvous)."""
    name = os.environ.get("MPICKPT_MASTER_ADDR") or socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"


def _recv_exact(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed during the watch handshake")
        data += chunk
    return data


def _read(sock) -> bytes | None:
    """What arrived (None: the connection closed or was reset). Local."""
    try:
        data = sock.recv(4096)
    except BlockingIOError:
        return b""
    except OSError:
        return None
    return data or None
