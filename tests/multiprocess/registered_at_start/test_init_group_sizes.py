"""hva.init(group_sizes=[2]) on 4 ranks: the pairs are registered at start-up and Horovod runs
without dynamic process sets (conftest.py starts it so when HVA_TEST_INIT=group_sizes)."""
import warnings

import horovod.torch as hvd
import pytest

import hvd_averaging as hva
from hvd_averaging.process_sets import dynamic_process_sets_enabled, registered_process_sets
from helpers import expect_error_on_every_rank, gathered, param

import conftest


def test_bad_group_size_raised_on_every_rank_before_horovod_started():
    # conftest called hva.init(group_sizes=[3]) first: 3 does not divide 4 ranks.
    outcomes = hvd.allgather_object(conftest.EARLY_INIT_ERROR)
    assert all(o is not None and o.startswith("ValueError: group size 3 does not divide the number of ranks 4")
               for o in outcomes), outcomes


def test_pairs_registered_at_start_and_no_dynamic_sets():
    assert not dynamic_process_sets_enabled()
    sets = {set_id: ranks for set_id, ranks in registered_process_sets().items() if set_id != 0}
    assert sorted(sets.values()) == [[0, 1], [2, 3]]
    assert hvd.allgather_object(sorted(sets.items())) == [sorted(sets.items())] * hvd.size()


def test_hierarchical_averager_uses_the_registered_pairs(rank):
    averager = hva.HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=0)
    averager.step = 2  # pairs only
    p = param(rank)
    averager.average_parameters([p])
    assert gathered(p[0]) == [0.5, 0.5, 2.5, 2.5]
    averager.step = 4  # all ranks
    q = param(rank)
    averager.average_parameters([q])
    assert gathered(q[0]) == [1.5] * 4


def test_post_local_sgd_local_pairs(rank):
    pair = hva.local_process_set(group_size=2)
    assert pair.ranks == ([0, 1] if rank < 2 else [2, 3])
    p = param(10 * rank)
    hva.average_parameters([p], pair)
    assert gathered(p[0]) == [5.0, 5.0, 25.0, 25.0]


def test_unregistered_group_raises_on_every_rank_and_names_the_fix():
    error = expect_error_on_every_rank(lambda: hva.process_set([0, 2]), RuntimeError)
    assert "[0, 2] is not registered" in str(error) and "group_sizes=" in str(error)
    # Horovod still works afterwards: nothing hung, nothing half-registered.
    p = param(hvd.rank())
    hva.average_parameters([p])
    assert gathered(p[0]) == [1.5] * 4


def test_group_sizes_after_start_warns():
    with pytest.warns(UserWarning, match="only at start-up"):
        hva.init(group_sizes=[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hva.init()  # plain no-op: nothing to warn about
