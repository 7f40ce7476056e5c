"""hva.init(group_sizes=[...]) across hosts (launched with HVA_TEST_INIT=group_sizes)."""
import os

import horovod.torch as hvd

import hvd_averaging as hva
from hvd_averaging.routes import averaging_route, routes
from hvd_averaging.process_sets import dynamic_process_sets_enabled, members, registered_process_sets

import conftest
from test_placement import hosts, same_host_ranks


def test_start_up_registration_across_hosts(world, rank):
    """hva.init(group_sizes=[...]): static over MPI; under Gloo across hosts a warning and
    dynamic sets (the launcher gives no rank the whole placement before Horovod starts)."""
    assert os.environ.get("HVA_TEST_INIT") == "group_sizes", "run by the group_sizes launches"
    if hvd.mpi_enabled():
        assert not dynamic_process_sets_enabled()
        assert conftest.INIT_WARNINGS == []
        registered = sorted(registered_process_sets().values())
        names = hosts()
        node_groups = sorted({tuple(r for r in range(world) if names[r] == h) for h in names})
        # the i-th rank of every node: the rails the global set averages node-aware along
        rails = sorted(tuple(group[i] for group in node_groups) for i in range(len(node_groups[0])))
        assert [tuple(g) for g in registered if len(g) < world] == sorted(node_groups + rails)
    else:
        assert dynamic_process_sets_enabled()
        assert any("over several hosts the placement is known only after Horovod starts" in w
                   for w in conftest.INIT_WARNINGS), conftest.INIT_WARNINGS
    local = len(same_host_ranks(rank))
    averager = hva.HierarchicalModelAverager({2: local, 4: world})
    assert members(averager.period_process_set_dict[2]) == same_host_ranks(rank)
    # the top level can cross the nodes node-aware, with or without dynamic process sets (which
    # way it takes is measured at its first round of each size)
    assert averaging_route(hvd.global_process_set) in ("node-aware", "to be measured")
    assert routes().node_aware_sets(hvd.global_process_set) is not None
