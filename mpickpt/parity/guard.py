"""Level-1 fault tolerance of a training job: parity upkeep, lost ranks, rebuild, fallback.

The trainer owns one `ParityGuard` per rank. It hooks into the embedding bags (updates: difference
propagation; lookups: rebuild rounds and degraded reads). A failure of at most r ranks per group is
rebuilt from parity while training continues; more than r in some group cannot be decoded, and the
guard says so, so that the trainer falls back to level 2 (the latest HDF5 checkpoint).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from mpickpt.model.contract import PARITY, require
from mpickpt.options import int_at_least, option, positive_float
from mpickpt.parity import cross_memory, peer_rows
from mpickpt.parity.exchange import exchange_counts
from mpickpt.parity.layout import check_parity_shape
from mpickpt.parity.memory_reads import MemoryReads
from mpickpt.parity.peer_rows import Peer
from mpickpt.parity.rebuild import TRANSPORTS, Rebuild
from mpickpt.parity.rebuild_report import RebuildReport
from mpickpt.parity.shared_rows import SharedRows
from mpickpt.parity.upkeep import ParityStore

NAN_BITS = 0x7FC00000
SWEEPS = ("auto", "beside", "lookup")
MAP_TIMES = ("ahead", "failure")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParityConfig:
    """In-memory parity (ECRM; level 1, below the checkpoints)."""

    OPTION_GROUP: ClassVar[str] = "parity"

    k: int | None = option(None, flag="--parity-k", parse=int_at_least(1), metavar="K")
    """data ranks per parity group (groups of K + R consecutive ranks; the world size must be a
    multiple of K + R); parity is on when it is given"""
    r: int = option(1, flag="--parity-r", parse=int_at_least(1), metavar="R")
    """parity units per stripe: 1 = XOR, 2 or more = Reed-Solomon over GF(2^8); R failed ranks
    per group are rebuilt exactly"""
    budget: float = option(0.07, flag="--rebuild-budget", parse=positive_float, metavar="F")
    """fraction of a step's time each rebuild round may spend on its chunk (degraded reads
    extra); a round's fixed costs are paid per round, so fewer, larger rounds lose less
    training time in all (see the README's parity benchmark)"""
    transport: str = option("auto", flag="--rebuild-transport", choices=TRANSPORTS)
    """how a lost rank gets its survivors' units: auto (read their memory directly where the
    whole group shares a host and the kernel allows it: every rank keeps its rows in shared
    memory, which a lost rank maps, or copies with process_vm_readv where it cannot; else the
    network), copy (the same, copies only: rows stay in private memory) or network (the
    process group)"""
    map: str = option("ahead", flag="--rebuild-map", choices=MAP_TIMES)
    """when a rank maps its group members' shared rows for a rebuild (--rebuild-transport
    auto, a group on one host): ahead (when parity is encoded, on a thread, kept until the
    group changes: a loss is rebuilt at once; each rank's RSS then counts its group's rows,
    which the kernel and a cgroup count once, as PSS does) or failure (the lost rank maps its
    survivors when it learns of its loss: page tables built then, ~10 ms more training time
    lost per failure on the VM)"""
    sweep: str = option("auto", flag="--rebuild-sweep", choices=SWEEPS)
    """where a lost rank that reads its group's memory (r = 1) sweeps each round's chunk:
    beside (on a thread of its own while the step's dense forward and backward run, joined
    before the step's gradients leave: costs training little where the node has a core free,
    more than lookup where it has none), lookup (inside the lookup's round, as over the
    network), or auto (beside where every rank's share of its node leaves a core free,
    else lookup). Beside needs embeddings that call a gradient hook (mpickpt's own and the
    TorchRec adapter's); a model without one sweeps in the lookup"""

    def __post_init__(self):
        if self.k is None:
            raise ValueError("parity needs --parity-k (data ranks per parity group)")
        if self.k < 1 or self.r < 1:
            raise ValueError(f"--parity-k and --parity-r must be >= 1, got k={self.k}, r={self.r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--rebuild-transport must be one of {', '.join(TRANSPORTS)}, got "
                             f"{self.transport!r}")
        if self.map not in MAP_TIMES:
            raise ValueError(f"--rebuild-map must be one of {', '.join(MAP_TIMES)}, got "
                             f"{self.map!r}")
        if self.sweep not in SWEEPS:
            raise ValueError(f"--rebuild-sweep must be one of {', '.join(SWEEPS)}, got "
                             f"{self.sweep!r}")
        if not 0 < self.budget <= 10:
            raise ValueError(f"--rebuild-budget must be in (0, 10], got {self.budget!r}")

    def check_world(self, world_size: int) -> None:
        check_parity_shape(self.k, self.r, world_size)


class ParityGuard:
    """Parity for one rank of a HybridDLRM. Construction is collective the first time in a job
    (it creates the upkeep process group), local after; `encode`, `fail`, `settle`
    and the hooks it installs are collective."""

    def __init__(self, topo, model, config: ParityConfig, say, place=None,
                 shared: SharedRows | None = None):
        """`place`: called on each rebuild thread when it starts (`MemoryReads`). `shared`: the
        rows this rank holds in shared memory (`shared_rows.for_parity`), where its parity
        goes too, for a lost rank of its group to map."""
        require(model, PARITY)
        self.topo, self.config, self.say = topo, config, say
        self._place = place
        self._threads = len(os.sched_getaffinity(0))
        """The rebuild's reader threads: this rank's cores now, before training may pin its
        thread to part of them (`--ckpt-cores`)."""
        self.embeddings = model.embeddings
        self.store = ParityStore(topo, model.embeddings, model.plan, config.k, config.r)
        self.store.shared = shared
        self.mapped = shared is not None and shared.adopt(self.store.parity) and \
            all(shared.locate(t) is not None for t in self.store.words.tensors)
        """Every buffer of this rank's rows and parity is shared (a lost rank maps them)."""
        model.embeddings.add_update_hook(self.store)
        model.embeddings.add_index_hook(self._on_lookup)
        add_gradient_hook = getattr(model.embeddings, "add_gradient_hook", None)
        if add_gradient_hook is not None:  # on every rank: a sweep beside needs all to join
            add_gradient_hook(self._before_gradients)
        add_exchange_hook = getattr(model.embeddings, "add_exchange_hook", None)
        if add_exchange_hook is not None:
            add_exchange_hook(self)
        self._carried = add_exchange_hook is not None
        """The lookups carry a rebuild round's counts (`outgoing`, `incoming`)."""
        self._gated = bool(getattr(model.embeddings, "gradient_hooks_gate_updates", False)) \
            and topo.backend == "gloo"
        """A collective that holds every rank follows the gradient hook (`model.contract`)."""
        self.behind = add_gradient_hook is not None and (
            config.sweep == "beside" or config.sweep == "auto" and self._core_free())
        """This rank's vote for memory sweeps beside the step (`Rebuild`'s `behind`)."""
        self.rebuild: Rebuild | None = None
        self.interrupted: list[int] = []
        """Ranks whose rebuild a further death interrupted (`interrupt_rebuild`): their rows are
        not whole, and parity does not cover a loss again until rows are replaced (`resync`)."""
        self.step_seconds: float | None = None
        self._history: list[dict] = []
        self._report_due: RebuildReport | None = None
        """The last rebuild's report, its reductions in flight (`_report`)."""
        self._steps_rebuilding = 0
        """Steps trained since the running rebuild began."""
        self._published: dict[int, Peer] = {}
        """Where every rank's rows were at the last encode (`_publish`), by world rank."""
        self._published_in = -1
        """The generation `_published` was exchanged in."""
        self.reads = self._reserve_reads()
        """This rank's readers for a rebuild by memory reads, their scratch faulted in now
        (None where its rebuilds go over the network)."""

    def _core_free(self) -> bool:
        """This rank's share of its node leaves a core that its training does not use. Local."""
        from mpickpt.engine.free_cores import free_cores

        return free_cores(self.topo.local_size, self.store.words.device.type,
                          torch.get_num_threads()) >= 1

    def _reserve_reads(self) -> MemoryReads | None:
        """Readers with scratch for a whole piece, faulted in before any failure, where this
        rank's rebuild could read its group's memory: none where its rows are not in host
        memory, the transport is the network, or its node runs fewer ranks than a group (the
        group spans nodes; whether a group of as many ranks shares this node, and whether the
        kernel lets its members read each other, only a rebuild's first round finds out).
        Local."""
        st = self.store
        if self.config.transport == "network" or not cross_memory.available() or \
                st.words.memory() is None or st.parity.device.type != "cpu" or \
                st.topo.local_size < st.layout.g:
            return None
        reads = MemoryReads(st, self._place, self._threads)
        if not self.mapped:  # its survivors' rows would be copied: scratch for them, now
            reads.reserve()
        return reads

    def encode(self) -> None:
        """Compute all parity from the current rows. Collective."""
        start = time.perf_counter()
        self.store.encode_all()
        self.store.own_stripes()  # ready for a rebuild here
        self._publish()
        took = time.perf_counter() - start
        st = self.store
        self.say(f"parity: groups of k={st.k} data + r={st.r} parity ranks, rotating placement; "
                 f"{st.nbytes() / 1e6:.2f} MB of parity on rank 0 for "
                 f"{st.words.nbytes() / 1e6:.2f} MB of rows and optimizer state "
                 f"({st.nbytes() / max(st.words.nbytes(), 1):.1%}); encoded in {took:.2f} s"
                 + self._reads_note())

    def _publish(self) -> None:
        """Tell every rank where its group's rows and parity lie in shared memory (as a rebuild
        round does), so that a lost rank begins mapping its survivors' the moment it learns of
        its loss (`start_rebuild`). Collective where shared rows are possible at all (the same
        on every rank); zeros from a rank whose rows are not shared."""
        st = self.store
        if self.config.transport != "auto" or st.parity.device.type != "cpu":
            return
        fields = peer_rows.describe(st, self.mapped, False, readable=False)
        got = exchange_counts(st.topo, st.words.device, [fields] * st.topo.world_size)
        self._published = {m: Peer.parse(fields) for m, fields in enumerate(got)}
        self._published_in = st.topo.generation
        if self.reads is not None:
            self.reads.drop_maps()  # the last publication's (a member may have left since)
            if self.config.map == "ahead":
                self._premap({st.topo.rank}, keep=True)

    def _reads_note(self) -> str:
        if self.reads is None:
            return ""
        if self.mapped:
            return ("; rows and parity in shared memory, for a rebuild that maps the group's "
                    "memory")
        return (f"; {self.reads.reserved / 1e6:.1f} MB of scratch held for a rebuild that "
                f"reads the group's memory")

    @property
    def history(self) -> list[dict]:
        """One record per finished rebuild. Local (it waits for the last one's report, whose
        reductions every rank started when that rebuild ended)."""
        self._complete_report()
        return self._history

    def note_step(self, seconds: float) -> None:
        """Time of the last training step (for rebuild chunk sizing). Local."""
        self._steps_rebuilding += 1
        if self.rebuild is None or not self.rebuild.active:
            self.step_seconds = seconds if self.step_seconds is None else \
                0.8 * self.step_seconds + 0.2 * seconds

    def uncovered(self, ranks) -> str | None:
        """Why parity cannot rebuild `ranks`, or None if it can. Local and pure."""
        g = self.config.k + self.config.r
        by_group: dict[int, list[int]] = {}
        for r in sorted(ranks):
            by_group.setdefault(r // g, []).append(r)
        for group, lost in by_group.items():
            if len(lost) > self.config.r:
                return (f"parity group {group} (ranks {group * g}-{group * g + g - 1}) lost ranks "
                        f"{lost}, more than --parity-r {self.config.r} can rebuild")
        if self.rebuild is not None and self.rebuild.active or self.interrupted:
            return "ranks failed while a rebuild was still running"
        return None

    @torch.no_grad()
    def fail(self, ranks) -> None:
        """The named ranks lose their rows, optimizer state and parity (NaN). Local to each rank;
        every rank calls it with the same `ranks`."""
        self.embeddings.wipe_rows(ranks)
        self.lose_parity(ranks)

    @torch.no_grad()
    def lose_parity(self, ranks) -> None:
        """The named ranks lose the parity they hold (NaN). Local; every rank calls it with the
        same `ranks`."""
        if self.topo.rank in ranks:
            self.store.parity.fill_(NAN_BITS)

    def rebuilding(self) -> list[int]:
        """The ranks a running rebuild has not made whole yet ([] when none runs). Local."""
        return sorted(self.rebuild.failed) if self.rebuild is not None and \
            self.rebuild.active else []

    def interrupt_rebuild(self, ranks) -> None:
        """A death ended the generation while `ranks` were being rebuilt (some member's
        `rebuilding()`): drop the rebuild and refuse to cover the next loss, on every member
        alike, a fresh replacement included, so that all of them pick the same recovery. Local;
        every member of the new generation calls it with the same `ranks`."""
        self._drop_rebuild()
        self._drop_stale_maps()
        self.interrupted = sorted(ranks)

    def rebuilding_here(self) -> bool:
        """This rank's rows are being rebuilt from parity (not whole yet). Local."""
        return bool(self.rebuild is not None and self.rebuild.active and self.rebuild.mine)

    def snapshot(self) -> np.ndarray:
        """A host copy of the parity this rank holds (for a survivor dump). Local."""
        return self.store.parity.detach().cpu().numpy().copy()

    @torch.no_grad()
    def restore(self, parity) -> None:
        """Put back parity taken by `snapshot` (a survivor restored from its dump); ValueError
        when its shape or type is not this rank's. Local."""
        held = self.store.parity
        parity = torch.as_tensor(parity)
        if parity.shape != held.shape or parity.dtype != held.dtype:
            raise ValueError(f"parity of shape {tuple(parity.shape)} {parity.dtype} cannot "
                             f"replace this rank's {tuple(held.shape)} {held.dtype}")
        held.copy_(parity)

    def unfold(self, fold) -> None:
        """Take the fold of one step (`ParityStore.last_fold`) back out of the parity. Local."""
        self.store.unfold(fold)

    def resync(self) -> None:
        """Rows were replaced by older values (a rollback): drop any rebuild in progress and
        encode parity afresh. Collective."""
        self._drop_rebuild()
        self.interrupted = []
        self.encode()

    def _drop_rebuild(self) -> None:
        if self.rebuild is not None:
            self.rebuild.close()
        self.rebuild = None

    def start_rebuild(self, ranks, step: int) -> None:
        """Begin rebuilding `ranks` (their failure is covered). Local; rounds run in lookups."""
        self._drop_rebuild()
        self._drop_stale_maps()
        reads = self.reads
        if reads is None and self.topo.rank in set(ranks):  # none reserved: made now
            reads = MemoryReads(self.store, self._place, self._threads)
        if self.topo.rank in set(ranks) and self.reads is not None:
            self._premap(set(ranks))
        published = self._published if self._published_in == self.topo.generation else None
        self.rebuild = Rebuild(self.store, set(ranks), self.config.budget,
                               self.config.transport, self.say, reads, self.behind, published,
                               carried=self._carried)
        self.interrupted = []
        self.rebuild_step = step
        self._steps_rebuilding = 0
        self.say(f"parity: ranks {sorted(ranks)} lost their shards after step {step}; rebuilding "
                 f"from their groups while training continues")

    def _drop_stale_maps(self) -> None:
        """A new generation: unmap the group's buffers mapped ahead in an older one (a dead
        member's memory lives on while a map of it does). Local."""
        if self.reads is not None and self._published_in != self.topo.generation:
            self.reads.drop_maps()

    def _premap(self, lost: set[int], keep: bool = False) -> None:
        """Begin mapping the buffers of this rank's group members but `lost` (and itself)
        where they were published in this generation, all shared and on this host: at its loss
        (a respawned process, which published nothing, maps them in its first round), or ahead
        (`keep`: the maps outlive rebuilds, `MemoryReads.premap`). Local."""
        L = self.store.layout
        survivors = {m: p for m, p in self._published.items()
                     if L.base <= m < L.base + L.g and m not in lost and m != self.topo.rank}
        if self._published_in == self.topo.generation and survivors and all(
                p.mappable and p.serves and p.key == peer_rows.host_key()
                for p in survivors.values()):
            self.reads.premap(survivors, keep=keep)

    def outgoing(self) -> list[list[int]] | None:
        """The exchange hook, first thing in a lookup: a sweep an evaluation lookup's round left
        is joined, then the running rebuild's next round gives its counts to the lookup's
        exchange where it can (`Rebuild.outgoing`). Collective where a sweep is joined."""
        self._complete_report()
        self._before_gradients(in_step=False)
        rb = self.rebuild
        return rb.outgoing() if rb is not None else None

    def incoming(self, got: list[list[int]]) -> None:
        if self.rebuild is not None:
            self.rebuild.incoming(got)

    def _on_lookup(self, rows: torch.Tensor) -> None:
        self._complete_report()
        self._before_gradients(in_step=False)  # a sweep an evaluation lookup's round left
        if self.rebuild is not None and self.rebuild.active:
            self.rebuild.round(rows, self.step_seconds)
            if not self.rebuild.active and not self.rebuild.deferred:
                self._report()

    def _before_gradients(self, in_step: bool = True) -> None:
        """The gradient hook (`in_step`), and first thing in a lookup or `settle`: end a sweep
        the last round left running. The lost ranks wait for theirs, then one small exchange
        holds every rank until they have, so that no row or parity of the group changes while
        a sweep reads it, nor a lookup reads a row it has not written; in the gradient hook of
        embeddings whose gradients' all-to-all follows it (`_gated`), that all-to-all holds
        them instead. Collective when the round was deferred (alike on every rank), else
        nothing."""
        rb = self.rebuild
        if rb is None or not rb.deferred:
            return
        rb.join(in_step)
        if not (in_step and self._gated):
            rb.hold_all()
        if not rb.active:
            self._report()

    def settle(self) -> None:
        """Finish a running rebuild now (before a checkpoint or the end), and its report.
        Collective."""
        self._before_gradients(in_step=False)  # one an evaluation lookup's round left
        if self.rebuild is not None and self.rebuild.active:
            self.rebuild.finish()
            self._report()
        self._complete_report()

    @staticmethod
    def _transport_note(record: dict) -> str:
        memory, rounds, beside = (record[k] for k in ("memory_rounds", "rounds", "beside_rounds"))
        if memory == 0:
            return ""
        beside = f", {beside} swept beside the steps" if beside else ""
        mapped = ", its shared rows mapped" if record.get("mapped_bytes") else ""
        if memory == rounds:
            return f" reading the group's memory{beside}{mapped}"
        return f" ({memory} reading the group's memory{beside}{mapped})"

    def _report(self) -> None:
        """The rebuild ended: start its report's reductions (every rank ends it at the same
        point) and go on; `_complete_report` says it. In a generation whose members have not
        published their rows yet (a replacement's rebuild), every rank publishes them now, and
        maps its group's ahead again. Collective (the report started, not waited for)."""
        self._complete_report()
        self._report_due = RebuildReport(self.topo.control, self.rebuild, self.rebuild_step,
                                         self.rebuild_step + self._steps_rebuilding + 1)
        if self._published_in != self.topo.generation:
            self._publish()

    def _complete_report(self) -> None:
        """Say the last rebuild's report and keep its record, once its reductions are in.
        Local (waits for the reductions every rank started)."""
        due, self._report_due = self._report_due, None
        if due is None:
            return
        record, partial = due.result()
        self._history.append(record)
        wall = record["seconds"]
        self.say(f"parity: rebuilt ranks {record['ranks']} ({record['units']} units, "
                 f"{record['degraded_rows']} rows by degraded reads, "
                 f"{record['received_bytes'] / 1e6:.1f} MB received, "
                 f"{record['received_bytes'] / 1e6 / max(wall, 1e-9):.0f} MB/s) in "
                 f"{record['rounds']} rounds{self._transport_note(record)}, {wall:.3f} s while "
                 f"training went on, whole from step {record['done_step']} on "
                 f"({record['round_seconds']:.2f} s of round work, "
                 + (f"{partial})" if partial else "slowest rank)"))
