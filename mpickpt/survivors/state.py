"""SurvivorDumps: what a survivor of a peer's death writes, and what its relaunch restores.

Writing (`write`, local, on the way out): the rows and optimizer state of this rank's shard, the
dense part, the parity it holds, the reader position and the PLS at its last completed step, plus
what that step changed (`StepUndo`'s last record), so that the relaunch can also go back one step.

Restoring (`survey` then `restore`, collective, at the relaunch): every rank looks for its dump
(shared memory first, then the checkpoint directory) and checks it; the ranks agree on the
earliest step any valid dump holds. A rank whose dump holds that step, or the next one with the
means to undo it, is a survivor; every other rank (dead, dump missing or damaged, or rebuilt only
in part) is lost. Survivors load their dumps; the lost ranks receive the dense part, the reader
position and the PLS from the first survivor, and their shards are recovered by `--recovery`
(parity rebuild, partial recovery from the checkpoint, or a full rollback).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from mpickpt.survivors.dump import (DumpError, DumpHeader, dump_dirs, job_key, lineage,
                                    plan_id, read_array, read_header, remove_dumps, write_dump)
from mpickpt.survivors.undo import StepUndo

MODES = ("off", "shm", "ckpt")


@dataclass
class Survey:
    """What the ranks found at a relaunch (the same on every rank)."""

    usable: bool
    reason: str = ""
    step: int = 0
    survivors: list[int] = field(default_factory=list)
    lost: dict[int, str] = field(default_factory=dict)
    """Lost rank -> why."""
    undo: list[int] = field(default_factory=list)
    """Survivors that go back one step to reach `step`."""


class SurvivorDumps:
    """One rank's dumps. Construction is local and hooks the undo log into the model."""

    def __init__(self, topo, model, parity, root: str, mode: str, say,
                 undo: StepUndo | None = None):
        """`undo`: the rank's undo log (made here when not given)."""
        self.topo, self.model, self.parity, self.root = topo, model, parity, os.path.abspath(root)
        self.mode, self.say = mode, say
        self.key = job_key(self.root)
        self.undo = undo or StepUndo(model, parity.store if parity is not None else None)
        self.lineage = ""
        """This job's lineage id (set by `survey`, recorded in every dump)."""
        self.found: str | None = None
        """The dump this rank restored from at a relaunch (removed once a newer checkpoint
        commits)."""

    # ---- writing ------------------------------------------------------------------------------
    def write(self, step: int, reader_state: dict, pls: dict, dead) -> tuple[list[str], int]:
        """Dump this rank's state at its last completed step `step`; returns (where, bytes).
        Local."""
        self.undo.undo_current()
        last = self.undo.last
        header = DumpHeader(rank=self.topo.rank, world_size=self.topo.world_size,
                            plan_id=plan_id(self.model.plan), step=step,
                            reader_state=reader_state, pls=pls, dead=sorted(dead),
                            incomplete=self._incomplete(), lineage=self.lineage,
                            undo_step=last.step - 1 if last is not None else None,
                            undo_reader_state=last.reader_before if last is not None else None)
        arrays = self._arrays(last)
        dirs = dump_dirs(self.key, self.topo.rank, self.root if self.mode == "ckpt" else None)
        total = 0
        for i, d in enumerate(dirs):
            total = write_dump(d, header, arrays, durable=i > 0)
        return dirs, total

    def _incomplete(self) -> bool:
        return self.parity is not None and self.parity.rebuilding_here()

    def _arrays(self, last) -> dict[str, np.ndarray]:
        m = self.model
        out = {f"row/{k}": _np(v) for k, v in m.row_state().items()}
        out.update({f"dense/{k}": _np(v) for k, v in m.dense_state().items()})
        if self.parity is not None:
            out["parity"] = self.parity.snapshot()
        if last is None:
            return out
        if last.sparse_applied and last.rows is not None:
            out["undo/rows"], out["undo/old_words"] = _np(last.rows), _np(last.old_words)
        if last.dense_applied:
            out.update({f"undo/dense/{k}": _np(v) for k, v in last.dense_before.items()})
        if last.fold is not None:
            out["undo/fold_src"], out["undo/fold_block"] = last.fold[0], _np(last.fold[1])
        return out

    # ---- restoring ----------------------------------------------------------------------------
    def survey(self, newest_committed: int | None) -> Survey:
        """Find, check and agree on the dumps of a relaunch. Collective."""
        self._learn_lineage()
        found, reason = self._find()
        summary = None if found is None else {
            "step": found[1].step, "undo": found[1].undo_step is not None,
            "incomplete": found[1].incomplete, "parity": "parity" in found[1].files}
        everyone = self.topo.control.allgather((summary, reason))
        return decide(everyone, newest_committed, self.parity is not None)

    def _find(self) -> tuple[tuple[str, DumpHeader] | None, str]:
        """This rank's dump (shared memory first, then the checkpoint directory), checked, or
        None and why not. Local."""
        reasons = []
        for d in dump_dirs(self.key, self.topo.rank, self.root):
            try:
                header = read_header(d)
            except DumpError as e:
                reasons.append(str(e))
                continue
            if header.world_size != self.topo.world_size or header.rank != self.topo.rank or \
                    header.plan_id != plan_id(self.model.plan):
                reasons.append(f"{d}: written by rank {header.rank} of {header.world_size} "
                               f"under another shard plan")
                continue
            if header.lineage != self.lineage:
                reasons.append(f"{d}: left by an earlier job (its checkpoint directory "
                               f"{self.root} was made anew since)")
                continue
            self.found = d
            return (d, header), ""
        if all(_absent(r) for r in reasons):
            return None, "no survivor dump"
        return None, "; ".join(r for r in reasons if not _absent(r))

    @torch.no_grad()
    def restore(self, survey: Survey) -> tuple[dict, dict]:
        """Survivors load their dumps (going back one step where needed); the lost ranks wipe
        their shards and receive the dense part; every rank gets the reader position and the PLS
        of the agreed step. Returns (reader position, PLS stats). Collective."""
        me = self.topo.rank
        mine = None
        if me in survey.survivors:
            mine = self._load(self.found, back=me in survey.undo)
        first = survey.survivors[0]
        shared = self.topo.control.bcast(mine, root=first)
        if me not in survey.survivors:
            self.model.load_dense_state(shared["dense"])
            self.model.embeddings.wipe_rows([me])
            if self.parity is not None:
                self.parity.lose_parity([me])
        return shared["reader"], shared["pls"]

    def _load(self, directory: str, back: bool) -> dict:
        header = read_header(directory)
        rows = {k[4:]: read_array(directory, k) for k in header.files if k.startswith("row/")}
        dense = {k[6:]: read_array(directory, k) for k in header.files if k.startswith("dense/")}
        self.model.load_row_state(rows)
        self.model.load_dense_state(dense)
        if self.parity is not None:
            self.parity.restore(read_array(directory, "parity"))
        reader = header.reader_state
        if back:
            reader = self._undo_from(directory, header)
        return {"reader": reader, "pls": header.pls,
                "dense": {k: v.detach().cpu().numpy() for k, v in
                          self.model.dense_state().items()}}

    def _undo_from(self, directory: str, header: DumpHeader) -> dict:
        files = header.files
        if "undo/rows" in files:
            dev = self.model.embeddings.device
            self.undo.words.scatter(torch.as_tensor(read_array(directory, "undo/rows"), device=dev),
                                    torch.as_tensor(read_array(directory, "undo/old_words"),
                                                    device=dev))
        dense = {k[11:]: read_array(directory, k) for k in files if k.startswith("undo/dense/")}
        if dense:
            self.model.load_dense_state(dense)
        if "undo/fold_src" in files and self.parity is not None:
            self.parity.unfold((read_array(directory, "undo/fold_src"),
                                torch.as_tensor(read_array(directory, "undo/fold_block"))))
        return header.undo_reader_state

    def start_anew(self) -> None:
        """A chosen start (`--resume STEP` or `none`): earlier jobs' dumps are no relaunch's,
        so this rank's go; the directory's lineage is learned all the same, for the dumps this
        job may write (a relaunch of it finds them its own). Collective."""
        self.remove()
        self._learn_lineage()

    def _learn_lineage(self) -> None:
        """This job's lineage id, rank 0's reading of the directory's (`dump.lineage`).
        Collective."""
        self.lineage = self.topo.control.bcast(
            lineage(self.root) if self.topo.is_root else None, root=0)

    def remove(self) -> None:
        """Delete this rank's dumps. Local."""
        remove_dumps(self.key, self.topo.rank, self.root)
        self.found = None


