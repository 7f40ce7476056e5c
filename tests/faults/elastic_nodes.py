"""Elastic Gloo across emulated nodes: a node leaves, then a node joins. Launched by
tools/cluster_tests.py on 3 nodes:

    HVA_ELASTIC_HOSTS_FILE=hosts HVA_ELASTIC_NODES=n0,n1,n2 horovodrun --gloo -np 4 --min-np 2 \\
        --max-np 4 --network-interface eth0 --host-discovery-script tests/faults/discover_hosts.sh \\
        python tests/faults/elastic_nodes.py

The hosts file starts as ``n0:2, n1:2``. At batch 10 rank 0 drops n1 (Horovod stops its workers
and resets the others: 2 ranks on n0); at batch 30 it adds n2 (two new workers start the script
from the top, construct their averager without collectives, and take the state from rank 0).
The hierarchy ``{2: 2, 4: world}`` must be rebuilt after each change with the level of 2 as the
node: every rank checks that against the host names of the others.
"""
import os
import socket
import time
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
import hvd_averaging.elastic  # noqa: F401  (registers the averager with TorchState)
from elastic_step import train_step
from hvd_averaging.process_sets import members

BATCHES, LEAVE_AT, JOIN_AT = 61, 10, 30  # the last step (60) averages over all ranks
NODES = os.environ["HVA_ELASTIC_NODES"].split(",")
HOSTS_FILE = Path(os.environ["HVA_ELASTIC_HOSTS_FILE"])

hva.init()
hva.set_timeout(30)
torch.manual_seed(hvd.rank())
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
averager = hva.HierarchicalModelAverager({2: 2, 4: hvd.size()})
state = hvd.elastic.TorchState(model, optimizer, averager=averager, batch=0, node_levels=[])


@hvd.elastic.run
def train(state):
    while state.batch < BATCHES:
        train_step(model, optimizer, state.averager, state.batch)
        if state.batch % 4 == 2:  # the node level just averaged: is it the node?
            names = hvd.allgather_object(socket.gethostname(), name="elastic.hosts")
            pair = members(state.averager.period_process_set_dict[2])
            node = [r for r, h in enumerate(names) if h == names[hvd.rank()]]
            verdicts = hvd.allgather_object(pair == node, name="elastic.verdicts")
            if not state.node_levels or state.node_levels[-1][0] != hvd.size():
                state.node_levels.append([hvd.size(), True])  # a new phase of the world
            state.node_levels[-1][1] &= all(verdicts)
        state.batch += 1
        state.commit()
        change = {(LEAVE_AT, 4): f"{NODES[0]}:2\n", (JOIN_AT, 2): f"{NODES[0]}:2\n{NODES[2]}:2\n"}
        if (state.batch, hvd.size()) in change:
            if hvd.rank() == 0:
                HOSTS_FILE.write_text(change[state.batch, hvd.size()])
            # Wait for the driver to see it: commit() raises HostsUpdatedInterrupt on every rank
            # at the same call (rank 0 broadcasts the news), so every rank loops alike.
            for _ in range(240):
                time.sleep(0.25)
                state.commit()
            raise RuntimeError(f"the hosts change at batch {state.batch} was not seen in 60 s")


train(state)
size = hvd.size()
weights = hvd.allgather(model.weight.detach().reshape(1, -1), name="elastic.final")
steps = hvd.allgather_object(state.averager.step, name="elastic.steps")
hosts = sorted(set(hvd.allgather_object(socket.gethostname(), name="elastic.final_hosts")))
print(f"rank {hvd.rank()}: size {size}, hosts {hosts}, steps {steps}, "
      f"levels {state.averager.period_group_size_dict}, node level ok per phase {state.node_levels}",
      flush=True)
assert size == 4 and hosts == [NODES[0], NODES[2]], (size, hosts)
assert steps == [BATCHES] * size, steps
assert state.averager.period_group_size_dict == {2: 2, 4: 4}
assert state.node_levels == [[4, True], [2, True], [4, True]], state.node_levels
assert torch.equal(weights.min(0).values, weights.max(0).values), "parameters differ at the end"
if hvd.rank() == 0:
    print(f"elastic nodes ok: node {NODES[1]} left, node {NODES[2]} joined, 4 ranks on "
          f"{hosts}, step {steps[0]} on every rank, the level of 2 was the node in every phase "
          f"(world sizes {[size for size, _ in state.node_levels]})", flush=True)
