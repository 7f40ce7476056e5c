"""Placement, levels and values across emulated nodes (2 nodes x 2 ranks, block or round-robin,
MPI or Gloo). Every assertion compares what the library chose with the host names every rank
reports, and values with those computed from the other ranks' inputs."""
import os
import socket

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from hvd_averaging.placement import rank_to_node
from hvd_averaging.process_sets import members
from helpers import param


__all__ = ["hosts", "same_host_ranks"]


def hosts():
    """Every rank's host name (index = rank), gathered over Horovod."""
    return hvd.allgather_object(socket.gethostname(), name="test.hosts")


def same_host_ranks(rank):
    names = hosts()
    return [r for r, h in enumerate(names) if h == names[rank]]


def test_job_spans_the_expected_nodes(world):
    names = hosts()
    expected_nodes = int(os.environ["HVA_TEST_NODES"])
    assert len(set(names)) == expected_nodes, names
    assert os.environ.get("HVA_TEST_PLACEMENT") in ("block", "round-robin")
    if os.environ["HVA_TEST_PLACEMENT"] == "round-robin":
        assert names[0] != names[1], f"round-robin placement put ranks 0 and 1 together: {names}"
    else:
        assert names[0] == names[1], f"block placement split ranks 0 and 1: {names}"


def test_rank_to_node_partitions_ranks_like_host_names(world):
    names = hosts()
    nodes = rank_to_node()
    assert len(nodes) == world
    for a in range(world):
        for b in range(world):
            assert (nodes[a] == nodes[b]) == (names[a] == names[b]), (nodes, names)
    assert hvd.allgather_object(nodes, name="test.nodes") == [nodes] * world


def test_node_level_of_hierarchy_is_the_node(world, rank):
    local = len(same_host_ranks(rank))
    averager = hva.HierarchicalModelAverager({2: local, 4: world})
    assert members(averager.period_process_set_dict[2]) == same_host_ranks(rank)
    assert members(averager.period_process_set_dict[4]) == list(range(world))
    averager.step = 2  # the node level only
    p = param(rank)
    averager.average_parameters([p])
    names = hosts()
    expected = [sum(r for r in range(world) if names[r] == names[q]) / local for q in range(world)]
    assert hvd.allgather_object(p[0].item(), name="test.node_mean") == expected
    averager.step = 4  # everyone, across the link
    p = param(rank * rank)
    averager.average_parameters([p])
    assert hvd.allgather_object(p[0].item(), name="test.world_mean") == \
        [sum(r * r for r in range(world)) / world] * world


def test_global_average_of_a_large_model_crosses_the_link(world, rank):
    torch.manual_seed(rank)
    params = [param(0, shape=(1000, 250)) for _ in range(4)]
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn_like(p))
    inputs = [hvd.allgather(p.detach().reshape(1, -1), name=f"test.inputs.{i}")
              for i, p in enumerate(params)]
    hva.average_parameters(params)
    for p, everyone in zip(params, inputs):
        torch.testing.assert_close(p.detach().reshape(-1), everyone.mean(0), rtol=1e-6, atol=1e-6)
    digests = hvd.allgather_object([float(p.detach().double().sum()) for p in params],
                                   name="test.digests")
    assert all(d == digests[0] for d in digests), digests


def test_post_local_sgd_gradient_group_is_node_local(world, rank):
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = hva.PostLocalSGD(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                           start_localSGD_iter=1,
                           averager=hva.PeriodicModelAverager(period=1000, warmup_steps=5))
    assert members(opt.local_set) == same_host_ranks(rank)
    assert members(opt.gradient_process_set(0)) == list(range(world))
    names = hosts()
    for iteration in range(2):
        opt.zero_grad()
        model.weight.grad = torch.full_like(model.weight, float(rank + 1))
        before = model.weight.detach().clone()
        opt.step()
        step = (before - model.weight.detach())[0, 0].item()
        group = list(range(world)) if iteration == 0 else \
            [r for r in range(world) if names[r] == names[rank]]
        assert step == pytest.approx(sum(r + 1 for r in group) / len(group))
        steps = hvd.allgather_object(step, name=f"test.pls.{iteration}")
        if iteration == 0:
            assert steps == [steps[0]] * world
        else:
            for r in range(world):
                mates = [q for q in range(world) if names[q] == names[r]]
                assert steps[r] == pytest.approx(sum(q + 1 for q in mates) / len(mates))
