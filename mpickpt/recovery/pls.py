"""The portion of lost samples (CPR §4.1, eq. 3), the job's running measure of what partial
recoveries cost the model.

At a partial recovery after step i, each lost shard s goes back to its last save, at step c_s:

    PLS_i = PLS_{i-1} + sum over lost shards s of  (S_i - S_{c_s}) / S_total x share_s

with S_k = k x global batch the samples trained up to step k, S_total the samples of the whole
job, and share_s the shard's share of the embedding rows (CPR's 1 / N_emb for one of N_emb equal
embedding servers). With prioritized saves the last save of a shard is the newest (partial) one, as
in CPR's evaluation of MFU and SSU: the rows that save skipped were judged not to matter.

The running value travels in every manifest (`stats["pls"]`). A full rollback, whether a resumed
job or one inside a running job (`--recovery full`, `parity` or `auto`), returns the PLS to the
value of the checkpoint it restores: it replays every sample since, so the partial recoveries after
that checkpoint are undone with everything else; with nothing committed it starts over from 0.
Local.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PLSAccount:
    """The running PLS of one job (the same on every rank)."""

    total_samples: int
    value: float = 0.0
    recoveries: int = 0
    """Partial recoveries counted in `value` (those a rollback undid are not)."""
    events: list[dict] = field(default_factory=list)
    """What happened to the PLS in this process: partial recoveries and rollbacks."""

    def partial_recovery(self, step: int, global_batch: int,
                         lost: list[tuple[float, int]]) -> float:
        """Add one partial recovery after `step`; `lost` = (share of the embedding rows, step of
        its last save) per lost shard. Returns the increase. Local."""
        gained = sum(share * (step - saved) * global_batch for share, saved in lost) \
            / max(self.total_samples, 1)
        self.value += gained
        self.recoveries += 1
        self.events.append({"step": step, "increase": gained, "pls": self.value,
                            "shards": [[share, saved] for share, saved in lost]})
        return gained

    def rolled_back(self, step: int, stats: dict | None) -> float:
        """A full rollback to the checkpoint of `step` whose manifest recorded `stats` (None:
        nothing committed, back to the start): the PLS is that checkpoint's again. Returns the
        change (<= 0). Local."""
        before = self.value
        self.value, self.recoveries = _recorded(stats)
        self.events.append({"step": step, "rolled_back": True, "change": self.value - before,
                            "pls": self.value})
        return self.value - before

    def to_stats(self) -> dict:
        """What a manifest records. Local."""
        return {"value": self.value, "partial_recoveries": self.recoveries}

    @classmethod
    def resumed(cls, total_samples: int, stats: dict | None) -> "PLSAccount":
        """The account of a job resumed from a checkpoint whose manifest recorded `stats`."""
        value, recoveries = _recorded(stats)
        return cls(total_samples, value, recoveries)


def _recorded(stats: dict | None) -> tuple[float, int]:
    """(PLS, partial recoveries) as a manifest's `stats["pls"]` records them. Local."""
    stats = stats or {}
    return float(stats.get("value", 0.0)), int(stats.get("partial_recoveries", 0))
