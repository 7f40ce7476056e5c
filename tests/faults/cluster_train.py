"""Training across emulated nodes, for the fault runs of tools/run_tests.py (the link between
nodes cut, a node lost, a link too slow for the timeout):

    horovodrun --gloo -np 4 -H n0:2,n1:2 python tests/faults/cluster_train.py --checkpoint-dir D

Every rank prints ``cluster_train: rank R step S`` at each firing step (the runner injects the
fault when rank 0 reaches step 10) and keeps its record in ``D/rankR.json``
(:mod:`rank_record`). A user's ``except`` block: on ``AveragingTimeoutError`` or
``HorovodInternalError`` the rank records what it caught, saves a checkpoint (model, optimizer and
averager state) to ``D/rank{R}.pt``, records its path and the digest of its values, and re-raises,
so the process ends non-zero. The runner judges from the records: the times, the errors, that the
checkpoints load and hold the values recorded.
"""
import argparse
import json
import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

import hvd_averaging as hva
from hvd_averaging.deadlines import watchdog_grace
from hvd_averaging.gather_text import allgather_text
from rank_record import RankRecord

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--period", type=int, default=2)
parser.add_argument("--numel", type=int, default=100_000, help="parameters of the model")
parser.add_argument("--step-seconds", type=float, default=0.05, help="stand-in for compute")
parser.add_argument("--group-sizes", action="store_true", help="hva.init(group_sizes=[local])")
parser.add_argument("--checkpoint-dir", required=True)
args = parser.parse_args()

if args.group_sizes:
    hva.init(group_sizes=[int(os.environ.get("HVA_LOCAL_SIZE", "2"))])
else:
    hva.init()
rank = hvd.rank()
record = RankRecord(Path(args.checkpoint_dir), rank)
hosts = allgather_text(os.uname().nodename, name="cluster_train.hosts", what="host names")
node_peers = [r for r, host in enumerate(hosts) if host == hosts[rank] and r != rank]
torch.manual_seed(rank)
model = torch.nn.Linear(args.numel // 10, 10, bias=False)
optimizer = hva.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      hva.PeriodicModelAverager(period=args.period))
print(f"cluster_train: rank {rank} of {hvd.size()} on {os.uname().nodename}, "
      f"timeout {hva.timeout():g} s", flush=True)


def peer_accounted(peer: int) -> bool:
    """The node peer saved its checkpoint, or the watchdog ended it (its record names the pid)."""
    folder = Path(args.checkpoint_dir)
    if (folder / f"rank{peer}.pt").exists():
        return True
    try:
        pid = json.loads((folder / f"rank{peer}.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return False
    return (folder / f"watchdog-{pid}.json").exists()


# A peer blocked inside Horovod where the library's timeout cannot act is ended by the watchdog
# a grace after the timeout: wait that long and a little more, well within the time a rank has
# to exit after its own timeout (half the timeout). Seen under SLURM with a 4 s wait: a rank
# exited before its node peer's watchdog (5 s grace) acted, and SLURM killed the peer (SIGKILL,
# no record).
PEER_WAIT_S = max(4.0, watchdog_grace(hva.timeout()) + 1.5)
step = 0
try:
    for step in range(args.steps):
        optimizer.zero_grad()
        model(torch.randn(8, args.numel // 10)).square().mean().backward()
        time.sleep(args.step_seconds)
        started = time.monotonic()
        record.update(step=step, inside="optimizer.step")
        optimizer.step()
        record.update(inside=None)
        if step % args.period == 0:
            print(f"cluster_train: rank {rank} step {step} averaged in "
                  f"{time.monotonic() - started:.2f} s", flush=True)
except (hva.AveragingTimeoutError, HorovodInternalError) as error:
    # Output from a node behind a cut link never reaches the launcher: the record does.
    record.caught(error, step)
    print(f"cluster_train: rank {rank} caught {type(error).__name__} at step {step}: {error}",
          flush=True)
    path = Path(args.checkpoint_dir) / f"rank{rank}.pt"
    partial = path.with_suffix(".partial")  # renamed when whole: peers wait for the name
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
               partial)
    os.replace(partial, path)
    record.saved(path, model.state_dict())
    print(f"cluster_train: rank {rank} checkpoint saved to {path}", flush=True)
    # Under Gloo, a rank that exits closes its sockets, and a peer whose timed-out round is
    # still pending in Horovod's background thread aborts on that (gloo::IoException), maybe
    # before it saved: seen in make test, once with a fixed 2 s wait. Behind a cut link only
    # the node's own ranks can close a socket on it, so each rank waits (bounded: PEER_WAIT_S)
    # until each rank of its node has saved too or been ended by the watchdog.
    deadline = time.monotonic() + PEER_WAIT_S
    while time.monotonic() < deadline and not all(peer_accounted(p) for p in node_peers):
        time.sleep(0.05)
    record.update(exit="raised")
    raise
record.update(step=step, exit="completed")
print(f"cluster_train: rank {rank} reached the end of training", flush=True)
