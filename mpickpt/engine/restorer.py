"""Restorer: find the newest usable committed checkpoint (or a chosen step) and load it into the
model on every rank.

Rank 0 lists the committed manifests and broadcasts them; every rank tries to load its part of a
candidate (`mpickpt.checkpoint.load`), and the ranks agree (allgather on the control channel):
either all apply that checkpoint or all move on to the previous one, with a message naming the
damaged file. Checkpoint directories without a manifest (torn or abandoned writes) are removed.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from mpickpt.control import MAX
from mpickpt.checkpoint.load import committed, load_checkpoint, load_row_range
from mpickpt.model.dense_state import dense_mismatch
from mpickpt.engine.snapshot import numpy_dtype
from mpickpt.store import leftovers, replacing, unusable
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest, remove_folders, retire_after


LOAD_ERRORS = (CheckpointError, OSError, KeyError, ValueError, RuntimeError)
"""What loading a damaged checkpoint can raise (RuntimeError: h5py on corrupted metadata)."""


@dataclass
class Restored:
    """Where training resumes."""

    step: int
    reader_state: dict
    manifest: Manifest | None = field(default=None, repr=False)
    written: dict[int, int] = field(default_factory=dict)
    """Partial restores: how many reloaded rows (over all ranks) hold the value of each step."""

    @property
    def restores(self) -> int:
        """How often the job has now been restored (the count travels in the manifests)."""
        return int(self.manifest.stats.get("restores", 0)) + 1 if self.manifest else 1


class Restorer:
    """Restore for one rank of a job writing checkpoints under `root`. `restore` is collective."""

    def __init__(self, topo, root: str, model, say, resume: str = "latest",
                 train_until: int | None = None, first_launch: bool = True):
        """`resume`: 'latest', 'none' or a step (`CheckpointConfig.resume_in_force`: a chosen
        one applies to a job's first launch); a chosen start under newer committed checkpoints
        retires them (`_replace_newer`) when the run will train past it, i.e. before
        `train_until` (None: always). `first_launch`: not a relaunch of the same command (whose
        first launch may have started over by choice, `--resume none`, beside manifests it
        cannot read): only a job's first launch refuses a directory of unreadable manifests."""
        self.topo, self.root, self.model, self.say = topo, os.path.abspath(root), model, say
        self.resume = str(resume)
        self.train_until = train_until
        self.first_launch = first_launch
        self.seconds: list[float] = []
        """Wall time of every restore, the slowest rank's (O_load)."""
        self.partial_seconds: list[float] = []
        """Wall time of every partial restore (`restore_rows`), the slowest rank's."""
        self.damaged: dict[int, str] = {}
        """Steps whose manifest is damaged or unreadable, with the message (the last listing)."""
        self._reported: set[int] = set()
        self._cleaned = False

    @property
    def resume_step(self) -> int | None:
        return int(self.resume) if self.resume.isdigit() else None

    def restore(self, latest: bool = False) -> Restored | None:
        """Load the newest valid checkpoint (or the chosen step, unless `latest`) into the model.
        A chosen step, or 'none', retires the committed checkpoints past it when the run will
        train (`_replace_newer`). Collective.

        Returns None when resuming is off (and not `latest`) or nothing is committed yet. Raises
        CheckpointError when checkpoints exist but none can be used (or the chosen one cannot),
        or when newer ones could not be retired."""
        if self.resume == "none" and not latest:
            self._replace_newer(0)
            return None
        start = time.perf_counter()
        manifests = self._committed()
        self._remove_leftovers(manifests)
        if not latest and self.resume_step is not None:
            self._record_replacing()
        candidates = list(reversed(manifests)) if latest else self._candidates(manifests)
        if not candidates and self.damaged and not latest and self.first_launch:
            raise CheckpointError(self._all_unreadable())
        into = None if latest else self._own_rows()

        def load(manifest, by_step):
            return self._try_load(manifest, by_step, into)
        found = self._first_usable(candidates, manifests, load)
        if found is None:
            return None
        restored = self._apply(found)
        if not latest and self.resume_step is not None:
            self._replace_newer(restored.step)
        self._timed(start)
        m, took = restored.manifest, self.seconds[-1]
        self.say(f"resumed from checkpoint step {m.step} ({m.kind}, {m.codec}, written by "
                 f"{m.world_size} ranks, {m.total_bytes() / 1e6:.1f} MB) onto "
                 f"{self.topo.world_size} ranks in {took:.2f} s "
                 f"({m.total_bytes() / 1e6 / max(took, 1e-9):.0f} MB/s)")
        return restored

    def restore_rows(self, shards) -> Restored | None:
        """Reload `shards` (`LostShard`s: local row ranges of some ranks) from the newest usable
        committed checkpoint: only their rows and sparse optimizer state change; the dense part
        and every other row stay. Collective (every rank takes part in the agreement, only the
        ranks named read). None when nothing is committed yet."""
        start = time.perf_counter()
        mine = [s for s in shards if s.rank == self.topo.rank]
        manifests = self._committed()

        def load(manifest, by_step):
            return self._try_rows(manifest, by_step, mine)
        found = self._first_usable(list(reversed(manifests)), manifests, load)
        if found is None:
            return None
        manifest, pieces = found
        written: dict[int, int] = {}
        for shard, (arrays, steps) in pieces:
            self.model.load_row_range(arrays, shard.start, shard.stop)
            for step, count in zip(*np.unique(steps, return_counts=True)):
                written[int(step)] = written.get(int(step), 0) + int(count)
        self._timed(start)
        self.partial_seconds.append(self.seconds[-1])
        merged: dict[int, int] = {}
        for part in self.topo.control.allgather(written):
            for step, count in part.items():
                merged[step] = merged.get(step, 0) + count
        return Restored(manifest.step, manifest.reader_state, manifest, merged)

    def newest_step(self) -> int | None:
        """The step of the newest committed checkpoint, or None. Collective."""
        manifests = self._committed()
        return manifests[-1].step if manifests else None

    def _committed(self) -> list[Manifest]:
        """Committed manifests (rank 0 lists them; torn directories are removed). Collective."""
        listing = committed(self.root) if self.topo.is_root else None
        manifests, torn, damaged = self.topo.control.bcast(listing, root=0)
        self._drop_torn(torn)
        self.damaged = dict(damaged)
        newest = manifests[-1].step if manifests else -1
        for step, why in damaged:
            if (step > newest or step == self.resume_step) and step not in self._reported:
                self._reported.add(step)
                self.say(f"checkpoint step {step} unusable: {why}"
                         + ("; falling back to an earlier one" if manifests else ""))
        return manifests

    def _first_usable(self, candidates, manifests, load):
        """The first candidate every rank could load (`load(manifest, by_step)` -> (error,
        result)), falling back past damaged ones with a message. Collective."""
        by_step = {m.step: m for m in manifests}
        problems, failed = [], []
        for manifest in candidates:
            error, loaded = load(manifest, by_step)
            errors = [e for e in self.topo.control.allgather(error) if e]
            if not errors:
                self._set_aside_newer(failed, manifest.step)
                return loaded
            problems.append(errors[0])
            failed.append(manifest)
            self.say(f"checkpoint step {manifest.step} unusable: {errors[0]}"
                     + ("; falling back to the previous one" if manifest is not candidates[-1]
                        else ""))
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.root}: " + "; ".join(problems))
        return None

    def _set_aside_newer(self, failed: list[Manifest], step: int) -> None:
        """The restore fell back to `step` past `failed`: rank 0 sets those newer than it aside
        (`store.unusable`) where the run will train past `step`, so that neither retention nor
        a relaunch takes them for the newest checkpoints, and says so. One that cannot move
        is reported and stays. Local (rank 0 acts)."""
        if not self.topo.is_root or (self.train_until is not None and step >= self.train_until):
            return
        for m in failed:
            if m.step <= step:
                continue
            try:
                folder = unusable.set_aside(self.root, m)
            except OSError as e:
                self.say(f"warning: could not set unusable checkpoint step {m.step} aside "
                         f"({e}): it stays the newest, and retention counts it among the "
                         f"checkpoints it keeps")
                continue
            self.say(f"set unusable checkpoint step {m.step} aside in {folder} (nothing "
                     f"deleted): it no longer counts as committed, and this run's checkpoints "
                     f"past step {step} take its place")

    def _all_unreadable(self) -> str:
        """Why a directory whose every manifest is unreadable is no fresh start for a job's
        first launch: training from scratch would commit over their names and then delete their
        data as torn. (A relaunch, and a recovery inside the job, start over as before: the job
        may have chosen to, `--resume none`, and not committed yet.) Local."""
        steps = ", ".join(f"step {s}: {why}" for s, why in sorted(self.damaged.items()))
        return (f"no usable checkpoint in {self.root}: every manifest there is unreadable "
                f"({steps}); repair or move them away, or start over with --resume none, which "
                f"replaces the checkpoints of the same steps")

    def _timed(self, start: float) -> None:
        self.seconds.append(self.topo.control.allreduce(time.perf_counter() - start,
                                                        op=MAX))

    def _remove_leftovers(self, manifests: list[Manifest]) -> None:
        """Once, at the job's first restore (no writer of this job runs yet): rank 0 removes what
        killed jobs left (`store.leftovers`) and says so. Local."""
        if self._cleaned or not self.topo.is_root:
            return
        self._cleaned = True
        found = leftovers.find(self.root, manifests,  # a set-aside one may use a chain too
                               chains=not self.damaged and not unusable.held(self.root))
        if found:
            freed = leftovers.remove(found)
            kinds = sorted({f.why for f in found})
            self.say(f"removed {len(found)} leftovers of earlier runs ({freed / 1e6:.1f} MB): "
                     + "; ".join(kinds))

    def _replace_newer(self, start: int) -> None:
        """The run starts at `start` by choice (`--resume STEP` or `none`) and will train past
        it: rank 0 retires the committed checkpoints past it, the timeline this run replaces
        (`retire_after`: the manifests now, their directories on a thread of their own), and
        says so. A manifest it could not delete would make a later restore resume the replaced
        timeline: CheckpointError on every rank then. Collective (rank 0 acts, every rank
        learns the outcome)."""
        if self.train_until is not None and start >= self.train_until:
            return  # nothing will be trained: nothing is replaced (e.g. digesting a checkpoint)
        outcome = None
        if self.topo.is_root:
            if self.resume == "none":
                self._record_replacing()
            steps, kept, folders = retire_after(self.root, start)
            if steps:
                self.say(f"--resume {self.resume}: retired the checkpoint(s) of step(s) {steps}, "
                         f"past step {start} where this run starts (the timeline it replaces)")
            if folders:
                threading.Thread(target=remove_folders, args=(self.root, folders, self.say),
                                 name="mpickpt-retire", daemon=True).start()
            if not kept:
                try:
                    replacing.end(self.root)
                except OSError as e:  # a relaunch would go back to `start` and retire this run
                    kept = [f"{replacing.path_of(self.root)}: {e.strerror or e}"]
            outcome = kept
        kept = self.topo.control.bcast(outcome, root=0)
        if kept:
            raise CheckpointError(f"--resume {self.resume}: could not retire the newer "
                                  f"checkpoint(s) of {self.root} ({'; '.join(kept)}): a later "
                                  f"restore would resume the timeline this run replaces")

    def _record_replacing(self) -> None:
        """Rank 0, before a chosen start's restore: settle the record that the run replaces the
        newer checkpoints (`store.replacing.settle`; the trainer wrote it already, before its
        slow start-up), so that a relaunch after a death before `_replace_newer` starts there
        again instead of resuming them. A record that cannot be written is reported, not
        fatal. Local."""
        if not self.topo.is_root:
            return
        warning = replacing.settle(self.root, self.resume, self.train_until)
        if warning:
            self.say(f"warning: {warning}")

    def _drop_torn(self, torn: list[str]) -> None:
        for d in torn:
            self.say(f"ignoring {os.path.join(self.root, d)}: no manifest (torn or abandoned "
                     f"checkpoint); removing it")
        if self.topo.is_root:
            for d in torn:
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)

    def _candidates(self, manifests: list[Manifest]) -> list[Manifest]:
        want = self.resume_step
        if want is None:
            return list(reversed(manifests))
        chosen = [m for m in manifests if m.step == want]
        if not chosen and want in self.damaged:
            raise CheckpointError(f"checkpoint step {want} cannot be used: {self.damaged[want]}")
        if not chosen:
            steps = [m.step for m in manifests]
            raise CheckpointError(f"no committed checkpoint at step {want} in {self.root} "
                                  f"(committed steps: {steps or 'none'})")
        return chosen

    def _templates(self) -> dict:
        return {k: (tuple(t.shape[1:]), np.dtype(numpy_dtype(t)))
                for k, t in self.model.row_state().items()}

    def _own_rows(self) -> dict[str, np.ndarray] | None:
        """The model's row state as numpy arrays sharing its memory, for a restore that reads
        rows straight into place: no second copy of the rows in memory, no copy into the model
        afterwards. Only where every row tensor lives on the CPU, contiguous, in a numpy dtype;
        else None (the rows are loaded apart and copied in). Only the job's first restore uses
        it: nothing else sees the model then (the survivors' watch starts after it, so no dump
        can copy rows half-way through), and a candidate that fails half-way is followed by one
        that writes every row, or by the error that ends the job. Local."""
        views, n = {}, self.model.plan.local_rows(self.topo.rank)
        for name, t in self.model.row_state().items():
            if t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 1 or len(t) != n:
                return None
            try:
                views[name] = t.detach().numpy()
            except (TypeError, RuntimeError):  # no numpy dtype (bfloat16), or a tensor subclass
                return None
        return views

    def _try_load(self, manifest: Manifest, by_step: dict, into=None):
        try:
            loaded = load_checkpoint(self.root, manifest, self.model.plan, self.topo.rank,
                                     self.model.embeddings.dim, self._templates(), by_step, into)
        except LOAD_ERRORS as e:
            return str(e), None
        differs = dense_mismatch(self.model.dense_state(), loaded.dense)
        if differs is not None:  # e.g. other MLP widths (rows already read into the model
            # are rewritten by the next candidate, or the job ends: see `_own_rows`)
            return (f"checkpoint step {manifest.step} has a dense part of other shapes than the "
                    f"model's (other MLP widths?): {differs}"), None
        return None, loaded

    def _in_place(self, rows: dict) -> bool:
        """Whether `rows` are the model's own row memory (`_own_rows`), already in place. Local."""
        mine = self.model.row_state()
        return set(rows) == set(mine) and all(
            isinstance(a, np.ndarray) and a.size and mine[k].device.type == "cpu"
            and a.__array_interface__["data"][0] == mine[k].data_ptr()
            and a.nbytes == mine[k].numel() * mine[k].element_size() for k, a in rows.items())

    def _try_rows(self, manifest: Manifest, by_step: dict, shards):
        m = self.model
        try:
            pieces = [(s, load_row_range(self.root, manifest, m.plan, self.topo.rank,
                                         m.embeddings.dim, self._templates(), by_step,
                                         (s.start, s.stop))) for s in shards]
            return None, (manifest, pieces)
        except LOAD_ERRORS as e:
            return str(e), None

    def _apply(self, loaded) -> Restored:
        if not self._in_place(loaded.rows):
            self.model.load_row_state(loaded.rows)
        self.model.load_dense_state(loaded.dense)
        if "torch_cpu_rng" in loaded.rng:
            torch.set_rng_state(torch.frombuffer(bytearray(loaded.rng["torch_cpu_rng"]),
                                                 dtype=torch.uint8))
        m = loaded.manifest
        return Restored(m.step, m.reader_state, m)
