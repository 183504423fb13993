"""Wiring: the recovery policies a trainer's configuration asks for, in the order they are tried."""
from __future__ import annotations

from mpickpt.recovery.chain import Recovery
from mpickpt.recovery.full_rollback import FullRollback
from mpickpt.recovery.parity_rebuild import ParityRebuild


def build_recovery(topo, parity, ckpt, restorer, say) -> Recovery:
    """Parity rebuild first (when parity is on), then full rollback to the latest checkpoint (or
    the reason there is none). After a rollback, parity is re-encoded. Local."""
    policies = [ParityRebuild(parity)] if parity is not None else []
    policies.append(FullRollback(ckpt, restorer, topo.world_size))
    recovery = Recovery(policies, say)
    if parity is not None:
        recovery.rows_replaced.append(parity.resync)
    return recovery
