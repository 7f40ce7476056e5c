"""Elastic Gloo run that loses a worker, launched by tools/run_tests.py:

    echo localhost:4 > hosts; HVA_ELASTIC_HOSTS_FILE=hosts horovodrun --gloo -np 4 --min-np 2 \
        --max-np 4 --host-discovery-script tests/faults/discover_hosts.sh \
        python tests/faults/elastic_shrink.py

At batch 10 rank 0 rewrites the hosts file to 3 slots; Horovod removes a worker, resets (dropping
every process set) and resumes from the last commit. The averager's step is committed state and
its hierarchy ({2: 1, 4: world}: a level that fits any size, everyone every 4 steps) is
rebuilt for 3 ranks as {2: 1, 4: 3}. A DiLoCo (outer step every 4 batches) rolls back with it:
its global copy, made from each rank's own initial weights, is rank 0's from the first sync on,
and its state is restored locally after the failure. A ``PostLocalSGDOptimizer`` and a
``PostLocalSGD`` (its node-local gradient group made again for the new world) ride in the same
state as optimizers: their restore is local and their steps are synced (at 93134b6 Horovod's
optimizer handler called their collective ``load_state_dict`` inside ``restore()``, right after
the failure). At the end every rank of the final world writes
``HVA_RECORD_DIR/final-rank{R}.json`` (world size, resets, steps, levels, digests of its
parameters, its wrappers' parameters and DiLoCo's global copy); the runner checks that there are
3, that each step matches the batch count and that the digests are equal across ranks.
"""
import json
import os
import warnings
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
import hvd_averaging.elastic  # noqa: F401  (registers the averager with TorchState)
from hvd_averaging.agreement import tensor_digest
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
wrapped_model, local_model = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
wrapped = hva.PostLocalSGDOptimizer(torch.optim.SGD(wrapped_model.parameters(), lr=0.05, momentum=0.9),
                                    hva.PeriodicModelAverager(period=4))
post_local = hva.PostLocalSGD(torch.optim.SGD(local_model.parameters(), lr=0.05, momentum=0.9),
                              local_model.named_parameters(), start_localSGD_iter=4,
                              averager=hva.PeriodicModelAverager(period=4, warmup_steps=4))
state = hvd.elastic.TorchState(model, optimizer, averager=averager, outer_model=outer_model,
                               diloco=diloco, wrapped_model=wrapped_model, wrapped=wrapped,
                               local_model=local_model, post_local=post_local, batch=0, resets=0)


def on_reset():
    state.resets += 1


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while state.batch < BATCHES:
        train_step(model, optimizer, state.averager, state.batch)
        train_step_diloco(outer_model, state.diloco, state.batch)
        train_step_diloco(wrapped_model, state.wrapped, state.batch)
        train_step_diloco(local_model, state.post_local, state.batch)
        state.batch += 1
        if state.batch == SHRINK_AT and hvd.rank() == 0 and hvd.size() == 4:
            Path(os.environ["HVA_ELASTIC_HOSTS_FILE"]).write_text("localhost:3\n")
        state.commit()


train(state)
# Each rank of the final world leaves its account; the runner compares them across ranks.
record = {"rank": hvd.rank(), "size": hvd.size(), "resets": state.resets,
          "averager_step": state.averager.step, "diloco_step": diloco.averager.step,
          "levels": state.averager.period_group_size_dict,
          "parameters_digest": tensor_digest([model.weight]),
          "outer_parameters_digest": tensor_digest([outer_model.weight]),
          "global_copy_digest": tensor_digest(diloco.global_parameters),
          "wrapper_steps": [wrapped.averager.step, post_local.averager.step],
          "wrapper_parameters_digest": tensor_digest([wrapped_model.weight, local_model.weight])}
folder = Path(os.environ["HVA_RECORD_DIR"])
(folder / f"final-rank{hvd.rank()}.partial").write_text(json.dumps(record))
os.replace(folder / f"final-rank{hvd.rank()}.partial", folder / f"final-rank{hvd.rank()}.json")
print(f"rank {hvd.rank()}: size {hvd.size()}, resets {state.resets}, averager step "
      f"{state.averager.step}, levels {state.averager.period_group_size_dict}", flush=True)