def decide(everyone: list, newest_committed: int | None, parity: bool) -> Survey:
    """The relaunch's plan from every rank's (dump summary or None, why not). Local and pure."""
    valid = {r: s for r, (s, _) in enumerate(everyone) if s is not None}
    if not valid:
        problems = sorted({w for _, w in everyone if w and not _absent(w)})
        return Survey(False, f"no usable survivor dump ({'; '.join(problems)})" if problems
                      else "")
    step = min(s["step"] for s in valid.values())
    if newest_committed is not None and newest_committed >= step:
        return Survey(False, f"the newest checkpoint (step {newest_committed}) is as new as the "
                             f"survivor dumps (step {step})")
    survivors, lost, undo = [], {}, []
    for r, (s, why) in enumerate(everyone):
        if s is None:
            lost[r] = why
        elif s["incomplete"]:
            lost[r] = "its rows were still being rebuilt from parity"
        elif s["parity"] != parity:
            return Survey(False, "the dumps were written with a different parity setting")
        elif s["step"] == step or (s["step"] == step + 1 and s["undo"]):
            survivors.append(r)
            if s["step"] == step + 1:
                undo.append(r)
        else:
            lost[r] = f"its dump holds step {s['step']}, not {step} or {step + 1}"
    if not survivors:
        return Survey(False, "no survivor dump can reach a common step")
    return Survey(True, "", step, survivors, lost, undo)


def _absent(why: str) -> bool:
    """Every place looked at simply had no dump (a first launch, nothing to report)."""
    return all(part.endswith("no survivor dump") for part in why.split("; "))


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
