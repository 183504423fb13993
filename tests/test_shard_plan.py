"""The shard plan is pure and round-trips every (table, row) for many layouts and world sizes."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpickpt.model.shard_plan import ShardPlan, ShardPlanOptions

sizes_strategy = st.lists(st.integers(1, 300), min_size=1, max_size=12)


def round_trip(plan):
    gid = np.arange(plan.total_rows)
    owner, lrow = plan.owner_of(gid)
    for r in range(plan.world_size):
        mine = owner == r
        assert np.array_equal(np.sort(lrow[mine]), np.arange(plan.local_rows(r)))
        assert np.array_equal(plan.local_to_global(r, lrow[mine]), gid[mine])
    table, row = plan.split_global(gid)
    assert np.array_equal(plan.global_ids(table, row), gid)
    assert np.all(row < np.asarray(plan.table_sizes)[table])


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_strategy, world=st.integers(1, 8), threshold=st.one_of(st.none(), st.integers(8, 400)))
def test_round_trip_every_row(sizes, world, threshold):
    if threshold is not None and any(n > threshold and n < world for n in sizes):
        with pytest.raises(ValueError, match="cannot be split"):
            ShardPlan.build(sizes, world, ShardPlanOptions(row_wise_threshold=threshold))
        return
    try:
        plan = ShardPlan.build(sizes, world, ShardPlanOptions(row_wise_threshold=threshold))
    except ValueError as e:  # automatic threshold with a table smaller than the world
        assert "cannot be split" in str(e)
        return
    round_trip(plan)
    assert sum(s.rows for s in plan.shards) == sum(sizes)


def test_plan_is_pure_and_torch_lookup_matches_numpy():
    a = ShardPlan.build([1000, 5, 77, 300], 3)
    b = ShardPlan.build([1000, 5, 77, 300], 3)
    assert a.shards == b.shards and a.describe() == b.describe()
    gid = np.arange(a.total_rows)
    o_np, l_np = a.owner_of(gid)
    o_t, l_t = a.owner_of(torch.from_numpy(gid))
    assert np.array_equal(o_t.numpy(), o_np) and np.array_equal(l_t.numpy(), l_np)


def test_large_table_is_split_row_wise_and_small_ones_placed_whole():
    plan = ShardPlan.build([10_000, 10, 20, 30], 4)
    big = [s for s in plan.shards if s.table == 0]
    assert sorted(s.rank for s in big) == [0, 1, 2, 3]
    assert [s.rows for s in big] == [2500, 2500, 2500, 2500]
    for t in (1, 2, 3):
        assert len([s for s in plan.shards if s.table == t]) == 1


def test_table_wise_balances_load():
    plan = ShardPlan.build([100, 90, 80, 70, 60, 50], 3, ShardPlanOptions(row_wise_threshold=10**6))
    loads = sorted(plan.local_rows(r) for r in range(3))
    assert loads == [150, 150, 150]


@pytest.mark.parametrize("sizes, world, options, message", [
    ([10, 0], 2, None, r"table sizes must be >= 1 row, got \[\(1, 0\)\]"),
    ([], 2, None, "at least one embedding table"),
    ([10], 0, None, "world size must be a positive integer, got 0"),
    ([3, 3], 4, ShardPlanOptions(row_wise_threshold=2), "table 0 has 3 rows.*world size 4"),
    ([100, 100], 2, ShardPlanOptions(max_rows_per_rank=60), "would hold 100 embedding rows"),
])
def test_bad_layouts_name_the_value(sizes, world, options, message):
    with pytest.raises(ValueError, match=message):
        ShardPlan.build(sizes, world, options)


def test_bad_options():
    with pytest.raises(ValueError, match="row_wise_threshold must be a positive integer"):
        ShardPlanOptions(row_wise_threshold=0)


def test_a_plan_from_another_frameworks_shards_keeps_their_local_order():
    """from_shards: rank 0 holds table 2 before table 0 (a fused module's order) and half of
    table 1 row-wise; ids, owners and local order follow the given shards."""
    from mpickpt.model.shard_plan import Shard

    sizes = (5, 4, 3)
    shards = [Shard(2, 0, 3, 0, 0), Shard(0, 0, 5, 0, 3), Shard(1, 0, 2, 0, 8),
              Shard(1, 2, 4, 1, 0)]
    plan = ShardPlan.from_shards(sizes, 2, shards)
    assert [(s.table, s.local_start) for s in plan.shards_of(0)] == [(2, 0), (0, 3), (1, 8)]
    assert plan.local_rows(0) == 10 and plan.local_rows(1) == 2
    assert plan.rank_global_ids(0).tolist() == [9, 10, 11, 0, 1, 2, 3, 4, 5, 6]
    owner, local = plan.owner_of(np.arange(12))
    assert owner.tolist() == [0] * 7 + [1, 1] + [0] * 3
    assert local.tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 1, 0, 1, 2]
    built = ShardPlan.build(sizes, 2)
    assert ShardPlan.from_shards(sizes, 2, built.shards).describe() == built.describe()


@pytest.mark.parametrize("shards,message", [
    ([(0, 0, 5, 0, 0), (1, 0, 3, 1, 0)], r"table 1 \(4 rows\): its shards \[\(0, 3\)\] do not "
                                         r"cover rows \[0, 4\) exactly once"),
    ([(0, 0, 5, 0, 0), (1, 0, 4, 1, 0), (1, 2, 4, 0, 5)], r"table 1 .* exactly once"),
    ([(0, 0, 5, 0, 0), (1, 0, 4, 0, 6)], r"rank 0: shard .* starts at local row 6, expected 5"),
    ([(0, 0, 5, 2, 0), (1, 0, 4, 0, 0)], r"does not fit tables of \[5, 4\] rows over 2 ranks"),
])
def test_shards_that_do_not_tile_the_tables_are_refused(shards, message):
    from mpickpt.model.shard_plan import Shard

    with pytest.raises(ValueError, match=message):
        ShardPlan.from_shards((5, 4), 2, [Shard(*s) for s in shards])
