"""The portion of lost samples (CPR §4.1, eq. 3), the job's running measure of what partial
recoveries cost the model.

At a partial recovery after step i, each lost shard s goes back to its last save, at step c_s:

    PLS_i = PLS_{i-1} + sum over lost shards s of  (S_i - S_{c_s}) / S_total x share_s

with S_k = k x global batch the samples trained up to step k, S_total the samples of the whole
job, and share_s the shard's share of the embedding rows (CPR's 1 / N_emb for one of N_emb equal
embedding servers). With prioritized saves the last save of a shard is the newest (partial) one, as
in CPR's evaluation of MFU and SSU: the rows that save skipped were judged not to matter. The running value travels in every manifest (`stats["pls"]`), so a resumed
job continues from the PLS of the checkpoint it resumed from: a full rollback undoes the partial
recoveries after that checkpoint along with everything else. Local.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PLSAccount:
    """The running PLS of one job (the same on every rank)."""

    total_samples: int
    value: float = 0.0
    events: list[dict] = field(default_factory=list)

    def partial_recovery(self, step: int, global_batch: int,
                         lost: list[tuple[float, int]]) -> float:
        """Add one partial recovery after `step`; `lost` = (share of the embedding rows, step of
        its last save) per lost shard. Returns the increase. Local."""
        gained = sum(share * (step - saved) * global_batch for share, saved in lost) \
            / max(self.total_samples, 1)
        self.value += gained
        self.events.append({"step": step, "increase": gained, "pls": self.value,
                            "shards": [[share, saved] for share, saved in lost]})
        return gained

    def to_stats(self) -> dict:
        """What a manifest records. Local."""
        return {"value": self.value, "partial_recoveries": len(self.events)}

    @classmethod
    def resumed(cls, total_samples: int, stats: dict | None) -> "PLSAccount":
        """The account of a job resumed from a checkpoint whose manifest recorded `stats`."""
        stats = stats or {}
        account = cls(total_samples, float(stats.get("value", 0.0)))
        account.events = [{"resumed": True}] * int(stats.get("partial_recoveries", 0))
        return account

    @property
    def recoveries(self) -> int:
        return len(self.events)
