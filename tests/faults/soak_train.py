"""The elastic job of the fault soak (tools/soak.py), one worker per emulated node:

    HVA_ELASTIC_HOSTS_FILE=hosts HVA_SOAK_DIR=dir horovodrun --gloo -np 4 --min-np 2 --max-np 4 \\
        --network-interface eth0 --host-discovery-script tests/faults/discover_hosts.sh \\
        --blacklist-cooldown-range 1 2 python -u tests/faults/soak_train.py

Trains a small model with a ``PostLocalSGDOptimizer`` (SGD with momentum, a
``PeriodicModelAverager`` of period 2) held by ``TorchState``, committing after every batch (so
the faults kill, cut off and stop workers in the middle of the wrapper's averaging), until rank 0 finds ``HVA_SOAK_DIR/stop`` (it tells the others with
a broadcast after every all-rank average, so every rank leaves at the same batch with the same
parameters). The soak driver injects faults meanwhile
and judges from what each worker writes to ``HVA_SOAK_DIR/records/HOST-PID.jsonl``, one JSON
object a line:

- ``start``: the worker entered training in a new world (after Horovod's sync): the world's
  token (drawn by its rank 0 and broadcast), rank, size, the batch it resumes from and a digest
  of the parameters there;
- ``commit``: a batch committed, with the digest when the averager averaged over every rank at
  that batch (the parameters must then be bit-identical across the world);
- ``error``: what ended a world on this worker (the type and the first line of the message);
- ``end``: training finished (the stop was seen).

The library's :class:`hva.AveragingTimeoutError` (a peer behind a cut link, or stalled) is
turned into Horovod's ``HorovodInternalError`` here so that ``hvd.elastic.run`` restores the last
commit and resets, as it does for a peer that died.
"""
import faulthandler
import json
import os
import signal
import socket
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

import hvd_averaging as hva
from hvd_averaging.agreement import tensor_digest

PERIOD = 2
STEP_SECONDS = float(os.environ.get("HVA_SOAK_STEP_SECONDS", "0.1"))
SOAK_DIR = Path(os.environ["HVA_SOAK_DIR"])
RECORD = SOAK_DIR / "records" / f"{socket.gethostname()}-{os.getpid()}.jsonl"


def record(event: str, **fields) -> None:
    """Append one line to this worker's record; flushed at once (a worker can be killed)."""
    line = json.dumps({"event": event, "time": time.time(), "host": socket.gethostname(),
                       "pid": os.getpid(), **fields})
    with open(RECORD, "a") as out:
        out.write(line + "\n")
        out.flush()


# the soak driver sends SIGUSR1 to every live worker when the job is not whole again in time:
# each then writes every thread's Python stack beside its record
STACKS = open(RECORD.with_suffix(".stacks"), "a")
faulthandler.register(signal.SIGUSR1, file=STACKS, all_threads=True)

hva.init()
# This job recovers from a timeout (the elastic reset below), so the watchdog must not end a rank
# half the timeout after one, its default: the reset can wait longer than that in Horovod's
# rendezvous for a stalled peer (in a soak at the default the watchdog ended the last survivor
# there and the job never recovered).
hva.set_timeout(hva.timeout(), exit_after=None)
torch.manual_seed(0)  # the same start on every worker; a newcomer takes rank 0's state anyway
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
optimizer = hva.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                      hva.PeriodicModelAverager(period=PERIOD))
state = hvd.elastic.TorchState(model, optimizer, batch=0)  # the wrapper's own state handler
record("process", rank=hvd.rank(), size=hvd.size())


def digest() -> str:
    return f"{tensor_digest(model.parameters()):016x}"


@hvd.elastic.run
def train(state):
    token = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    token = hvd.broadcast(token, root_rank=0, name="soak.world")
    world = f"{int(token.item()):016x}"
    record("start", world=world, rank=hvd.rank(), size=hvd.size(), batch=state.batch,
           averager_step=optimizer.averager.step, digest=digest())
    try:
        while True:
            # asked only right after an all-rank average (the averager's step is synced), so
            # that the ranks end with the same parameters
            if optimizer.averager.step % PERIOD == 1:
                stop = torch.tensor([int(hvd.rank() == 0 and (SOAK_DIR / "stop").exists())])
                if int(hvd.broadcast(stop, root_rank=0, name="soak.stop").item()):
                    return world
            # this worker's data for the batch: its rank in this world and the batch
            torch.manual_seed(1000 * hvd.rank() + state.batch)
            inputs = torch.randn(16, 64)
            optimizer.zero_grad()
            (model(inputs) - inputs[:, :8]).square().mean().backward()
            averaged = optimizer.averager.step % PERIOD == 0
            optimizer.step()  # the inner step, then the average when due
            state.batch += 1
            time.sleep(STEP_SECONDS)
            state.commit()
            record("commit", world=world, batch=state.batch,
                   digest=digest() if averaged else None)
    except hva.AveragingTimeoutError as error:
        record("error", world=world, batch=state.batch, type=type(error).__name__,
               message=str(error).splitlines()[0][:300])
        raise HorovodInternalError(f"soak: {error}") from error
    except Exception as error:
        record("error", world=world, batch=state.batch, type=type(error).__name__,
               message=str(error).splitlines()[0][:300] if str(error) else "")
        raise


world = train(state)
record("end", world=world, batch=state.batch, digest=digest())
