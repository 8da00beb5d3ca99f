from collections import Counter

import pytest

from dtrain.data import EvalShardSampler, ShardSampler


@pytest.mark.parametrize("length, world", [(10, 2), (11, 2), (7, 3), (5, 4)])
def test_shards_cover_the_epoch_once_plus_padding(length, world):
    shards = [list(ShardSampler(length, rank=r, world_size=world, seed=3)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1, "every rank runs the same number of samples"
    seen = Counter(i for s in shards for i in s)
    assert set(seen) == set(range(length))
    assert sum(seen.values()) - length == (-length) % world  # only the padding repeats


def test_interleaving_matches_one_big_batch():
    # W ranks x batch B take exactly the first W*B indices of the epoch's permutation.
    samplers = [ShardSampler(100, rank=r, world_size=2, seed=1) for r in range(2)]
    firsts = [list(s)[:8] for s in samplers]
    order = ShardSampler(100, seed=1).global_order(0)
    assert sorted(firsts[0] + firsts[1]) == sorted(order[:16])


def test_new_iteration_is_a_new_epoch_without_set_epoch():
    s = ShardSampler(50, seed=0)
    e0, e1 = list(s), list(s)
    assert e0 != e1 and sorted(e0) == sorted(e1)
    s.set_epoch(0)
    assert list(s) == e0


def test_same_permutation_on_every_rank():
    a = ShardSampler(30, rank=0, world_size=2, seed=9).global_order(4)
    b = ShardSampler(30, rank=1, world_size=2, seed=9).global_order(4)
    assert a == b


def test_skip_resumes_mid_epoch():
    s = ShardSampler(20, rank=1, world_size=2, seed=2)
    full = list(s)
    s.set_epoch(0)
    s.skip(4)
    assert list(s) == full[4:]


def test_state_dict_round_trip():
    s = ShardSampler(20, seed=2)
    list(s)
    t = ShardSampler(20, seed=0)
    t.load_state_dict(s.state_dict())
    assert list(t) == list(s)


def test_drop_last_trims():
    s = [ShardSampler(11, rank=r, world_size=2, drop_last=True, shuffle=False) for r in range(2)]
    assert [list(x) for x in s] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


@pytest.mark.parametrize("length, world", [(11, 2), (10, 3), (2, 4)])
def test_eval_sampler_sees_each_sample_exactly_once(length, world):
    seen = [i for r in range(world) for i in EvalShardSampler(length, rank=r, world_size=world)]
    assert sorted(seen) == list(range(length))
