"""`recovery.chain.Recovery` in process: the first policy that covers a loss recovers it, the
reasons of the ones before it are logged, rows-replaced hooks run only after a rollback, and a loss
no policy covers raises Unrecoverable naming every reason."""
import pytest

from mpickpt.faults.loss import Loss
from mpickpt.model.shard_plan import ShardPlan
from mpickpt.recovery.base import Outcome, RecoveryPolicy, Unrecoverable
from mpickpt.recovery.chain import Recovery


class Policy(RecoveryPolicy):
    """A policy that covers losses of at most `covers` ranks and rolls back `rolls_back`."""

    def __init__(self, name, covers, rolls_back=frozenset(), announces=False):
        self.name, self.covers, self.rolls_back = name, covers, frozenset(rolls_back)
        self.action, self.announces = f"recovering with {name}", announces
        self.recovered = []

    def why_not(self, loss):
        lost = len({s.rank for s in loss.shards})
        return None if lost <= self.covers else f"{self.name} covers {self.covers} ranks"

    def recover(self, loss):
        self.recovered.append(loss)
        return Outcome(self.name, loss.after_step, None, self.rolls_back)


@pytest.fixture
def plan():
    return ShardPlan.build((100, 50, 30), world_size=4)


def test_the_first_policy_that_covers_the_loss_recovers_it(plan):
    lines, hooks = [], []
    parity, full = Policy("parity", 1), Policy("full", 4, rolls_back={0, 1, 2, 3})
    recovery = Recovery([parity, full], lines.append)
    recovery.rows_replaced.append(lambda: hooks.append("resync"))

    one = recovery.recover(Loss.of_ranks((2,), 7, plan))
    assert one.policy == "parity" and parity.recovered and not full.recovered
    assert hooks == [] and lines == [f"{Loss.of_ranks((2,), 7, plan)}; recovering with parity"]

    two = recovery.recover(Loss.of_ranks((1, 2), 9, plan))
    assert two.policy == "full" and len(full.recovered) == 1
    assert hooks == ["resync"]  # rows went back to older values: parity is re-encoded
    assert lines[-1].endswith("parity covers 1 ranks; recovering with full")
    assert [o.policy for o in recovery.history] == ["parity", "full"]


def test_a_policy_that_announces_itself_is_not_announced_again(plan):
    lines = []
    Recovery([Policy("partial", 4, announces=True)], lines.append).recover(
        Loss.of_ranks((0,), 3, plan))
    assert lines == []


def test_a_loss_nothing_covers_names_every_reason(plan):
    recovery = Recovery([Policy("parity", 1), Policy("partial", 2)], lambda _: None)
    with pytest.raises(Unrecoverable, match=r"parity covers 1 ranks, and partial covers 2 ranks"):
        recovery.recover(Loss.of_ranks((0, 1, 3), 5, plan))
    assert recovery.history == []
