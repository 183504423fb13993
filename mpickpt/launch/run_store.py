"""The rendezvous store of one run, hosted by `mpickpt-run` beside the launcher, and its watch on
the node agents.

Why here: the store must outlive every trainer and every node agent of the run (a replacement, a
hot spare and the survivors meet there after a death). `mpickpt-run` runs next to the launcher
(mpiexec, mpirun or srun), and when that process dies the run dies with it under every launcher,
so a store hosted by it lives exactly as long as anything of the run can. A store hosted by a
rank's agent (launcher rank 0's, before) ended the job with that node; a store hosted again
elsewhere after its host's death would need every survivor to agree on the new host without a
store, for a lifetime no longer than the launcher's.

The agent watch: every node agent opens one plain TCP connection to `AgentWatch` and says its
launcher rank; it says goodbye before it ends normally. A connection that closes without the
goodbye is an agent that died (killed, or its node lost): its trainer died with it (the agent
starts its trainer with a parent-death signal), and no respawn can come for that rank. The watch
records `agent_lost/<rank>` at the store, so that the survivors forming the next generation do
not wait for that respawn: a spare takes the rank, or the job falls back to a relaunch at once.
Local: one thread of `mpickpt-run`.
"""
from __future__ import annotations

import selectors
import socket
import threading
import time

from mpickpt.job_variables import AGENTS_VARIABLE, STORE_VARIABLE

COMPLETED_KEY = "completed"
"""Set at the store by rank 0 once the training ended normally (the last step trained, the
final checkpoint and test done): the run is done whatever status the launcher reports."""
_GOODBYE = b"bye\n"
SELECT_S = 0.2
"""How long the agent watch waits for a connection or data before looking at its stop flag."""


class RunStore:
    """The store and the agent watch of one run. Local; `close()` when the run ended."""

    def __init__(self, timeout_s: float | None = None):
        from mpickpt.generation import STORE_TIMEOUT_S, host_store

        timeout_s = STORE_TIMEOUT_S if timeout_s is None else timeout_s
        self.store, self.address = host_store(timeout_s)
        self.watch = AgentWatch(self.address, timeout_s)

    def environment(self) -> dict[str, str]:
        """The variables that point the run's agents and trainers here. Local."""
        return {STORE_VARIABLE: self.address, AGENTS_VARIABLE: self.watch.address}

    def completed(self) -> str | None:
        """The step the training completed at, as rank 0 said, or None. Local."""
        if not self.store.check([COMPLETED_KEY]):
            return None
        return self.store.get(COMPLETED_KEY).decode()

    def lost_agents(self) -> list[int]:
        """Launcher ranks whose agent died during the run. Local."""
        return sorted(self.watch.lost)

    def close(self) -> None:
        self.watch.close()
        self.store = None


class AgentWatch:
    """A TCP listener that knows which node agents are alive (see the module). Without a store
    (`store_address` None: not in place) it only counts the agents that started; `timeout_s`
    bounds its store client's calls (needed with a store). Local."""

    def __init__(self, store_address: str | None = None, timeout_s: float | None = None):
        from mpickpt.generation import rendezvous_host

        if store_address is not None and timeout_s is None:
            raise ValueError(f"AgentWatch({store_address!r}): a store needs a timeout_s")
        self._server = socket.create_server(("", 0))
        self.address = f"{rendezvous_host()}:{self._server.getsockname()[1]}"
        self._store_address, self._timeout_s = store_address, timeout_s
        self.lost: set[int] = set()
        self.connected = 0
        """Connections accepted so far (one per agent that started)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mpickpt-agent-watch",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from mpickpt.generation import connect_store

        store = None  # its own client: a store client must not be shared by threads
        selector = selectors.DefaultSelector()
        selector.register(self._server, selectors.EVENT_READ)
        said: dict[socket.socket, bytes] = {}
        while not self._stop.is_set():
            for key, _ in selector.select(timeout=SELECT_S):
                sock = key.fileobj
                if sock is self._server:
                    conn, _ = self._server.accept()
                    self.connected += 1
                    selector.register(conn, selectors.EVENT_READ)
                    said[conn] = b""
                    continue
                try:
                    data = sock.recv(256)
                except OSError:
                    data = b""
                if data:
                    said[sock] += data
                    continue
                selector.unregister(sock)
                sock.close()
                text = said.pop(sock)
                rank = text.split(b"\n", 1)[0].strip()
                if text.endswith(_GOODBYE) or not rank.isdigit() or not self._store_address:
                    continue
                self.lost.add(int(rank))
                try:
                    store = store or connect_store(self._store_address, self._timeout_s)
                    store.set(f"agent_lost/{int(rank)}", "1")
                except (RuntimeError, OSError):
                    pass
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()

    def started(self) -> bool:
        """Whether any node agent of the run connected: False when none started (the
        launcher refused its command, or the allocation, or its tasks died before their
        agents could start). Call once the launcher ended: a connection not yet accepted is
        waited for one turn of the watch. Local."""
        if not self.connected:
            time.sleep(2 * SELECT_S)
        return self.connected > 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def announce(address: str | None, rank: int | None) -> socket.socket | None:
    """Open this agent's connection to the run's agent watch and say its launcher rank; None
    without a watch (not under `mpickpt-run` in place) or if it cannot be reached. The socket is
    not inherited by the trainer (Python's sockets are not), so it closes when this agent ends.
    Local."""
    if not address or rank is None:
        return None
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(f"{rank}\n".encode())
        return sock
    except (OSError, ValueError):
        return None


def no_respawn(sock: socket.socket | None) -> None:
    """This agent ends without replacing its dead trainer (no respawns left): close the
    connection without the goodbye, so that the watch records the rank as one no respawn will
    come for, as for an agent that died. Local."""
    if sock is not None:
        sock.close()


def goodbye(sock: socket.socket | None) -> None:
    """This agent ends normally: not a lost agent. Local."""
    if sock is None:
        return
    try:
        sock.sendall(_GOODBYE)
        sock.close()
    except OSError:
        pass
