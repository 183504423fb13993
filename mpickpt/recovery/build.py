"""Wiring: the recovery policies `--recovery` asks for, in the order they are tried, and the
planner of the checkpoint interval."""
from __future__ import annotations

from mpickpt.model.contract import PARTIAL, require
from mpickpt.recovery.auto import AutoRecovery
from mpickpt.recovery.chain import Recovery
from mpickpt.recovery.full_rollback import FullRollback
from mpickpt.recovery.parity_rebuild import ParityRebuild
from mpickpt.recovery.partial import PartialRecovery


def build_recovery(mode: str, topo, model, parity, ckpt, restorer, pls, planner,
                   global_batch: int, say, start_state: dict | None = None) -> Recovery:
    """The policies of `mode`: full (roll back), partial (CPR), parity (rebuild, else roll
    back), auto (rebuild where parity covers, else CPR's choice). After a recovery replaced rows,
    parity is re-encoded. Local."""
    if mode in ("partial", "auto"):
        require(model, PARTIAL)
    full = FullRollback(ckpt, restorer, topo.world_size, model, start_state, pls)
    partial = PartialRecovery(ckpt, restorer, model, pls, global_batch, say)
    rebuild = [ParityRebuild(parity)] if parity is not None else []
    policies = {"full": [full], "partial": [partial], "parity": [*rebuild, full],
                "auto": [*rebuild, AutoRecovery(planner, partial, full, say)]}[mode]
    recovery = Recovery(policies, say)
    if parity is not None:
        recovery.rows_replaced.append(parity.resync)
    return recovery
