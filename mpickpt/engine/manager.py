"""CheckpointManager: decoupled checkpoints for any synchronous training loop (Check-N-Run §3).

Usage (every call is collective unless it says local)::

    ckpt = CheckpointManager(topo, CheckpointConfig(directory=..., interval=100), model, log=print)
    resume = config.resume_in_force(os.environ)[0]  # a chosen step: the first launch's
    restored = Restorer(topo, config.directory, model, ckpt.say, resume, total).restore()
    if restored is not None:
        ckpt.restored(restored)                    # the next save is a new baseline
    reader = PrefetchReader(..., state=..., allowance=ckpt.allowance(step, total))
    for step in range(start + 1, total + 1):
        model.train_step(reader.next())
        ckpt.after_step(step, reader, total)       # snapshot when due, commit in background
    ckpt.close()

`model` provides `plan`, `topo`, `embeddings.local_gids`, `row_state()`, `dense_state()`,
`load_row_state()`, `load_dense_state()` (see `mpickpt.model.hybrid.HybridDLRM`).

The manager owns saving: the overlap policy, the staging area and its writers, and the commit
protocol; restore lives in `engine.restorer`, the incremental machinery (kind planner, row tracker,
IncrCP extractor) in `engine.incremental`.
"""
from __future__ import annotations

import os
import shutil
import time
import uuid

import numpy as np

from mpickpt.background_priority import Background
from mpickpt.control import MAX
from mpickpt.engine.commit import CommitCoordinator, PendingCheckpoint
from mpickpt.engine.config import DEFAULT_INTERVAL, CheckpointConfig
from mpickpt.engine.copy_on_update import SLOW_COPY_ROWS, CopyOnUpdate
from mpickpt.engine.incremental import IncrementalSaves
from mpickpt.engine.schedule import CheckpointSchedule
from mpickpt.engine.snapshot import Snapshotter, dense_file_spec, rng_blobs, save_file_specs
from mpickpt.engine.staging import remove_stale_areas
from mpickpt.engine.writer_pool import WriterPool
from mpickpt.store.file_spec import checkpoint_id


