"""A set-up wait Horovod gives no handle to poll: rank 0 registers a process set the other ranks
never register (they sleep), so ``hvd.add_process_set`` blocks inside Horovod. The watchdog must
end rank 0 ``hva.timeout()`` plus its grace later, naming the registration, and the launcher then
ends the job. Each rank keeps its record in ``--record-dir`` (:mod:`rank_record`). Launched by
tools/run_tests.py:

    HVA_TIMEOUT_SECONDS=3 HVA_WATCHDOG_RECORD_DIR=D horovodrun -np 2 \
        python tests/faults/setup_stall.py --record-dir D
"""
import argparse
import time
from pathlib import Path

import horovod.torch as hvd

import hvd_averaging as hva
from rank_record import RankRecord

parser = argparse.ArgumentParser()
parser.add_argument("--record-dir", required=True)
args = parser.parse_args()

hva.init()
record = RankRecord(Path(args.record_dir), hvd.rank())
if hvd.rank() == 0:
    print("setup stall: rank 0 registers a process set alone", flush=True)
    record.update(step=0, inside="hva.process_set([0])")
    hva.process_set([0])  # collective: the other rank never joins
    record.update(inside=None, exit="completed")  # which cannot happen
else:
    record.update(step=0, inside="time.sleep")
    time.sleep(120)
