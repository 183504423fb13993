"""Rebuild of lost ranks from their group's survivors while training goes on (ECRM §3.4).

The lost rank's units (its data rows and its parity rows) are decoded stripe by stripe. Each
training step runs one round, inside the lookup (after the indices reach their owners, before
rows are pooled or updated): a lost rank asks its surviving group members for the units of (a) the
stripes of rows this step reads that are not rebuilt yet, decoded on demand (degraded reads), and
(b) the next chunk of its lost stripes, whole periods of g stripes sized so that its per-stripe
work takes at most --rebuild-budget of a step's time (see `_resize`). Survivors answer with their
current data rows and parity rows; the lost rank decodes and writes its units back. A chunk of
periods [p0, p1) is sent as its two ends, and every member's units of it are consecutive rows of
its shard and of its parity store, taken and written back by slices; only the degraded reads travel
as stripe numbers. With r = 1 on gloo the answers
are XOR-reduced onto the lost rank (`ReduceOp.BXOR` over the parity group), which is the decode
itself; otherwise (r >= 2, or NCCL, which has no BXOR) they all travel to the lost rank. Every
member's data and parity are consistent at that point (all folds of the previous step are in,
none of this step's), so the decoded units are exact: a chunk is locked for exactly the span of one
round, and updates of this step land after it, the synchronous form of ECRM's lock and buffer.
Lost rows are never updated before they are rebuilt (a row a step updates is read first), so
parity held by survivors stays consistent with the lost rows' true values.

Where the lost rank reads its survivors' memory (r = 1) and the model calls a gradient hook
(`behind`), the round does only the degraded reads (the rows this step reads, the chunk's
included) and leaves the chunk's sweep running on a thread of its own while the step's dense
forward and backward go on; every rank's gradient hook then `join`s it, the lost rank waiting
for the sweep, and one small exchange holds every rank until then, before any row of the step
changes (ECRM's decode beside training, with the same consistency as a round); embeddings whose
gradients' all-to-all follows the hook hold them with it instead (`gradient_hooks_gate_updates`).
Once a round has read memory, the next rounds' counts can travel in the lookup's own first
exchange (`outgoing`, `incoming`): a round then adds no collective to its step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mpickpt.parity import peer_rows
from mpickpt.parity.cross_memory import CrossMemoryError
from mpickpt.parity.exchange import exchange_counts, exchange_rows
from mpickpt.parity.memory_reads import MemoryReads
from mpickpt.parity.peer_rows import Peer
from mpickpt.parity.period_slots import move_range

FIRST_CHUNK_STRIPES = 4096
MAX_CHUNK_STRIPES = 1 << 22
TRANSPORTS = ("auto", "copy", "network")
ASSUMED_READ_BYTES_PER_S = 1e9
"""The first chunk read from memory is sized as if each survivor's units came at this rate (half
what the kernel reads at here); later chunks follow the measured cost."""


class Rebuild:
    """One rebuild of the failed ranks `failed` (a set of world ranks, at most r per group).

    Every rank holds one; `round` and `finish` are collective until `active` is False."""

    def __init__(self, store, failed: set[int], budget: float, transport: str = "auto",
                 say=None, reads: MemoryReads | None = None, behind: bool = False,
                 published: dict[int, Peer] | None = None, carried: bool = False):
        """`transport`: "auto" reads the survivors' memory where the whole group shares a host
        and the kernel allows it (`peer_rows`: in their shared buffers where it can map them,
        `shared_rows`, else by copies), else uses the process group; "copy" the same without
        mapping; "network" always uses the process group (`ParityConfig` checks it). `say`:
        the log, for a refused memory read. `reads`: the lost rank's readers (required there;
        ignored elsewhere), their scratch reserved ahead where the guard could
        (`MemoryReads.reserve`). `behind`: this rank would have a round that reads memory
        leave its sweep running beside the step; every rank's gradient hook then calls `join`
        before any row of the step changes. A round does so only where every rank would (their
        votes travel with its first exchange), so the choice is the same on all.
        `published`: where every rank's buffers were published before the failure
        (`ParityGuard.encode`, in this generation; None where not): a lost rank that mapped
        its survivors as published there (`MemoryReads.premap`) says so in its first round, and
        where they all publish the same buffers then, every rank takes that for its probe (one
        exchange fewer). `carried`: the lookups carry a round's counts in their own exchange
        (`outgoing`), as HybridDLRM's do: rounds after one that read memory need no exchange
        of their own."""
        self.store, self.failed, self.budget = store, set(failed), budget
        self.transport, self.say = transport, say or (lambda line: None)
        L, me = store.layout, store.topo.rank
        self.mine = me in self.failed
        self.group_failed = {f - L.base for f in self.failed if L.base <= f < L.base + L.g}
        self.lost = store.own_stripes().copy() if self.mine else np.zeros(L.stripes, bool)
        self.total = int(self.lost.sum())
        self.cursor = 0
        self.chunk = FIRST_CHUNK_STRIPES
        self.rounds = self.degraded_rows = self.received_bytes = 0
        self.seconds = 0.0
        self.sizes: list[tuple[int, float]] = []  # (stripes, seconds) of this rank's rounds
        self.started = time.perf_counter()
        self.finished_at = None
        if self.mine and reads is None:
            raise ValueError(f"rank {me} is being rebuilt and needs its MemoryReads")
        self.reads = reads if self.mine else None
        self._mapped_before = self.reads.bytes_mapped if self.reads is not None else 0
        self.probed = False  # this lost rank has read each of its survivors' memory once
        self.published = published
        self.premapped = False  # this lost rank's first round offers its premap for the probe
        self.memory_rounds = 0
        self.behind = behind
        self.deferred = False
        """The last round left its chunk's sweep running; `join` ends it (the same on every
        rank)."""
        self._sweep = None
        """(future, p0, p1, bytes read before, start) of the sweep this lost rank left
        running."""
        self.sweeps_beside = 0
        """Sweeps this lost rank left running beside a step."""
        self.beside_rounds = 0
        """Rounds that left their sweep beside the step (the same on every rank)."""
        self.carried = carried
        self.carried_rounds = 0
        """Rounds whose counts travelled in the lookup's exchange alone (the same on every
        rank; not one that went to the network after all and exchanged them again)."""
        self.read_memory = False
        """The last round read the survivors' memory (the same on every rank)."""
        self._header: _Header | None = None
        """The next round's counts, taken by `outgoing` for the lookup's exchange."""
        self._periods_left = True  # some lost rank has periods its rounds have not taken
        self.pull_cost: float | None = None  # seconds per stripe of the last memory sweep
        self._step_seconds: float | None = None

    @property
    def active(self) -> bool:
        """Rounds are still due, or the last one's sweep is still running beside the step (its
        rows are not whole yet). The same on every rank."""
        return self._periods_left or self.deferred

    @property
    def mapped_bytes(self) -> int:
        """Of `received_bytes`, those read in the survivors' mapped buffers (this rank's)."""
        return self.reads.bytes_mapped - self._mapped_before if self.reads is not None else 0

    def remaining(self) -> int:
        return int(self.lost.sum())

    def round(self, needed_rows: torch.Tensor | None, step_seconds: float | None,
              everything: bool = False) -> None:
        """One exchange: degraded reads of `needed_rows` (local rows this step reads) and the next
        chunk. Collective over the training process group."""
        start = time.perf_counter()
        if self.deferred:
            raise RuntimeError("parity rebuild: a round began before the sweep the last one left "
                               "beside its step was joined (ParityGuard joins it first)")
        self._step_seconds = step_seconds
        st = self.store
        header = self._header if not everything and self._header is not None and \
            self._header.got is not None else None
        self._drop_header(keep=header)
        if header is None:  # not carried: the round's own exchange
            header = self._header_of(everything)
        vote, p0, p1 = header.vote, header.p0, header.p1
        degraded = self._degraded(needed_rows, p0, p1, keep_chunk=bool(vote))
        counts = header.counts(len(degraded))
        got = header.got or exchange_counts(st.topo, st.words.device, counts)
        lefts = [c[3] for c in got]
        defer = all(c[4] for c in got)  # every rank will join it before its gradients leave
        survivors = header.survivors
        peers = self._memory_peers(got, survivors)
        if peers is None and header.got is not None:  # the network after all (alike on every
            got = exchange_counts(st.topo, st.words.device, counts)  # rank): it needs the count
        else:
            self.carried_rounds += header.got is not None
        if peers is not None and self._probing(got):
            p1, agreed = self._agree_probe(peers, p0, p1, everything)
            if agreed is None:
                peers = None
            else:
                lefts = agreed
        elif peers and not self.probed:  # every rank took this lost rank's premap for its probe
            self.reads.admit(peers)
            self.probed = True
            p1 = self._grow_for_memory(p0, p1, everything)  # others' view: `lefts` as sent
        g = st.layout.g
        if peers is not None and not defer:
            # the chunk is read in this round (a vote kept its rows among the degraded; a probe
            # round grew it past the chunk they were asked for): its rows need no degraded read
            # (the network path keeps them: the survivors were told their count)
            keep = (degraded < p0 * g) | (degraded >= p1 * g)
            self.degraded_rows -= int((~keep).sum())
            degraded = degraded[keep]
        request = np.concatenate([degraded, np.arange(p0 * g, p1 * g, dtype=np.int64)])
        if peers is not None:
            if self.mine and len(request):
                if defer:
                    self._pull_behind(degraded, peers, p0, p1)
                else:
                    self._pull(request, peers, len(degraded), p0, p1)
            self.memory_rounds += 1
        else:
            self._over_network(counts, request, degraded, got, survivors)
        self.rounds += 1
        self.read_memory = peers is not None
        self.deferred = peers is not None and defer
        self._periods_left = any(lefts)
        self.beside_rounds += self.deferred
        took = time.perf_counter() - start
        self.seconds += took
        if peers is None:
            self._resize(len(request), took, step_seconds)
        if not self.deferred:
            self._end_if_over()

    def join(self, in_step: bool = True) -> None:
        """End the sweep the last round left running (`deferred`): the lost rank waits for it
        (raising its failure) and counts its periods rebuilt; ends the rebuild where that round
        was its last (`active` stays True until then, the same on every rank). `in_step`: the
        join is the step's gradient hook, so the time since the sweep began was the step's
        dense work, which sizes the next chunk (not where an evaluation lookup left it). Local;
        a no-op where no round was deferred. The caller then holds every rank until all have
        joined (`hold_all`)."""
        if not self.deferred:
            return
        self.deferred = False
        if self._sweep is not None:
            start = time.perf_counter()
            future, p0, p1, before, launched = self._sweep
            self._sweep = None
            sweep = future.result()
            g = self.store.layout.g
            self.lost[p0 * g:p1 * g] = False
            self.received_bytes += self.reads.bytes_read - before
            self.pull_cost = sweep / ((p1 - p0) * g)
            self._resize_pull(window=start - launched if in_step else 0.0)
            self.seconds += time.perf_counter() - start
        self._end_if_over()

    def _end_if_over(self) -> None:
        if not self.active and self.finished_at is None:
            self.finished_at = time.perf_counter()
            self.close(wait=False)  # the step goes on while its maps and threads go

    def close(self, wait: bool = True) -> None:
        """Release the lost rank's reader threads, maps and scratch (when the rebuild ends, or
        is dropped; a sweep still running is waited for, its failure dropped with it). `wait`
        False: on a thread of its own (`MemoryReads.close`). Local; safe twice."""
        self._sweep = None
        if self.reads is not None:
            self.reads.close(wait)

    def _over_network(self, counts, request, degraded, got, survivors) -> None:
        """The round's units travel over the process group: requests, then the survivors' units
        (XOR-reduced onto the lost rank, or all sent there). Collective over the training
        process group."""
        st, world = self.store, self.store.topo.world_size
        req = torch.as_tensor(degraded, dtype=torch.int64, device=st.words.device).view(-1, 1)
        asked = exchange_rows(st.topo, st.words.device,
                              [req if c[0] else req[:0] for c in counts],
                              [c[0] for c in got], 1, torch.int64)
        answers = [self._answer(a.view(-1).cpu().numpy(), c[1], c[2]) for a, c in zip(asked, got)]
        if st.group_pg is not None:
            self._xor_onto_lost(request, answers, got, len(degraded))
        else:
            replies = exchange_rows(st.topo, st.words.device, answers,
                                    [len(request) if s in survivors and self.mine else 0
                                     for s in range(world)], st.words.width, torch.int32)
            if self.mine and len(request):
                self._decode(request, {s - st.layout.base: replies[s] for s in survivors},
                             len(degraded))
                self.received_bytes += len(request) * len(survivors) * st.words.width * 4

    # ---- units read from the survivors' memory (peer_rows) ----------------------------------

    def _memory_peers(self, got, survivors) -> dict[int, Peer] | None:
        """Whether this round may read memory instead of the network, decided alike on every
        rank from what all ranks published in it: every group with a lost rank shares one host
        and its survivors' rows can be read (`_agree_probe` then checks that the kernel lets the
        lost ranks read them, once). Returns this rank's survivors by world rank ({} on other
        ranks), or None for the network. Local."""
        if self.transport == "network":
            return None
        g = self.store.layout.g
        info = {m: Peer.parse(got[m][5:]) for f in self.failed
                for m in range(f - f % g, f - f % g + g)}
        for f in self.failed:
            members = range(f - f % g, f - f % g + g)
            if not info[f].key or any(info[m].key != info[f].key for m in members) or \
                    not all(info[m].serves for m in members if m not in self.failed):
                return None
        return {s: info[s] for s in survivors} if self.mine else {}

    def _probing(self, got) -> bool:
        """Some lost rank has not read its survivors' memory yet, nor mapped them all as they
        publish their buffers now (the same on every rank)."""
        g = self.store.layout.g
        for f in self.failed:
            said = Peer.parse(got[f][5:]).probed
            members = [m for m in range(f - f % g, f - f % g + g) if m not in self.failed]
            if said == peer_rows.PREMAPPED and self.published is not None and all(
                    m in self.published and
                    self.published[m].same_buffers(Peer.parse(got[m][5:])) for m in members):
                continue
            if said != peer_rows.PROBED:
                return True
        return False

    def _offer_premap(self) -> None:
        """This lost rank mapped all its survivors as they were published before the failure
        (waits for its premap): it offers that for its probe, and its chunk is sized for memory
        once every rank has taken the offer (`_grow_for_memory`), as after a probe: where the
        round goes to the network instead, its survivors were asked for a network-sized one.
        Local."""
        if self.reads is None or self.published is None or self.transport != "auto":
            return
        premapped = self.reads.premapped() or {}
        L = self.store.layout
        self.premapped = all(
            s in premapped and self.published.get(s) == premapped[s]
            for s in (L.base + p for p in range(L.g) if p not in self.group_failed))

    def _agree_probe(self, peers: dict[int, Peer], p0: int, p1: int,
                     everything: bool) -> tuple[int, list[int] | None]:
        """The lost ranks read one word of each survivor; one more exchange agrees on whether
        all could. If so, a lost rank sizes this round's chunk for memory reads (the chunk asked
        for was sized for the network) and everyone learns whether it leaves periods for later.
        Returns (p1, every rank's 'periods left' flag), or (p1, None) for the network.
        Collective over the training process group."""
        st, asked, chunk = self.store, p1, self.chunk
        ok = self._probe(peers) if self.mine else True
        if self.mine and ok:
            p1 = self._grow_for_memory(p0, p1, everything)
        left = int(self.mine and p1 < st.layout.periods)
        agreed = exchange_counts(st.topo, st.words.device, [[int(ok), left]] * st.topo.world_size)
        if not all(c[0] for c in agreed):  # some group's lost rank may not read: the network,
            self.cursor, self.chunk = asked, chunk  # with the chunk its survivors were asked for
            return asked, None
        return p1, [c[1] for c in agreed]

    def _grow_for_memory(self, p0: int, p1: int, everything: bool) -> int:
        """The end of this lost rank's first chunk read from memory: the chunk asked for was
        sized for the network, so it is sized again at memory's rate, grown only (the degraded
        reads left out the stripes of the chunk asked for; those of the growth are dropped from
        them after). Not for chunk 0 (degraded reads only) nor `everything`. Local."""
        if everything or self.chunk <= 0:
            return p1
        self._resize_pull()
        self.cursor = max(p1, self._chunk_end(p0))
        return self.cursor

    def _probe(self, peers: dict[int, Peer]) -> bool:
        """Read one word of each survivor (once per rebuild); False, and said, where the kernel
        refuses: this rebuild then stays on the network. Local."""
        if self.probed:
            return True
        try:
            self.reads.probe(peers)
        except CrossMemoryError as e:
            self.transport = "network"
            self.say(f"parity: rank {self.store.topo.rank} cannot read its group's memory "
                     f"({e}); the rebuild goes over the network")
            return False
        self.probed = True
        return True

    def _pull(self, request: np.ndarray, peers: dict[int, Peer], degraded: int, p0: int,
              p1: int) -> None:
        """Decode this rank's units of `request` (the first `degraded` by stripe, then the
        periods [p0, p1)) from its survivors' memory and write them back. Local."""
        st, L = self.store, self.store.layout
        before = self.reads.bytes_read
        stripes = request[:degraded] if degraded else None
        if L.r == 1:  # the degraded units are read beside the periods, by the same threads
            with st.lock:  # the readers' threads write rows: held here, for all of them
                units, sweep = self.reads.pull(p0, p1, peers, stripes)
            self.lost[p0 * L.g:p1 * L.g] = False
            if degraded:  # from the same survivor units as the pass: the same values, also
                self._decode(stripes, units, degraded)  # where a probe round grew [p0, p1)
        else:
            if degraded:
                self._decode(stripes, self.reads.units(peers, stripes), degraded)
            start = time.perf_counter()
            for a, b in self.reads.pieces(p0, p1):
                self._decode(np.arange(a * L.g, b * L.g, dtype=np.int64),
                             self.reads.period_units(a, b, peers), 0)
            sweep = time.perf_counter() - start
        self.received_bytes += self.reads.bytes_read - before
        if p1 > p0:
            self.pull_cost = sweep / ((p1 - p0) * L.g)
        self._resize_pull()

    def _pull_behind(self, degraded: np.ndarray, peers: dict[int, Peer], p0: int,
                     p1: int) -> None:
        """r = 1: decode the `degraded` stripes (the rows this step reads, the chunk's too) now,
        and leave the sweep of periods [p0, p1) running (`join` ends it). Local."""
        before = self.reads.bytes_read
        if len(degraded):
            self._decode(degraded, self.reads.units(peers, degraded), len(degraded))
        after = self.reads.bytes_read
        self.received_bytes += after - before
        if p1 > p0:
            self._sweep = (self.reads.pull_behind(p0, p1, peers, self.store.lock), p0, p1, after,
                           time.perf_counter())
            self.sweeps_beside += 1

    def _resize_pull(self, window: float = 0.0) -> None:
        """Chunk for the next memory round: what `budget` of a step buys at the measured cost
        per stripe of the reads so far (at the assumed rate before any); at most 8x the last
        and at least 64 stripes. A sweep that runs beside the step also has the `window` it
        ran in before its join (the step's dense forward and backward) for free. Local."""
        st = self.store
        step = self._step_seconds
        if not self.mine or step is None:
            return
        if self.pull_cost is not None:
            per_stripe = self.pull_cost
            cap = 8 * max(self.chunk, 64)
        else:
            per_stripe = (st.layout.k * st.words.width * 4) / ASSUMED_READ_BYTES_PER_S
            cap = MAX_CHUNK_STRIPES
        target = (window + self.budget * step) / max(per_stripe, 1e-12)
        self.chunk = int(min(max(64, target), cap, MAX_CHUNK_STRIPES))

    def finish(self) -> None:
        """Rebuild everything that is left now. Collective. When it read the survivors' memory,
        they wait here until the lost ranks are done (a round in a lookup needs no such wait:
        a survivor changes no row before the lost rank's lookup has ended). A sweep left running
        must have been joined first (`ParityGuard.settle` does)."""
        reads = self.memory_rounds
        while self.active:
            self.round(None, None, everything=True)
        if self.memory_rounds > reads:
            self.hold_all()

    def hold_all(self) -> None:
        """One small exchange that no rank leaves before the lost ranks reach it: after their
        reads of the survivors' memory, no survivor changes a row they may still read.
        Collective."""
        st = self.store
        exchange_counts(st.topo, st.words.device, [[0]] * st.topo.world_size)

    def _chunk_end(self, p0: int) -> int:
        """End of the chunk from period p0: `chunk` stripes of whole periods, and the rest too
        when less than half a chunk would be left (a round of its own would add a step to the
        rebuild for a sliver of work). Chunk 0: none (degraded reads only). Local."""
        L = self.store.layout
        if self.chunk <= 0:
            return p0
        step = max(1, self.chunk // L.g)
        return L.periods if L.periods - (p0 + step) < step // 2 else p0 + step

    def outgoing(self) -> list[list[int]] | None:
        """The next round's counts, to travel in the lookup's own first exchange
        (`add_exchange_hook`) instead of one of the round's: where `carried` and the last round
        read the survivors' memory (alike on every rank), else None. The round takes its chunk
        now (the degraded reads' count, which only the network needs, is unknown until the
        index hooks: sent as 0; a round that goes to the network after all asks again). The
        lookup must run the round (`round`, from its index hook). Local."""
        self._drop_header()
        if not (self.carried and self.read_memory and self.active) or self.deferred:
            return None
        self._header = self._header_of(False)
        return self._header.counts(0)

    def incoming(self, got: list[list[int]]) -> None:
        """What every rank sent for this round in the lookup's exchange. Local."""
        if self._header is not None:
            self._header.got = got

    def _drop_header(self, keep: "_Header | None" = None) -> None:
        """Forget the header `outgoing` took, its chunk given back where it is not `keep` (no
        round used it). Local."""
        if self._header is not None and self._header is not keep:
            self.cursor = self._header.cursor
        self._header = None

    def _header_of(self, everything: bool) -> "_Header":
        """This rank's part of the next round's counts, its chunk taken. Local."""
        st = self.store
        vote = int(self.behind and not everything and st.layout.r == 1 and
                   self.transport != "network")  # this rank may leave a sweep beside the step
        if self.rounds == 0 and self.mine:
            self._offer_premap()
        cursor = self.cursor
        p0, p1 = self._chunk(everything)
        left = int(self.mine and p1 < st.layout.periods)  # the sweep has periods to go
        survivors = [st.layout.base + p for p in range(st.layout.g) if p not in self.group_failed]
        info = peer_rows.describe(st, self.transport != "network", peer_rows.PROBED if
                                  self.probed else peer_rows.PREMAPPED if self.premapped else 0,
                                  mapping=self.transport == "auto")
        return _Header(cursor, vote, p0, p1, left, survivors, info, self.mine,
                       st.topo.world_size)

    def _chunk(self, everything: bool) -> tuple[int, int]:
        """This round's chunk, the periods [p0, p1) from the cursor on ((0, 0) where this
        rank lost nothing), the cursor moved past it. Local."""
        if not self.mine:
            return 0, 0
        p0 = self.cursor
        p1 = self.store.layout.periods if everything else self._chunk_end(p0)
        self.cursor = p1
        return p0, p1

    def _degraded(self, needed_rows, p0: int, p1: int, keep_chunk: bool = False) -> np.ndarray:
        """The sorted lost stripes among `needed_rows` (degraded reads) outside the chunk
        [p0, p1) (inside it too where `keep_chunk`: a sweep left running beside the step writes
        the chunk after the lookup has read it). Local."""
        L = self.store.layout
        degraded = np.empty(0, dtype=np.int64)
        if self.mine and needed_rows is not None and len(needed_rows):
            wanted = np.zeros(L.stripes, dtype=bool)  # sorted and unique without a sort
            wanted[L.stripe_of_row(self.store.pos, needed_rows.cpu().numpy())] = True
            if not keep_chunk:
                wanted[p0 * L.g:p1 * L.g] = False
            s = np.flatnonzero(wanted & self.lost)
            self.degraded_rows += len(s)
            degraded = s
        return degraded

    def _xor_onto_lost(self, request: np.ndarray, answers: list[torch.Tensor], got,
                       degraded: int) -> None:
        """r = 1: the lost unit of a stripe is the XOR of the survivors' units, so the group
        reduces them with BXOR onto the lost rank instead of sending them all there (the XORs run
        on the way, and the lost rank receives one unit per stripe). Collective over the parity
        group of a group that lost a rank; nothing elsewhere."""
        if not self.group_failed:
            return
        st = self.store
        lost = st.layout.base + next(iter(self.group_failed))
        asked = got[lost]  # [degraded, p0, p1, left] from the lost rank
        n = len(request) if self.mine else asked[0] + (asked[2] - asked[1]) * st.layout.g
        if n == 0:
            return
        units = (torch.zeros(n, st.words.width, dtype=torch.int32, device=st.words.device)
                 if self.mine else answers[lost].contiguous())
        st.topo.wait(dist.reduce(units, dst=lost, op=dist.ReduceOp.BXOR, group=st.group_pg,
                                async_op=True))
        if self.mine:
            self._store_units(request, units, degraded)
            self.received_bytes += n * st.words.width * 4

    def _units(self, stripes: np.ndarray) -> torch.Tensor:
        """This member's units (data row or parity row; zeros for padding) of `stripes`."""
        st, L = self.store, self.store.layout
        dev = st.words.device
        out = torch.zeros(len(stripes), st.words.width, dtype=torch.int32, device=dev)
        if len(stripes) == 0:
            return out
        rows = L.row_of_stripe(st.pos, stripes)
        data = np.flatnonzero(rows >= 0)
        out.index_copy_(0, torch.as_tensor(data, device=dev),
                        st.words.gather(torch.as_tensor(rows[data], device=dev)))
        prow = L.parity_row(st.pos, stripes)
        par = np.flatnonzero(prow >= 0)
        out.index_copy_(0, torch.as_tensor(par, device=dev),
                        st.parity.index_select(0, torch.as_tensor(prow[par], device=dev)))
        return out

    def _answer(self, stripes: np.ndarray, p0: int, p1: int) -> torch.Tensor:
        """This member's units of `stripes` (degraded reads, by index), then of the stripes of
        periods [p0, p1) in stripe order, copied from its data rows [p0 k, p1 k) and parity rows
        [p0 r, p1 r) by strided slices straight into place (zeros for padding). Local."""
        st = self.store
        n, w = len(stripes), st.words.width
        out = torch.empty(n + (p1 - p0) * st.layout.g, w, dtype=torch.int32,
                          device=st.words.device)
        out[:n] = self._units(stripes)
        self._move_range(p0, out[n:].view(p1 - p0, st.layout.g, w), to_units=True)
        return out

    def _write_range(self, p0: int, p1: int, units: torch.Tensor) -> None:
        """Write this rank's decoded units of periods [p0, p1) (stripe order) back: the inverse of
        `_answer`'s range part, padding dropped. Local."""
        st = self.store
        self._move_range(p0, units.view(p1 - p0, st.layout.g, st.words.width), to_units=False)

    def _move_range(self, p0: int, units: torch.Tensor, to_units: bool) -> None:
        """Copy between this member's rows and parity of the periods [p0, p0 + n) and `units`
        ((n, g, W), stripe order within a period), in the direction `to_units`. Local."""
        st = self.store
        move_range(st.layout, st.pos, st.words, st.parity, 0, p0, units, to_units)

    def _decode(self, stripes: np.ndarray, units: dict[int, torch.Tensor],
                degraded: int) -> None:
        """Decode this rank's units of `stripes` (the first `degraded` of them the degraded reads,
        then whole periods) from the survivors' `units` (by position)."""
        st, L = self.store, self.store.layout
        if L.r == 1:
            self._store_units(stripes, st.code.recover_one(list(units.values())), degraded)
            return
        decoded = torch.empty(len(stripes), st.words.width, dtype=torch.int32,
                              device=st.words.device)
        offsets = stripes % L.g
        for o in np.unique(offsets):
            sel = torch.as_tensor(np.flatnonzero(offsets == o), device=st.words.device)
            dpos = L.data_positions(int(o))
            ppos = L.parity_positions(int(o))
            data = {j: units[int(p)].index_select(0, sel) for j, p in enumerate(dpos)
                    if int(p) not in self.group_failed}
            parity = {q: units[int(p)].index_select(0, sel) for q, p in enumerate(ppos)
                      if int(p) not in self.group_failed}
            erased = [j for j, p in enumerate(dpos) if int(p) in self.group_failed]
            data.update(st.code.decode(data, parity, erased))
            if st.pos in dpos:
                mine = data[int(np.flatnonzero(dpos == st.pos)[0])]
            else:
                q = int(np.flatnonzero(ppos == st.pos)[0])
                mine = st.code.encode(q, [data[j] for j in range(L.k)])
            decoded.index_copy_(0, sel, mine)
        self._store_units(stripes, decoded, degraded)

    def _store_units(self, stripes: np.ndarray, units: torch.Tensor, degraded: int) -> None:
        """Write this rank's decoded `units` of `stripes` (the first `degraded` of them by index,
        the rest whole periods, by slices): data rows into the shard (padding dropped), parity rows
        into the parity store; they are lost no more."""
        g = self.store.layout.g
        with self.store.lock:
            self._write_units(stripes[:degraded], units[:degraded])
            if len(stripes) > degraded:
                self._write_range(int(stripes[degraded]) // g, int(stripes[-1]) // g + 1,
                                  units[degraded:])
        self.lost[stripes] = False

    def _write_units(self, stripes: np.ndarray, units: torch.Tensor) -> None:
        st, L = self.store, self.store.layout
        if len(stripes) == 0:
            return
        dev = st.words.device
        rows = L.row_of_stripe(st.pos, stripes)
        keep = np.flatnonzero(rows >= 0)
        if len(keep):
            st.words.scatter(torch.as_tensor(rows[keep], device=dev),
                             units.index_select(0, torch.as_tensor(keep, device=dev)))
        prow = L.parity_row(st.pos, stripes)
        par = np.flatnonzero(prow >= 0)
        if len(par):
            st.parity.index_copy_(0, torch.as_tensor(prow[par], device=dev),
                                  units.index_select(0, torch.as_tensor(par, device=dev)))

    def _resize(self, requested: int, took: float, step_seconds: float | None) -> None:
        """Chunk for the next round. A round costs a fixed part (its exchanges, paid even for an
        empty chunk) plus a part per stripe: the slope of a least-squares line through the rounds'
        (stripes, seconds); until two rounds of different sizes give one, the chunk grows 4x.
        The next chunk is what `budget` of a step's time buys at that slope, at most 8x the last
        and at least 64 stripes."""
        if not self.mine or step_seconds is None or requested == 0:
            return
        self.sizes.append((requested, took))
        slope = _slope(self.sizes)
        if slope is None or slope <= 0:
            self.chunk = min(4 * max(self.chunk, 64), MAX_CHUNK_STRIPES)
            return
        target = self.budget * step_seconds / slope
        self.chunk = int(min(max(64, target), 8 * max(self.chunk, 64), MAX_CHUNK_STRIPES))


def _slope(points: list[tuple[int, float]]) -> float | None:
    """Seconds per stripe: the least-squares slope of seconds on stripes, or None while the
    stripes do not vary."""
    n = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    if len(points) < 2 or np.ptp(n) == 0:
        return None
    n0 = n - n.mean()
    return float((n0 * (t - t.mean())).sum() / (n0 * n0).sum())


@dataclass
class _Header:
    """One rank's part of a round's counts, and (`got`) what every rank sent for it."""

    cursor: int  # the lost rank's cursor before the round took its chunk
    vote: int
    p0: int
    p1: int
    left: int
    survivors: list[int]
    info: list[int]
    mine: bool
    world: int
    got: list[list[int]] | None = None

    def counts(self, degraded: int) -> list[list[int]]:
        """Per destination rank: [degraded reads asked of it, p0, p1, left, vote, *info]."""
        return [([degraded, self.p0, self.p1, self.left] if (self.mine and d in self.survivors)
                 else [0, 0, 0, self.left]) + [self.vote] + self.info for d in range(self.world)]
