"""Fault injection, launched by tools/run_tests.py: one rank exits mid-training.

    horovodrun -np 4 python tests/faults/rank_dies.py --die-at 8   # a firing step (period 4)
    horovodrun -np 3 python tests/faults/rank_dies.py --die-at 9   # a non-firing step

Rank 1 calls ``os._exit(17)`` just before its averaging call at ``--die-at``; the others go on
training and block in the next averaging round. The runner checks that the job ends (the
launcher or the averaging timeout stops the survivors), non-zero, in bounded time, and that no
rank reached the end of training.
"""
import argparse
import os

import horovod.torch as hvd
import torch

import hvd_averaging as hva

parser = argparse.ArgumentParser()
parser.add_argument("--die-at", type=int, required=True)
args = parser.parse_args()

hva.init()
torch.manual_seed(hvd.rank())
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
averager = hva.PeriodicModelAverager(period=4)
for step in range(40):
    optimizer.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    if hvd.rank() == 1 and step == args.die_at:
        print(f"rank 1 exits at step {step}", flush=True)
        os._exit(17)
    averager.average_parameters(model.parameters())
print(f"rank {hvd.rank()} reached the end of training", flush=True)
