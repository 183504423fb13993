"""CheckpointManager: decoupled checkpoints for any synchronous training loop (Check-N-Run §3).

Usage (every call is collective unless it says local)::

    ckpt = CheckpointManager(topo, CheckpointConfig(directory=..., interval=100), model, log=print)
    restored = ckpt.restore()                      # None, or .step and .reader_state
    reader = PrefetchReader(..., state=..., allowance=ckpt.allowance(step, total))
    for step in range(start + 1, total + 1):
        model.train_step(reader.next())
        ckpt.after_step(step, reader, total)       # snapshot when due, commit in background
    ckpt.close()

`model` provides `plan`, `topo`, `embeddings.local_gids`, `row_state()`, `dense_state()`,
`load_row_state()`, `load_dense_state()` (see `mpickpt.model.hybrid.HybridDLRM`).
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from mpickpt.engine.commit import CommitCoordinator, PendingCheckpoint
from mpickpt.engine.config import CheckpointConfig
from mpickpt.engine.kinds import KindPlanner
from mpickpt.incrcp.client import ExtractorClient
from mpickpt.track.bitvector import RowBitVector
from mpickpt.engine.snapshot import (Snapshotter, dense_file_spec, numpy_dtype, rng_blobs,
                                     shard_file_specs)
from mpickpt.engine.staging import remove_stale_areas
from mpickpt.engine.writer_pool import WriterPool
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest
from mpickpt.store.restore import committed, load_checkpoint


@dataclass
class Restored:
    """Where training resumes."""

    step: int
    reader_state: dict


class CheckpointManager:
    """Snapshots, background writers, commit and restore for one rank. Construction is collective."""

    def __init__(self, topo, config: CheckpointConfig, model, log=None):
        self.topo, self.config, self.model = topo, config, model
        self.log = log or (lambda line: print(line, flush=True) if topo.is_root else None)
        self.root = os.path.abspath(config.directory)
        self.attempt = topo.control.bcast(uuid.uuid4().hex[:8] if topo.is_root else None, root=0)
        remove_stale_areas()
        self.snapshots = Snapshotter(model, with_dense=topo.is_root)
        self.writers = WriterPool(config.writers)
        self.commits = CommitCoordinator(topo, self.root, config.keep, self._say)
        self.counters = {"saved": 0, "waits": 0, "skips": 0, "wait_seconds": 0.0}
        self.stalls: list[float] = []
        self._in_flight: dict | None = None
        self.snapshots.prepare()  # allocate and pre-fault staging now, not in the first stall
        self.planner = self._make_planner()
        self.tracker = None
        if self.planner.tracks_rows:
            self.tracker = RowBitVector(model.plan.local_rows(topo.rank), device=topo.device)
            self._untrack = self.tracker.attach(model.embeddings)
        self.extractor = (ExtractorClient(self.root, config.incrcp_ratio, self._say)
                          if config.kind == "incrcp" else None)
        self.ingestions = 0
        self._last_submitted: int | None = None
        self.bits = config.bit_policy(max(1, topo.world_size // max(1, topo.local_size)))
        self._say(self.bits.explain())

    def _make_planner(self) -> KindPlanner:
        from mpi4py import MPI

        comm = self.topo.control

        def reduce(values, op):
            out = np.empty_like(values)
            comm.Allreduce(values, out, op=op)
            return out

        return KindPlanner(self.config.kind, self.model.plan.local_rows(self.topo.rank),
                           int(sum(self.model.plan.table_sizes)),
                           lambda v: reduce(v, MPI.SUM), lambda v: reduce(v, MPI.MAX),
                           self.config.incrcp_reset)

    def _say(self, line: str) -> None:
        if self.topo.is_root:
            self.log(line)

    # ---- training-loop hooks -------------------------------------------------------------
    def allowance(self, step: int, total: int) -> int:
        """Batches the reader may deliver after `step`: up to the next checkpoint or the end. Local."""
        interval = self.config.interval
        return max(0, min((step // interval + 1) * interval, total) - step)

    def after_step(self, step: int, reader, total: int) -> None:
        """Call after every training step. Collective when a checkpoint is due, else local."""
        self.poll()
        if step % self.config.interval == 0:
            self.save(step, reader.state().to_dict())
            reader.allow(self.allowance(step, total))

    def poll(self) -> None:
        """Collect finished writes and move commit messages along; never blocks. Local."""
        results = self.writers.poll()
        if results is not None:
            self._report(results)
        self.commits.progress()
        if self.extractor is not None:
            self._ingested(self.extractor.poll())

    def _ingested(self, results: list[dict]) -> None:
        for r in results:
            if not r["ok"]:
                print(f"mpickpt: rank {self.topo.rank}: incrcp {r['error']} (the checkpoint "
                      f"stays restorable from its chunk file)", flush=True)
                continue
            self.planner.record_restore(r["chain"], r["step"], r["restore_seconds"])
            st = r["stats"]
            if st["compared"] or st["dropped_refs"]:
                self._say(f"incrcp step {r['step']}: compared {st['compared']} row-0 chunks "
                          f"(skipped by range {st['skipped_range']}, Bloom {st['skipped_bloom']}, "
                          f"ratio {st['skipped_ratio']}), extracted {st['extracted_rows']} rows "
                          f"from {st['extracted_chunks']} chunks into "
                          f"{st['bundle_bytes'] / 1e6:.2f} MB of bundles, dropped "
                          f"{st['dropped_refs']} chunks, deleted {st['deleted_files']} files in "
                          f"{st['seconds']:.2f} s; restore of its increments "
                          f"{r['restore_seconds'] * 1e3:.1f} ms")

    # ---- saving ----------------------------------------------------------------------------
    def save(self, step: int, reader_state: dict) -> bool:
        """Snapshot now and write in the background; False if skipped. Collective."""
        busy = self.topo.control.allreduce(int(self.writers.busy), op=_max_op())
        if busy and not self._make_room(step):
            return False  # tracked rows stay marked for the next checkpoint
        if self.tracker is not None:
            self._settle()
            changed = self.tracker.extract().cpu().numpy()
        save = self.planner.plan(step, changed if self.tracker is not None else None, self.attempt)
        seconds, nbytes = self.snapshots.stage()
        self.stalls.append(seconds)
        ckpt_id = f"step-{step:012d}-{self.attempt}"
        self._submit(step, ckpt_id, seconds, nbytes, save)
        if self.topo.is_root:
            self.commits.expect(self._pending(step, ckpt_id, reader_state, save))
        self.counters["saved"] += 1
        what = "all rows" if save.rows is None else f"{len(save.rows)} changed rows on rank 0"
        self._say(f"checkpoint step {step} ({save.kind}; {what}; {save.reason or 'every row'}): "
                  f"staged {nbytes / 1e6:.1f} MB in {seconds * 1e3:.1f} ms "
                  f"({nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s); writing in background")
        return True

    def _settle(self) -> None:
        """Make sure the previous checkpoint is committed or abandoned, and start a new baseline
        after an abandoned one (its rows are no longer in the tracker). Collective."""
        results = self.writers.wait()
        if results is not None:
            self._report(results)
        self.commits.drain()
        last = self._last_submitted
        ok = last is None or (self.topo.is_root and last in self.commits.committed)
        if last is not None and not self.topo.control.bcast(ok, root=0):
            self._say(f"checkpoint step {last} was abandoned: the next checkpoint is a new full "
                      f"baseline")
            self.planner.reset()

    def _make_room(self, step: int) -> bool:
        if self.config.overlap == "skip":
            self.counters["skips"] += 1
            self._say(f"checkpoint step {step} skipped: the previous one is still being written "
                      f"(skips so far: {self.counters['skips']})")
            return False
        start = time.perf_counter()
        results = self.writers.wait()
        if results is not None:
            self._report(results)
        waited = self.topo.control.allreduce(time.perf_counter() - start, op=_max_op())
        self.counters["waits"] += 1
        self.counters["wait_seconds"] += waited
        self._say(f"checkpoint step {step}: waited {waited * 1e3:.0f} ms for the previous "
                  f"checkpoint to finish writing (waits so far: {self.counters['waits']})")
        return True

    def _submit(self, step: int, ckpt_id: str, stall: float, staged: int, save) -> None:
        parts = self.writers.size
        files = shard_file_specs(self.model, self.root, ckpt_id, step, parts, rng_blobs(), save,
                                 self.bits.row_codecs(self.model.row_state()))
        if save.kind == "incrcp":  # the extra file rides with the first part
            files = [[files[0], files[1]], *[[f] for f in files[2:]]]
        else:
            files = [[f] for f in files]
        jobs = [{"step": step, "dir": os.path.join(self.root, ckpt_id), "files": f,
                 "staging": self.snapshots.area.describe()} for f in files]
        if self.topo.is_root:
            jobs[-1]["files"].append(dense_file_spec(self.model, self.root, ckpt_id, step))
        rows = self.model.plan.local_rows(self.topo.rank) if save.rows is None else len(save.rows)
        self._in_flight = {"step": step, "stall_seconds": stall, "staged_bytes": staged,
                           "rows": int(rows), "kind": save.kind, "chain": save.chain}
        self._last_submitted = step
        self.writers.submit(jobs)

    def _pending(self, step: int, ckpt_id: str, reader_state: dict, save) -> PendingCheckpoint:
        m = self.model
        fields = {"kind": save.kind, "world_size": self.topo.world_size, "dim": m.embeddings.dim,
                  "plan": m.plan.describe(), "optimizer": m.embeddings.optimizer.config.kind,
                  "codec": self.bits.weight_codec().label(), "parents": list(save.parents),
                  "chain": save.chain,
                  "stats": {"row_arrays": sorted(m.row_state()), "parts": self.writers.size,
                            "codecs": {k: c.attrs()["codec"]
                                       for k, c in self.bits.row_codecs(m.row_state()).items()},
                            "restores": self.bits.restores,
                            "policy": self.config.kind, "decision": save.reason,
                            **({"columns": save.columns} if save.columns else {})}}
        return PendingCheckpoint(step, ckpt_id, reader_state, fields)

    def _report(self, results: list[dict]) -> None:
        meta, self._in_flight = self._in_flight, None
        kind, chain = meta.pop("kind"), meta.pop("chain")
        errors = [r["error"] for r in results if not r["ok"]]
        files = {k: v for r in results if r["ok"] for k, v in r["files"].items()}
        report = {**meta, "rank": self.topo.rank, "ok": not errors,
                  "error": errors[0] if errors else None,
                  # incrcp chunk files belong to the chunk store, not to one checkpoint
                  "files": {k: v for k, v in files.items() if v["role"] != "chunk"},
                  "bytes": sum(r.get("bytes", 0) for r in results),
                  "seconds": max(r.get("seconds", 0.0) for r in results)}
        if not errors:
            self.planner.record_write(kind, report["seconds"])
            if kind == "incrcp":
                self._ingest(meta["step"], chain)
        if errors:
            print(f"mpickpt: rank {self.topo.rank}: checkpoint step {meta['step']} write failed: "
                  f"{errors[0]}", flush=True)
        self.commits.report(report)

    def _ingest(self, step: int, chain: str) -> None:
        self.ingestions += 1
        crash = (self.config.inject_extract_crash == self.ingestions and self.topo.is_root)
        self.extractor.submit({"root": self.root, "chain": chain, "rank": self.topo.rank,
                               "step": step, "parts": self.writers.size,
                               "row_names": sorted(self.model.row_state()),
                               "crash_before_commit": crash})

    # ---- restoring -------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """A checkpoint is taken after `step`. Local."""
        return step % self.config.interval == 0

    def restore_latest(self) -> Restored | None:
        """Mid-run rollback: let the checkpoint in flight finish, load the newest committed one
        whatever --resume says, and make the next checkpoint a new full baseline. Collective.
        None when nothing is committed."""
        results = self.writers.wait()
        if results is not None:
            self._report(results)
        self.commits.drain()
        restored = self.restore(latest=True)
        self.planner.reset()
        return restored

    def restore(self, latest: bool = False) -> Restored | None:
        """Load the newest valid checkpoint (or the chosen step, unless `latest`) into the model.
        Collective.

        Returns None when resuming is off or nothing is committed yet. Raises CheckpointError when
        checkpoints exist but none can be used (or the chosen one cannot)."""
        if self.config.resume == "none" and not latest:
            return None
        listing = committed(self.root) if self.topo.is_root else None
        manifests, torn = self.topo.control.bcast(listing, root=0)
        self._drop_torn(torn)
        candidates = list(reversed(manifests)) if latest else self._candidates(manifests)
        by_step = {m.step: m for m in manifests}
        problems = []
        for manifest in candidates:
            error, loaded = self._try_load(manifest, by_step)
            errors = [e for e in self.topo.control.allgather(error) if e]
            if not errors:
                return self._apply(loaded)
            problems.append(errors[0])
            self._say(f"checkpoint step {manifest.step} unusable: {errors[0]}"
                      + ("; falling back to the previous one" if manifest is not candidates[-1] else ""))
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.root}: " + "; ".join(problems))
        return None

    def _drop_torn(self, torn: list[str]) -> None:
        for d in torn:
            self._say(f"ignoring {os.path.join(self.root, d)}: no manifest (torn or abandoned "
                      f"checkpoint); removing it")
        if self.topo.is_root:
            for d in torn:
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)

    def _candidates(self, manifests: list[Manifest]) -> list[Manifest]:
        want = self.config.resume_step
        if want is None:
            return list(reversed(manifests))
        chosen = [m for m in manifests if m.step == want]
        if not chosen:
            steps = [m.step for m in manifests]
            raise CheckpointError(f"no committed checkpoint at step {want} in {self.root} "
                                  f"(committed steps: {steps or 'none'})")
        return chosen

    def _try_load(self, manifest: Manifest, by_step: dict):
        templates = {k: (tuple(t.shape[1:]), np.dtype(numpy_dtype(t)))
                     for k, t in self.model.row_state().items()}
        try:
            return None, load_checkpoint(self.root, manifest, self.model.plan, self.topo.rank,
                                         self.model.embeddings.dim, templates, by_step)
        except (CheckpointError, OSError, KeyError, ValueError, RuntimeError) as e:
            return str(e), None  # RuntimeError: h5py on corrupted HDF5 metadata

    def _apply(self, loaded) -> Restored:
        self.model.load_row_state(loaded.rows)
        self.model.load_dense_state(loaded.dense)
        if "torch_cpu_rng" in loaded.rng:
            torch.set_rng_state(torch.frombuffer(bytearray(loaded.rng["torch_cpu_rng"]),
                                                 dtype=torch.uint8))
        m = loaded.manifest
        self._say(f"resumed from checkpoint step {m.step} ({m.kind}, {m.codec}, written by "
                  f"{m.world_size} ranks, {m.total_bytes() / 1e6:.1f} MB) onto "
                  f"{self.topo.world_size} ranks")
        fallback = self.bits.note_restore(int(m.stats.get("restores", 0)) + 1)
        if fallback:
            self._say(fallback)
        self._say(self.bits.explain())
        return Restored(m.step, m.reader_state)

    # ---- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the checkpoint in flight, commit it, stop the writers. Collective. Safe twice."""
        if self.writers is None:
            return
        results = self.writers.wait()
        if results is not None:
            self._report(results)
        self.commits.drain()
        self.commits.close()
        if self.extractor is not None:
            self._ingested(self.extractor.drain())
            self.extractor.close()
        self.topo.control.Barrier()
        self.writers.close()
        self.snapshots.close()
        self.writers = None
        s = self.counters
        if s["saved"]:
            self._say(f"checkpoints: {s['saved']} saved, {len(self.commits.committed)} committed, "
                      f"{len(self.commits.abandoned)} abandoned, {s['waits']} waits "
                      f"({s['wait_seconds']:.2f} s), {s['skips']} skips; mean stall "
                      f"{np.mean(self.stalls) * 1e3:.1f} ms")


    def abort(self) -> None:
        """Stop writers and free staging without committing (error paths). Local. Safe twice."""
        if self.writers is None:
            return
        self.writers.close()
        self.snapshots.close()
        self.commits.close()
        if self.extractor is not None:
            self.extractor.close()
        self.writers = None


def _max_op():
    from mpi4py import MPI

    return MPI.MAX
