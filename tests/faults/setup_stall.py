"""A set-up wait Horovod gives no handle to poll: rank 0 registers a process set the other ranks
never register (they sleep), so ``hvd.add_process_set`` blocks inside Horovod. The watchdog must
end rank 0 ``hva.timeout()`` plus its grace later, naming the registration, and the launcher then
ends the job. Launched by tools/run_tests.py:

    HVA_TIMEOUT_SECONDS=3 horovodrun -np 2 python tests/faults/setup_stall.py
"""
import time

import horovod.torch as hvd

import hvd_averaging as hva

hva.init()
if hvd.rank() == 0:
    print("setup stall: rank 0 registers a process set alone", flush=True)
    hva.process_set([0])  # collective: the other rank never joins
    print("setup stall: registered, which cannot happen", flush=True)
else:
    time.sleep(120)
