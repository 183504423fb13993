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
from dataclasses import dataclass, field

import numpy as np
import torch

from mpickpt.checkpoint.load import committed, load_checkpoint
from mpickpt.engine.snapshot import numpy_dtype
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest


@dataclass
class Restored:
    """Where training resumes."""

    step: int
    reader_state: dict
    manifest: Manifest | None = field(default=None, repr=False)

    @property
    def restores(self) -> int:
        """How often the job has now been restored (the count travels in the manifests)."""
        return int(self.manifest.stats.get("restores", 0)) + 1 if self.manifest else 1


class Restorer:
    """Restore for one rank of a job writing checkpoints under `root`. `restore` is collective."""

    def __init__(self, topo, root: str, model, say, resume: str = "latest"):
        self.topo, self.root, self.model, self.say = topo, os.path.abspath(root), model, say
        self.resume = str(resume)

    @property
    def resume_step(self) -> int | None:
        return int(self.resume) if self.resume.isdigit() else None

    def restore(self, latest: bool = False) -> Restored | None:
        """Load the newest valid checkpoint (or the chosen step, unless `latest`) into the model.
        Collective.

        Returns None when resuming is off (and not `latest`) or nothing is committed yet. Raises
        CheckpointError when checkpoints exist but none can be used (or the chosen one cannot)."""
        if self.resume == "none" and not latest:
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
            self.say(f"checkpoint step {manifest.step} unusable: {errors[0]}"
                     + ("; falling back to the previous one" if manifest is not candidates[-1]
                        else ""))
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.root}: " + "; ".join(problems))
        return None

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
        self.say(f"resumed from checkpoint step {m.step} ({m.kind}, {m.codec}, written by "
                 f"{m.world_size} ranks, {m.total_bytes() / 1e6:.1f} MB) onto "
                 f"{self.topo.world_size} ranks")
        return Restored(m.step, m.reader_state, m)
