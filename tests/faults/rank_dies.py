"""Fault injection, launched by tools/run_tests.py: one rank exits mid-training.

    horovodrun -np 4 python tests/faults/rank_dies.py --die-at 8   # a firing step (period 4)
    horovodrun -np 3 python tests/faults/rank_dies.py --die-at 9   # a non-firing step

Rank 1 records ``exits on purpose`` and calls ``os._exit(17)`` just before its averaging call at
``--die-at``; the others go on training and block in the next averaging round. Every rank keeps
its record in ``--record-dir`` (:mod:`rank_record`). The runner checks that the job ends (the
launcher or the averaging timeout stops the survivors), non-zero, in bounded time, that rank 1
died where it was told to, and that every other rank accounts for itself: it raised a named
error, or its record and the signal's traceback say where it was when it was ended.
"""
import argparse
import os
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from rank_record import RankRecord

parser = argparse.ArgumentParser()
parser.add_argument("--die-at", type=int, required=True)
parser.add_argument("--record-dir", required=True)
args = parser.parse_args()

hva.init()
record = RankRecord(Path(args.record_dir), hvd.rank())
torch.manual_seed(hvd.rank())
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
averager = hva.PeriodicModelAverager(period=4)
step = 0
try:
    for step in range(40):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        if hvd.rank() == 1 and step == args.die_at:
            record.update(step=step, exit="exits on purpose")
            print(f"rank 1 exits at step {step}", flush=True)
            os._exit(17)
        record.update(step=step, inside="average_parameters")
        averager.average_parameters(model.parameters())
        record.update(inside=None)
except Exception as error:
    record.caught(error, step)
    record.update(exit="raised")
    raise
record.update(exit="completed")
print(f"rank {hvd.rank()} reached the end of training", flush=True)
