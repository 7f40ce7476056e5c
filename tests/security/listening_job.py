"""A small averaging job that holds still while tools/security_tests.py lists every listening
socket on the emulated nodes and, in the elastic launch, attacks the rendezvous server.

Rank 0 writes ``$HVA_PROBE_DIR/job.json`` (the rendezvous address and port Horovod gave the
workers, and its own rendezvous key); every rank then waits for ``$HVA_PROBE_DIR/probed`` (at
most 120 s), averages once and prints ``listening job ok``. Under an elastic launch the work runs
inside ``hvd.elastic.run``, so each worker has registered its addresses with the rendezvous
server (the legitimate PUT, signed with the job secret) before the probe.
"""
import json
import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva

PROBE_DIR = Path(os.environ["HVA_PROBE_DIR"])


def hold_still_then_average() -> None:
    if hvd.rank() == 0:
        job = {"addr": os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
               "port": os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT"),
               "key": f"{os.environ.get('HOROVOD_HOSTNAME')}:{os.environ.get('HOROVOD_LOCAL_RANK')}"}
        (PROBE_DIR / "job.json.tmp").write_text(json.dumps(job))
        (PROBE_DIR / "job.json.tmp").rename(PROBE_DIR / "job.json")
    deadline = time.monotonic() + 120
    while not (PROBE_DIR / "probed").exists():
        if time.monotonic() > deadline:
            raise SystemExit("listening job: no probe within 120 s")
        time.sleep(0.2)
    weight = torch.nn.Parameter(torch.full((4,), float(hvd.rank())))
    weight.grad = torch.zeros_like(weight)
    hva.average_parameters([weight])
    assert weight[0].item() == (hvd.size() - 1) / 2
    print(f"rank {hvd.rank()}: listening job ok", flush=True)


hva.init()
if os.environ.get("HOROVOD_ELASTIC") == "1":
    state = hvd.elastic.TorchState(torch.nn.Linear(2, 1), done=False)

    @hvd.elastic.run
    def run(state):
        hold_still_then_average()

    run(state)
else:
    hold_still_then_average()
