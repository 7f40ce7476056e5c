"""Elastic Gloo run that loses a worker, launched by tools/run_tests.py:

    echo localhost:4 > hosts; HVA_ELASTIC_HOSTS_FILE=hosts horovodrun --gloo -np 4 --min-np 2 \
        --max-np 4 --host-discovery-script tests/faults/discover_hosts.sh \
        python tests/faults/elastic_shrink.py

At batch 10 rank 0 rewrites the hosts file to 3 slots; Horovod removes a worker, resets (dropping
every process set) and resumes from the last commit. The averager's step is committed state and
its hierarchy ({2: 1, 4: world}: a level that fits any size, everyone every 4 steps) is
rebuilt for 3 ranks as {2: 1, 4: 3}. A DiLoCo (outer step every 4 batches) rolls back with it:
its global copy, made from each rank's own initial weights, is rank 0's from the first sync on,
and its state is restored locally after the failure. At the end every rank checks, against the others, that the step matches the batch
count and that the parameters are equal after the final all-rank averaging.
"""
import os
import warnings
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
import hvd_averaging.elastic  # noqa: F401  (registers the averager with TorchState)
from elastic_step import train_step, train_step_diloco
from hvd_averaging.process_sets import dynamic_process_sets_enabled

BATCHES, SHRINK_AT = 41, 10  # the last step (40) averages over all ranks

# Elastic resets drop sets registered at start-up, so group_sizes must fall back to dynamic sets.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hva.init(group_sizes=[2])
assert dynamic_process_sets_enabled(), "an elastic job must run with dynamic process sets"
assert any("elastic job's reset drops every process set" in str(w.message) for w in caught), \
    [str(w.message) for w in caught]
hva.set_timeout(30)
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
averager = hva.HierarchicalModelAverager({2: 1, 4: hvd.size()})  # fits 4 and 3 ranks
outer_model = torch.nn.Linear(8, 2)  # each rank's own initial weights, until the first sync
diloco = hva.DiLoCo(torch.optim.SGD(outer_model.parameters(), lr=0.05),
                    hva.PeriodicModelAverager(period=4))
state = hvd.elastic.TorchState(model, optimizer, averager=averager, outer_model=outer_model,
                               diloco=diloco, batch=0, resets=0)


def on_reset():
    state.resets += 1


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while state.batch < BATCHES:
        train_step(model, optimizer, state.averager, state.batch)
        train_step_diloco(outer_model, state.diloco, state.batch)
        state.batch += 1
        if state.batch == SHRINK_AT and hvd.rank() == 0 and hvd.size() == 4:
            Path(os.environ["HVA_ELASTIC_HOSTS_FILE"]).write_text("localhost:3\n")
        state.commit()


train(state)
size = hvd.size()
weights = hvd.allgather(model.weight.detach().reshape(1, -1), name="elastic.final")
steps = hvd.allgather_object(state.averager.step, name="elastic.steps")
levels = state.averager.period_group_size_dict
outer = hvd.allgather(outer_model.weight.detach().reshape(1, -1), name="elastic.diloco")
globals_ = hvd.allgather(diloco.global_parameters[0].detach().reshape(1, -1), name="elastic.global")
diloco_steps = hvd.allgather_object(diloco.averager.step, name="elastic.diloco.steps")
print(f"rank {hvd.rank()}: size {size}, resets {state.resets}, steps {steps}, levels {levels}", flush=True)
assert size == 3, size
assert steps == [BATCHES] * size, steps
assert levels == {2: 1, 4: 3}, levels
assert torch.equal(weights.min(0).values, weights.max(0).values), "parameters differ after the final averaging"
assert diloco_steps == [BATCHES] * size, diloco_steps
assert torch.equal(globals_.min(0).values, globals_.max(0).values), "DiLoCo's global copies differ"
assert torch.equal(outer.min(0).values, outer.max(0).values), "parameters differ after the outer step"
if hvd.rank() == 0:
    print(f"elastic ok: resumed on {size} ranks, averager step {steps[0]} on every rank, "
          "parameters equal after the final averaging, DiLoCo's global copy equal on every rank", flush=True)
