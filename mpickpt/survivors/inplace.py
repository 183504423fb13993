"""InPlace: after a rank's death the survivors keep their processes; a replacement process takes
the dead rank's place in the job's next generation.

The survivors' side (`survivor`), once the trainer undid the step the death interrupted: leave the
broken generation (its groups are aborted), meet the replacement at the rendezvous, then agree.
The replacement's side (`replacement`) runs the same agreement right after it joined. Agreement,
the same on every member: each survivor says which step it completed and whether it can go back
one; the job continues from the earliest (a survivor one step ahead undoes it with its undo
record, as at a relaunch from survivor dumps); the first survivor hands the replacement the dense
part, the reader position, the PLS account, the checkpoint attempt id and the interval. The
replacement's shard (rows and optimizer state) is then recovered by `--recovery` like any lost
shard: parity rebuild while training goes on, the shard's last checkpoint (partial), or a full
rollback of every rank, all in place.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from mpickpt.generation import GenerationError


@dataclass
class Rejoined:
    """What the members of a new generation agreed on (the same on every member)."""

    generation: int
    step: int
    reader: dict
    pls: dict | None
    replaced: list[int]
    """Ranks held by replacement processes: their shards must be recovered."""
    unrebuilt: list[int]
    """Members whose parity rebuild the death interrupted: their shards are not whole either."""
    undone: list[int]
    """Survivors that went back one step to reach `step`."""
    attempt: str | None
    interval: int | None
    finish_done: list[str]
    """The phases of the run's end counted as done (`agreed_end`; `Trainer._finish`)."""
    pids: dict[int, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    checkpoints_closed: bool = False
    """A survivor's checkpoint manager was closed (the run's end, or a stop's close): every
    member stops its writers, so that all make the same (no) checkpoint collectives."""
    dumps_from: int | None = None
    """The step of the survivor dumps a relaunch resumed from, where a survivor still keeps
    them (until a newer checkpoint commits): every member then watches for that commit."""
    history: dict | None = None
    """The run's record so far (`InPlace.history`), from the first survivor, where rank 0 is
    replaced: rank 0 writes the run's report and its summaries, and its replacement goes on
    from the survivor's record instead of starting one at the join."""
    faults: dict | None = None
    """The emulated losses fired so far, the first survivor's (`FaultTolerance.state`): every
    member goes on from them, so that all fire the same losses at the same steps."""


def agreed_end(ends: list[list[str]]) -> list[str]:
    """The phases of the run's end (`Trainer._finish`, in order) that the new generation counts
    as done, from each survivor's list; "settle" is left out (every member settles again).
    The close's collective work ends at a barrier, which no member leaves before every
    member has entered it: where one survivor completed the close and another did not (the dead
    rank took part in that barrier for some members and not for others), the other was at the
    barrier or past it, its part of the close's collective work done, and it finishes the
    close alone (`Trainer._finish`); the close counts as done. Any other mix raises
    GenerationError: nothing resumes from a mixed state. Local and pure."""
    ends = [[p for p in end if p != "settle"] for end in ends]
    longest = max(ends, key=len, default=[])
    if any(end != longest[:len(end)] or len(longest) - len(end) > 1
           or (len(end) < len(longest) and longest[len(end)] != "close") for end in ends):
        raise GenerationError(f"the survivors completed different parts of the run's end: "
                              f"{sorted(set(map(tuple, ends)))}")
    return longest


class InPlace:
    """One rank's part in forming a new generation. Construction is local."""

    def __init__(self, topo, model, undo, parity, join_timeout_s: float, history=None,
                 faults=None):
        """`history()`: this rank's record of the run so far (a picklable dict), handed to a
        replacement of rank 0 (`Rejoined.history`); `faults()`: which emulated losses fired
        so far (`FaultTolerance.state`), handed to every member (`Rejoined.faults`)."""
        self.topo, self.model, self.undo, self.parity = topo, model, undo, parity
        self.join_timeout_s = join_timeout_s
        self.history, self.faults = history, faults

    def survivor(self, dead, step: int, reader: dict, pls: dict | None, attempt: str | None,
                 interval: int | None, more_dead=None, finish_done=(),
                 went_back=None, closed: bool = False,
                 dumps_from: int | None = None) -> Rejoined:
        """Leave the broken generation and form the next one with the replacements of `dead`.
        `step`, `reader`: this rank's last completed step and the reader position there;
        `finish_done`: the phases of the run's end it completed (a death during the end);
        `closed`: its checkpoint manager is closed; `dumps_from`: the step of the survivor
        dumps it still keeps (None: none);
        `went_back(step, reader)`: called under the state lock when this rank undoes its last
        step because the others did not complete it.
        Collective with the next generation's members; raises GenerationError when a member
        never comes or a further death overtakes the formation."""
        start = time.perf_counter()
        generation = self.topo.advance(dead, self.join_timeout_s, more_dead)
        regroup = getattr(self.model, "regroup", None)
        if regroup is not None:  # a model that holds the old generation's groups itself
            regroup()
        joined = time.perf_counter()
        out = self._agree(step, reader, pls, attempt, interval, list(finish_done), went_back,
                          closed, dumps_from)
        out.seconds.update(join=joined - start, agree=time.perf_counter() - joined)
        out.generation = generation
        return out

    def replacement(self) -> Rejoined:
        """The replacement's side, right after `Topology.from_store` joined it. Collective."""
        start = time.perf_counter()
        out = self._agree(None, None, None, None, None, None)
        out.seconds.update(agree=time.perf_counter() - start)
        out.generation = self.topo.generation
        return out

    @torch.no_grad()
    def _agree(self, step, reader, pls, attempt, interval, finish_done,
               went_back=None, closed: bool = False, dumps_from: int | None = None) -> Rejoined:
        me, control = self.topo.rank, self.topo.control
        last = self.undo.last if self.undo is not None else None
        mine = {"step": step, "pid": os.getpid(), "finish_done": finish_done, "closed": closed,
                "dumps_from": dumps_from,
                "back": step is not None and last is not None and last.step == step,
                "rebuilding": self.parity.rebuilding() if self.parity is not None else []}
        everyone = control.allgather(mine)
        survivors = [r for r, e in enumerate(everyone) if e["step"] is not None]
        if not survivors:
            raise GenerationError("no member of the new generation holds the training state")
        finish_done = agreed_end([everyone[r]["finish_done"] for r in survivors])
        agreed = min(everyone[r]["step"] for r in survivors)
        undone = [r for r in survivors if everyone[r]["step"] != agreed]
        for r in undone:
            if everyone[r]["step"] != agreed + 1 or not everyone[r]["back"]:
                raise GenerationError(f"rank {r} completed step {everyone[r]['step']} and "
                                      f"cannot go back to step {agreed}")
        if me in undone:
            with self.model.state_lock:
                reader = self.undo.undo_last()
                if went_back is not None:
                    went_back(agreed, reader)
        first = survivors[0]
        handed = everyone[0]["step"] is None and self.history is not None  # rank 0 replaced
        shared = control.bcast({"dense": {k: v.detach().cpu() for k, v in
                                          self.model.dense_state().items()},
                                "reader": reader, "pls": pls, "attempt": attempt,
                                "interval": interval,
                                "history": self.history() if handed else None,
                                "faults": self.faults() if self.faults else None}
                               if me == first else None, root=first)
        replaced = [r for r, e in enumerate(everyone) if e["step"] is None]
        rebuilding = sorted({r for e in everyone for r in e["rebuilding"]})
        if self.parity is not None and rebuilding:
            self.parity.interrupt_rebuild(rebuilding)
        unrebuilt = [r for r in rebuilding if r not in replaced]
        if me in replaced:
            self.model.load_dense_state(shared["dense"])
            self.model.embeddings.wipe_rows([me])
            if self.parity is not None:
                self.parity.lose_parity([me])
        return Rejoined(self.topo.generation, agreed, shared["reader"], shared["pls"], replaced,
                        unrebuilt, undone, shared["attempt"], shared["interval"],
                        finish_done,
                        {r: e["pid"] for r, e in enumerate(everyone)},
                        checkpoints_closed=any(e["closed"] for e in everyone),
                        dumps_from=max((e["dumps_from"] for e in everyone
                                        if e["dumps_from"] is not None), default=None),
                        history=shared["history"], faults=shared["faults"])
