"""Elastic Gloo across emulated nodes: one worker replaced by another, the world size unchanged.
Launched by tools/cluster_tests.py on 5 nodes, one rank each:

    HVA_ELASTIC_HOSTS_FILE=hosts HVA_ELASTIC_NODES=n0,n1,n2,n3,n4 horovodrun --gloo -np 4 \\
        --min-np 4 --max-np 4 --network-interface eth0 \\
        --host-discovery-script tests/faults/discover_hosts.sh python tests/faults/elastic_replace.py

The hosts file starts as ``n0:1 .. n3:1``. At batch 10 rank 0 swaps n3 for n4: Horovod
stops n3's worker, starts one on n4 (which constructs its averagers without collectives) and
resets the others, still 4 ranks. A ``PeriodicModelAverager`` over all ranks and a
``HierarchicalModelAverager({2: 2, 4: 4})`` (pairs of nodes) must both make their sets for the new world, on the
survivors as on the newcomer (they follow the world by its generation, not its size: a
survivor that skipped the argument agreement the newcomer runs would leave both waiting in
different collectives). A DiLoCo (outer step every 4 batches) goes with them: the newcomer
builds its global copy from its own initial weights and its outer momentum warm-up from the start,
and must get rank 0's of both at the sync (DiLoCo averages the progress since that copy). Every rank checks at the end, against the others, that training
completed with equal parameters after the last all-rank averaging.
"""
import os
import socket
import time
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
import hvd_averaging.elastic  # noqa: F401  (registers the averagers with TorchState)
from elastic_step import train_step, train_step_diloco
from hvd_averaging.outer_schedules import warmed_up_momentum
from hvd_averaging.process_sets import members

BATCHES, REPLACE_AT = 41, 10  # step 40 averages over all ranks at both averagers
WARMUP_OUTER_STEPS = 20  # longer than the run's 11 outer steps: the newcomer must resume it
NODES = os.environ["HVA_ELASTIC_NODES"].split(",")
HOSTS_FILE = Path(os.environ["HVA_ELASTIC_HOSTS_FILE"])

hva.init()
hva.set_timeout(30)
torch.manual_seed(hvd.rank())
flat_model, tree_model = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
outer_model = torch.nn.Linear(8, 2)
flat_opt = torch.optim.SGD(flat_model.parameters(), lr=0.05)
tree_opt = torch.optim.SGD(tree_model.parameters(), lr=0.05)
state = hvd.elastic.TorchState(
    flat_model=flat_model, tree_model=tree_model, flat_opt=flat_opt, tree_opt=tree_opt,
    periodic=hva.PeriodicModelAverager(period=4),
    hierarchical=hva.HierarchicalModelAverager({2: 2, 4: hvd.size()}),
    outer_model=outer_model, diloco=hva.DiLoCo(
        torch.optim.SGD(outer_model.parameters(), lr=0.05), hva.PeriodicModelAverager(period=4),
        outer_scheduler=lambda outer: hva.OuterMomentumWarmup(outer, WARMUP_OUTER_STEPS)),
    batch=0, hosts_seen=[])


@hvd.elastic.run
def train(state):
    while state.batch < BATCHES:
        train_step(flat_model, flat_opt, state.periodic, state.batch)
        train_step(tree_model, tree_opt, state.hierarchical, state.batch)
        train_step_diloco(outer_model, state.diloco, state.batch)
        hosts = sorted(set(hvd.allgather_object(socket.gethostname(), name="replace.hosts")))
        if hosts not in state.hosts_seen:
            state.hosts_seen.append(hosts)
        state.batch += 1
        state.commit()
        if state.batch == REPLACE_AT and NODES[3] in hosts:
            if hvd.rank() == 0:
                HOSTS_FILE.write_text("".join(f"{node}:1\n" for node in NODES[:3] + NODES[4:]))
            # commit() raises HostsUpdatedInterrupt on every rank at the same call once the
            # driver has seen the change (rank 0 broadcasts the news)
            for _ in range(240):
                time.sleep(0.25)
                state.commit()
            raise RuntimeError("the hosts change was not seen in 60 s")


train(state)
size = hvd.size()
pair = members(state.hierarchical.period_process_set_dict[2])
flat = hvd.allgather(flat_model.weight.detach().reshape(1, -1), name="replace.flat")
tree = hvd.allgather(tree_model.weight.detach().reshape(1, -1), name="replace.tree")
outer = hvd.allgather(outer_model.weight.detach().reshape(1, -1), name="replace.outer")
globals_ = hvd.allgather(state.diloco.global_parameters[0].detach().reshape(1, -1),
                         name="replace.global")
steps = hvd.allgather_object([state.periodic.step, state.hierarchical.step,
                              state.diloco.averager.step], name="replace.steps")
warmups = hvd.allgather_object((state.diloco.outer_scheduler.outer_steps_taken,
                                state.diloco.outer_optimizer.param_groups[0]["momentum"]),
                               name="replace.warmup")
print(f"rank {hvd.rank()}: size {size}, hosts seen {state.hosts_seen}, steps {steps}, "
      f"pair {pair}", flush=True)
assert size == 4, size
assert state.hosts_seen == [sorted(NODES[:4]), sorted(NODES[:3] + NODES[4:])], state.hosts_seen
assert steps == [[BATCHES, BATCHES, BATCHES]] * size, steps
outer_steps = (BATCHES - 1) // 4 + 1  # DiLoCo's firing steps 0, 4, ..., 40
assert warmups == [(outer_steps, warmed_up_momentum(0.9, 0.0, WARMUP_OUTER_STEPS, outer_steps))] * size, \
    warmups
rank = hvd.rank()
assert pair == [rank - rank % 2, rank - rank % 2 + 1], pair  # one rank per node: rank order
for label, weights in (("periodic", flat), ("hierarchical", tree), ("DiLoCo", outer),
                       ("DiLoCo's global copy", globals_)):
    assert torch.equal(weights.min(0).values, weights.max(0).values), f"{label}: parameters differ"
if hvd.rank() == 0:
    print(f"elastic replace ok: {NODES[3]}'s worker replaced by one on {NODES[4]}, 4 ranks before "
          f"and after, step {steps[0][0]} on every rank, parameters equal after the final "
          "averaging at both averagers and after DiLoCo's outer step, its global copy and momentum "
          "warm-up equal", flush=True)
