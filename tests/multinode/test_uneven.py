"""Uneven nodes (3 ranks + 1 rank, launched with HVA_TEST_INIT=uneven): levels that cannot be
node-local raise on every rank, naming the placement; those that can still work."""
import horovod.torch as hvd
import pytest

import hvd_averaging as hva
from hvd_averaging.process_sets import members

import conftest
from helpers import param
from test_placement import hosts


def everyone_raised(func, exc_type):
    try:
        func()
        error = None
    except exc_type as caught:
        error = caught
    assert hvd.allgather_object(error is not None, name="test.uneven.raised") == [True] * hvd.size()
    return error


def test_placement_is_three_and_one(world):
    names = hosts()
    assert world == 4
    assert sorted(names.count(h) for h in set(names)) == [1, 3], names


def test_group_sizes_at_start_up_refused_before_horovod_started():
    error = conftest.INIT_ERROR
    assert isinstance(error, ValueError), error
    assert "group size 2 does not fit the placement" in str(error)
    assert "node sizes" in str(error)


def test_pairs_level_raises_naming_the_split_node(world):
    error = everyone_raised(lambda: hva.HierarchicalModelAverager({2: 2, 4: world}), ValueError)
    assert "would take only part of node(s)" in str(error), error
    assert "a group must stay inside one node or be made of whole nodes" in str(error)


def test_post_local_sgd_needs_an_explicit_local_size(world, rank):
    import torch
    model = torch.nn.Linear(2, 1)
    error = everyone_raised(
        lambda: hva.PostLocalSGD(torch.optim.SGD(model.parameters(), lr=0.1),
                                 model.named_parameters(), start_localSGD_iter=0),
        ValueError)
    assert "nodes hold different numbers of ranks [1, 3]" in str(error), error
    assert "give the local group size explicitly" in str(error)


def test_levels_that_fit_still_average(world, rank):
    averager = hva.HierarchicalModelAverager({2: 1, 4: world})
    assert members(averager.period_process_set_dict[2]) == [rank]
    averager.step = 4
    p = param(rank)
    averager.average_parameters([p])
    assert hvd.allgather_object(p[0].item(), name="test.uneven.mean") == \
        [pytest.approx(sum(range(world)) / world)] * world