class CheckpointManager:
    """Snapshots, background writers and commit for one rank. Construction is collective."""

    def __init__(self, topo, config: CheckpointConfig, model, log=None, split=None):
        """`on_saved(step)`, when set, may re-plan `schedule` after each save. `split`: a
        `mpickpt.engine.core_split.CoreSplit` whose background cores the writers, the
        extractor, the copier and the commit thread keep to (None: they run anywhere)."""
        self.topo, self.config, self.model = topo, config, model
        self.log = log or (lambda line: print(line, flush=True) if topo.is_root else None)
        self.root = os.path.abspath(config.directory)
        # a replacement process takes the job's attempt id from a survivor when it joins
        self.attempt = None if getattr(topo, "replacement", False) else \
            topo.control.bcast(uuid.uuid4().hex[:8] if topo.is_root else None, root=0)
        remove_stale_areas()
        self.snapshots = Snapshotter(model, with_dense=topo.is_root)
        background = Background(config.background, split.background if split else None)
        self.copier = self._copier(config, model, self.say, split)
        self._deferred: list | None = None
        """The writer jobs of a snapshot whose rows are still being copied (copy-on-update)."""
        self.writers = WriterPool(config.writers, background)
        if self.writers.priority_problem:
            self.say(f"the checkpoint writers run at their start priority: "
                     f"{self.writers.priority_problem}")
        self.commits = CommitCoordinator(topo, self.root, config.keep, self.say, background)
        self.counters = {"saved": 0, "waits": 0, "skips": 0, "wait_seconds": 0.0}
        self.stalls: list[float] = []
        self._in_flight: dict | None = None
        self.snapshots.prepare()  # allocate and pre-fault staging now, not in the first stall
        if self.copier is not None and not self.snapshots.copier_can_write:
            self.say("--ckpt-snapshot copy-on-update: the staging area could not be page-locked "
                     "and mapped for the GPU; snapshots stay stop-the-world")
        self.incremental = IncrementalSaves(topo, config, model, self.root, self.say,
                                            background)
        self.schedule = CheckpointSchedule(config.fixed_interval or DEFAULT_INTERVAL)
        self.on_saved = None
        self.stats_sources: list = []
        """Callables returning dicts merged into every manifest's stats (e.g. the running PLS)."""
        self.save_seconds: list[float] = []
        """Wall time of every save() on this rank: its stall and any wait (O_save)."""
        self.write_seconds: list[float] = []
        """Background write time of every finished checkpoint on this rank."""
        self.write_cpu_seconds: list[float] = []
        """CPU seconds the writers spent on each checkpoint (CRC, quantizer, HDF5), all of them."""
        self.write_bytes: list[int] = []
        """Payload bytes this rank's writers wrote for each checkpoint."""
        self.commits_since: int | None = None
        """The step from which rank 0's commit counts run (its replacement's join), else
        None: the run's start."""
        self._last_submitted: int | None = None
        self._restored_step: int | None = None
        self._vote: tuple | None = None
        """(step, request) of the busy vote started a step before that step's save."""
        self.bits = config.quant.policy(max(1, topo.world_size // max(1, topo.local_size)))
        self._bits_said = ""
        self._say_bits()
        self.codec_threads = self._codec_threads(config, topo)
        """Quantizer threads of each writer: the rank's free cores over its writers."""

    def _codec_threads(self, config, topo) -> int:
        import torch

        from mpickpt.engine import free_cores

        threads = free_cores.codec_threads(topo.local_size, config.writers, topo.device.type,
                                           torch.get_num_threads())
        if str(config.quant.bits) not in ("32", "16"):
            self.say(f"quantizer: {threads} thread(s) in each of {config.writers} writer(s) "
                     f"({free_cores.cores_available()} cores, {topo.local_size} rank(s) on "
                     f"this node, training on {topo.device.type})")
        return threads

    @staticmethod
    def _copier(config, model, say, split=None):
        """The copy-on-update hook, when asked for and the rows' device can run it (CPU, or a
        CUDA device with the kernels of kernels/pending_rows.cu; else stop-the-world, saying
        why). Local."""
        if config.snapshot != "copy-on-update":
            return None
        from mpickpt.model.contract import COPY_ON_UPDATE, require

        require(model, COPY_ON_UPDATE)
        options = {} if config.inject_slow_copy is None else \
            {"chunk_rows": SLOW_COPY_ROWS, "pause_s": config.inject_slow_copy}  # fault tests
        if split is not None:
            options["place"] = lambda: split.pin_background([0])
        if model.topo.device.type == "cpu":
            return CopyOnUpdate(model, **options)
        from mpickpt.engine.pending_rows_cuda import unusable

        why = unusable(model.topo.device)
        if why is None:
            loose = [n for n, t in model.row_state().items() if not t.is_contiguous()]
            why = f"row arrays {loose} are not contiguous" if loose else None
        if why is None:
            try:
                return CopyOnUpdate(model, **options)  # compiles the kernels
            except Exception as e:  # a CuPy or driver problem: checkpoints go on as they were
                why = f"its kernels failed to load ({type(e).__name__}: {e})"
        say(f"--ckpt-snapshot copy-on-update: {why}; snapshots stay stop-the-world")
        return None

    @property
    def kind(self):
        """The `Kind` this manager's saves follow. Local."""
        return self.incremental.planner.kind

    def say(self, line: str) -> None:
        """Log `line` once for the job (rank 0). Local."""
        if self.topo.is_root:
            self.log(line)

    # ---- training-loop hooks -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """The writers are stopped (`close`, `abort`): the run's checkpoints are over, as after
        the run's end, and a rollback after it replays steps without saving. Local."""
        return self.writers is None

    def allowance(self, step: int, total: int) -> int:
        """Batches the reader may deliver after `step`: up to the next checkpoint or the end
        (closed: the end). Local."""
        if self.closed:
            return max(0, total - step)
        return self.schedule.allowance(step, total)

    def due(self, step: int) -> bool:
        """A checkpoint is taken after `step`. Local."""
        return self.schedule.due(step)

    def after_step(self, step: int, reader, total: int) -> None:
        """Call after every training step. Collective when a checkpoint is due, else local (a
        no-op once closed)."""
        if self.closed:
            return
        self.poll()
        if self.due(step):
            self.save(step, reader.state().to_dict())
            self.schedule.passed(step)
            if self.on_saved is not None:
                self.on_saved(step)  # may re-plan the interval (collective)
            reader.allow(self.allowance(step, total))
        self.look_ahead(step)

    def look_ahead(self, step: int) -> None:
        """After `step`: when the next step's checkpoint is due, start the ranks' vote on
        whether a previous one is still being written, so that the save does not wait for a
        round trip (`_any_busy`). `after_step` calls it. Collective when the next step is due
        (every rank issues it after the same step), else local."""
        if self.due(step + 1):
            self._start_vote(step + 1)

    def poll(self) -> None:
        """Collect finished writes and move commit messages along; never blocks. Local."""
        self._submit_deferred(block=False)
        results = self.writers.poll()
        if results is not None:
            self._report(results)
        self.commits.progress()
        self.incremental.poll()

    def resumed_at(self, step: int) -> None:
        """Training continues after `step` with state from elsewhere (a checkpoint, survivor
        dumps): the next save is a new baseline and the interval counts from `step`. Local."""
        self.incremental.reset()
        self.schedule.restart(step)
        self._vote = None  # its step may come again (a rollback), with other writes in flight

    def restored(self, restored) -> None:
        """The model was just loaded from a checkpoint (`Restorer`): count the restore for the
        bit-width policy, start the next save with a new baseline, and count the interval from
        the restored step. Local."""
        self.resumed_at(restored.step)
        self._restored_step = restored.step  # in storage already: save_now need not write it
        fallback = self.bits.note_restore(restored.restores)
        if fallback:
            self.say(fallback)
        self._say_bits()

    def _say_bits(self) -> None:
        """Log the bit-width choice with its inputs where it differs from the last said (a
        restore changes it only under --ckpt-bits auto). Local."""
        text = self.bits.explain()
        if text != self._bits_said:
            self.say(text)
            self._bits_said = text

    def partially_restored(self, restored) -> None:
        """Some rows were just reloaded from a checkpoint (partial recovery): count the restore
        for the bit-width policy (those rows went through its codec once more). Local."""
        fallback = self.bits.note_restore(restored.restores)
        if fallback:
            self.say(fallback)

    def leave_generation(self) -> list[int]:
        """A peer died: the checkpoints in flight cannot commit (the dead rank's part is
        missing). Wait for this rank's writers (their results are dropped), have rank 0
        abandon what it was waiting for (the newest committed checkpoint stays the newest;
        their directories go once the next generation formed, `generation_formed`), and make
        the next save a new baseline. Returns the abandoned steps (rank 0; empty elsewhere).
        Local."""
        if self.writers is None:
            return []
        if self.copier is not None:
            self.copier.cancel()
        self._deferred = self._vote = None  # the vote ran on the broken generation's channel
        self.writers.wait()
        self._in_flight = None
        self._last_submitted = None
        self.incremental.reset()
        return self.commits.forget_pending("a rank died before every rank had written it")

    def generation_formed(self) -> None:
        """The next generation formed: the directories of the checkpoints its survivors left
        unfinished go now (rank 0, on its commit thread: set aside under names of their own,
        waited for, then deleted behind training, `CommitCoordinator.remove_forgotten`).
        Removed when the generation broke, they lost files another survivor's writer was still
        writing: it reported a failed write, and a later file of its could make the directory
        anew. Local."""
        self.commits.remove_forgotten()

    def newest_committed(self) -> int | None:
        """The newest step this manager committed, or None. Collective (rank 0 knows)."""
        mine = max(self.commits.committed) if self.topo.is_root and self.commits.committed \
            else None
        return self.topo.control.bcast(mine, root=0)

    def finish_snapshot(self) -> None:
        """A copy-on-update snapshot in progress is completed now and handed to the writers:
        call before anything rewrites rows outside a training step (a recovery, a restore).
        Local."""
        self._vote = None  # what follows (a recovery) may submit or roll back
        self._submit_deferred(block=True)

    def _submit_deferred(self, block: bool) -> None:
        """Hand the deferred writer jobs over once the rows are copied (`block`: copy the rest
        now). A copier failure abandons this checkpoint, never training. Local."""
        if self._deferred is None or (not block and self.copier.active):
            return
        jobs, self._deferred = self._deferred, None
        try:
            self.copier.finish()
        except RuntimeError as e:
            print(f"mpickpt: rank {self.topo.rank}: {e}", flush=True)
            self._report([{"ok": False, "error": str(e)}])
            return
        self.writers.submit(jobs)

    @property
    def busy(self) -> bool:
        """A checkpoint is being copied or written on this rank. Local."""
        return not self.closed and (self._deferred is not None or self.writers.busy)

    def settle(self) -> None:
        """Let the checkpoint in flight finish and commit. Collective; nothing once closed (all
        its checkpoints committed or abandoned)."""
        if self.closed:
            return
        self._submit_deferred(block=True)
        results = self.writers.wait()
        if results is not None:
            self._report(results)
        self.commits.drain()

    def quiesce(self) -> None:
        """Settle, and let the background companion (IncrCP's extractor) finish what it was
        handed, so that nothing changes under a restore that reads the newest checkpoint (a
        chunk index generation read before an extraction commits can name a column file the
        extraction then deletes). Collective, closed or not: in a generation formed after the
        run's end some members closed their managers and others not, with nothing in flight in
        any (the generation abandoned it), and all make the barrier."""
        self.settle()
        self.incremental.poll(drain=True)
        self.topo.control.Barrier()

    # ---- saving ----------------------------------------------------------------------------
    def urgent(self) -> None:
        """Training is over or stopping: the background (writers, extractor) runs at normal
        priority from now on, to finish what is left as fast as it can. Local; a no-op once
        closed (a stop closes the manager before the run's end)."""
        if self.writers is None:
            return
        self.writers.prioritize("normal")
        self.incremental.prioritize("normal")
        self.commits.prioritize("normal")

    def save_now(self, step: int, reader) -> bool:
        """A checkpoint of `step` outside the interval (an emergency stop), waiting for the one
        in flight whatever the overlap policy; False when `step` was just saved or the manager
        is closed. Collective."""
        if self.closed or step in (self._last_submitted, self._restored_step):
            return False
        return self.save(step, reader.state().to_dict(), wait=True)

    def save(self, step: int, reader_state: dict, wait: bool = False) -> bool:
        """Snapshot now and write in the background; False if skipped (the overlap policy
        `skip`, unless `wait`). Collective."""
        start = time.perf_counter()
        busy = self._any_busy(step)
        if busy and not self._make_room(step, wait):
            return False  # tracked rows stay marked for the next checkpoint
        if self.incremental.tracks_rows:
            self._settle()
        save = self.incremental.plan(step, self.attempt)
        seconds, nbytes = self.snapshots.stage(self.copier, save.rows)
        self.stalls.append(seconds)
        ckpt_id = checkpoint_id(step, self.attempt)
        codecs = self.bits.row_codecs(self.model.row_state())
        self._submit(step, ckpt_id, seconds, nbytes, save, codecs)
        if self.topo.is_root:
            self.commits.expect(self._pending(step, ckpt_id, reader_state, save, codecs))
        self.counters["saved"] += 1
        if self.copier is not None:
            self.copier.go()  # the stall ends here: the background copy may begin
        self.save_seconds.append(time.perf_counter() - start)
        what = "all rows" if save.rows is None else f"{len(save.rows)} changed rows on rank 0"
        self.say(f"checkpoint step {step} ({save.kind}; {what}; {save.reason or 'every row'}): "
                 f"staged {nbytes / 1e6:.1f} MB in {seconds * 1e3:.1f} ms "
                 f"({nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s); writing in background")
        return True

    def _start_vote(self, step: int) -> None:
        """Start, a step ahead, the ranks' vote on whether a previous checkpoint is still being
        written when `step` is saved; it runs while the step trains. Collective (issued by
        every rank after the same step)."""
        self._vote = (step, self._vote_request())

    def _any_busy(self, step: int) -> bool:
        """Whether any rank's previous checkpoint is still being written. The vote started a
        step ahead answers without a round trip in the stall when nobody was busy then:
        nothing was submitted since, and a write only ends meanwhile. Otherwise (busy then, or
        no vote: a save outside the schedule) the ranks vote now. Collective."""
        vote, self._vote = self._vote, None
        if vote is not None and vote[0] == step and not vote[1].Wait()[0]:
            return False
        return bool(self._vote_request().Wait()[0])

    def _vote_request(self):
        """Start the max over the ranks of this rank's `busy`: one array allreduce, not the
        pickled object one (two round trips). Collective."""
        return self.topo.control.Iallreduce(np.array([int(self.busy)], dtype=np.int64),
                                            np.zeros(1, dtype=np.int64), op=MAX)

    def _settle(self) -> None:
        """Make sure the previous checkpoint is committed or abandoned, and start a new baseline
        after an abandoned one (its rows are no longer in the tracker). Collective."""
        self.settle()
        last = self._last_submitted
        ok = last is None or (self.topo.is_root and last in self.commits.committed)
        if last is not None and not self.topo.control.bcast(ok, root=0):
            self.say(f"checkpoint step {last} was abandoned: the next checkpoint is a new full "
                     f"baseline")
            self.incremental.reset()

    def _make_room(self, step: int, wait: bool = False) -> bool:
        if self.config.overlap == "skip" and not wait:
            self.counters["skips"] += 1
            self.say(f"checkpoint step {step} skipped: the previous one is still being written "
                     f"(skips so far: {self.counters['skips']})")
            return False
        start = time.perf_counter()
        self._submit_deferred(block=True)
        results = self.writers.wait()
        if results is not None:
            self._report(results)
        waited = self.topo.control.allreduce(time.perf_counter() - start, op=MAX)
        self.counters["waits"] += 1
        self.counters["wait_seconds"] += waited
        self.say(f"checkpoint step {step}: waited {waited * 1e3:.0f} ms for the previous "
                 f"checkpoint to finish writing (waits so far: {self.counters['waits']})")
        return True

    def _submit(self, step: int, ckpt_id: str, stall: float, staged: int, save,
                codecs: dict) -> None:
        groups = save_file_specs(self.model, self.root, ckpt_id, step, self.writers.size, save,
                                 codecs, rng_blobs(), self.snapshots.compact)
        jobs = [{"step": step, "dir": os.path.join(self.root, ckpt_id), "files": files,
                 "staging": self.snapshots.area.describe(), "align": self.config.align,
                 "io": self.config.io,
                 "codec_threads": self.codec_threads}
                for files in groups]
        if self.topo.is_root:
            jobs[-1]["files"].append(dense_file_spec(self.snapshots.dense_shapes, self.root,
                                                     ckpt_id, step))
        rows = self.model.plan.local_rows(self.topo.rank) if save.rows is None else len(save.rows)
        self._in_flight = {"step": step, "stall_seconds": stall, "staged_bytes": staged,
                           "rows": int(rows), "save": save}
        self._last_submitted = step
        if self.copier is not None and self.copier.active:
            self._deferred = jobs  # handed over by poll() once the rows are copied
        else:
            self.writers.submit(jobs)

    def _pending(self, step: int, ckpt_id: str, reader_state: dict, save,
                 codecs: dict) -> PendingCheckpoint:
        m = self.model
        fields = {"kind": save.kind, "world_size": self.topo.world_size, "dim": m.embeddings.dim,
                  "plan": m.plan.describe(), "optimizer": m.embeddings.optimizer.config.kind,
                  "codec": self.bits.weight_codec().label(), "parents": list(save.parents),
                  "chain": save.chain,
                  "stats": {"row_arrays": sorted(m.row_state()), "parts": self.writers.size,
                            **_architecture(m),
                            "codecs": {k: c.attrs()["codec"] for k, c in codecs.items()},
                            "restores": self.bits.restores,
                            "policy": self.config.kind, "decision": save.reason,
                            **({"columns": save.columns} if save.columns else {}),
                            **{k: v for source in self.stats_sources
                               for k, v in source().items()}}}
        return PendingCheckpoint(step, ckpt_id, reader_state, fields)

    def _report(self, results: list[dict]) -> None:
        meta, self._in_flight = self._in_flight, None
        save = meta.pop("save")
        errors = [r["error"] for r in results if not r["ok"]]
        files = {k: v for r in results if r["ok"] for k, v in r["files"].items()}
        report = {**meta, "rank": self.topo.rank, "ok": not errors,
                  "error": errors[0] if errors else None,
                  # chunk files belong to the chunk store, not to one checkpoint
                  "files": {k: v for k, v in files.items() if v["role"] != "chunk"},
                  "bytes": sum(r.get("bytes", 0) for r in results),
                  "seconds": max(r.get("seconds", 0.0) for r in results)}
        if not errors:
            self.write_seconds.append(report["seconds"])
            self.write_cpu_seconds.append(sum(r.get("cpu_seconds", 0.0) for r in results))
            self.write_bytes.append(report["bytes"])
            self.incremental.written(save, meta["step"], report["seconds"], self.writers.size,
                                     list(self.model.row_state()))
        if errors:
            print(f"mpickpt: rank {self.topo.rank}: checkpoint step {meta['step']} write failed: "
                  f"{errors[0]}", flush=True)
        self.commits.report(report)

    # ---- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the checkpoint in flight, commit it, stop the writers. Collective. Safe twice."""
        if self.writers is None:
            return
        self.settle()
        self.commits.close()
        self.incremental.close()
        self.topo.control.Barrier()
        for line in self.writers.close():
            print(f"mpickpt: rank {self.topo.rank}: {line}", flush=True)
        self.snapshots.close()
        self.writers = None
        self._summary()

    RECORDED = ("counters", "stalls", "save_seconds", "write_seconds", "write_cpu_seconds",
                "write_bytes")
    """What `record` hands to a replacement of rank 0."""

    def record(self) -> dict:
        """This rank's counts and times of the run's checkpoints so far. Local."""
        return {name: getattr(self, name) for name in self.RECORDED}

    def adopt(self, record: dict, step: int) -> None:
        """Go on from a survivor's `record`: this process replaces rank 0 at `step`. The
        commits and abandons rank 0 counted before died with it; the summary says from when
        they are counted. Local."""
        for name in self.RECORDED:
            setattr(self, name, record[name])
        self.commits_since = step

    def drop_unfinished(self) -> None:
        """This process replaces rank 0, which coordinated the commits: the checkpoints that
        were in flight when it died never commit. Remove their directories (no writer of the
        generation it died in writes any more; none of this one has started), saying so.
        Local (rank 0)."""
        from mpickpt.store.manifest import list_manifests, torn_dirs

        for d in torn_dirs(self.root, list_manifests(self.root)):
            self.say(f"checkpoint {d} abandoned: rank 0, which was to commit it, died; "
                     f"removing its directory")
            shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)

    def _summary(self) -> None:
        """The run's checkpoints in one line (rank 0), where any was saved. Local."""
        s = self.counters
        if s["saved"]:
            since = "" if self.commits_since is None else \
                f" since rank 0's replacement joined at step {self.commits_since}"
            self.say(f"checkpoints: {s['saved']} saved, {len(self.commits.committed)} committed, "
                     f"{len(self.commits.abandoned)} abandoned{since}, {s['waits']} waits "
                     f"({s['wait_seconds']:.2f} s), {s['skips']} skips; mean stall "
                     f"{np.mean(self.stalls) * 1e3:.1f} ms")

    def abort(self, summary: bool = False) -> None:
        """Stop writers and free staging without committing (error paths; `summary`: a close
        that another survivor completed, whose summary line this rank says as its close would
        have). Local. Safe twice."""
        if self.writers is None:
            return
        if self.copier is not None:
            self.copier.close()
        self._deferred = None
        for line in self.writers.close():
            print(f"mpickpt: rank {self.topo.rank}: {line}", flush=True)
        self.snapshots.close()
        self.commits.close()
        self.incremental.abort()
        self.writers = None
        if summary:
            self._summary()


def _architecture(model) -> dict:
    """The dense architecture for the manifest (what an export describes), when the model has
    one (`HybridDLRM.arch`). Local."""
    a = getattr(model, "arch", None)
    if a is None:
        return {}
    return {"model": {"num_dense": a.num_dense, "num_tables": a.num_tables, "dim": a.dim,
                      "bottom": list(a.bottom), "top": list(a.top)}}
