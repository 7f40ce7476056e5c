"""Hierarchical SGD under SLURM: the node every 2 steps, everyone every 8, on a small model.

The last of the 41 steps (step 40) is a global round, so every rank ends with the same model.

Each rank checks that the library's node-level group is exactly the ranks SLURM put on its node
(``SLURM_NODEID``), trains, and checks that every rank ends with the same parameters. Rank 0
prints one ``slurm train:`` line per rank and writes ``placement.json`` to ``--out``; a rank whose
averager cannot be built (the placement does not fit the node level) writes ``rankR.json`` with
the error there.

    sbatch examples/slurm/train.sbatch            # runs this on 2 nodes x 2 tasks
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from hvd_averaging.gather_text import allgather_text


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=41, help="ends on a global round")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--node-group-size", type=int, default=None,
                        help="the node level's group size (default: SLURM's tasks per node)")
    args = parser.parse_args()
    hva.init()
    per_node = args.node_group_size or int(os.environ.get("SLURM_NTASKS_PER_NODE", hvd.local_size()))
    torch.manual_seed(hvd.rank())  # different starting points: the averaging must join them
    model = torch.nn.Linear(256, 16)
    try:
        averager = hva.HierarchicalModelAverager({2: per_node, 8: hvd.size()})
    except ValueError as error:  # raised on every rank alike, before any averaging
        print(f"slurm train: rank {hvd.rank()} raised ValueError: {error}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)  # each rank's record, for the job's checks
        (args.out / f"rank{hvd.rank()}.json").write_text(json.dumps(
            {"rank": hvd.rank(), "error_type": type(error).__name__, "error_message": str(error)}))
        return 2
    opt = hva.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), averager)
    for _ in range(args.steps):
        x = torch.randn(32, 256)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    mine = {"rank": hvd.rank(), "slurm_nodeid": os.environ.get("SLURM_NODEID"),
            "slurmd_nodename": os.environ.get("SLURMD_NODENAME"), "host": socket.gethostname(),
            "node_group": list(hva.local_process_set().ranks),
            "checksum": float(flat.double().sum())}
    # every rank's facts as JSON text in a tensor of bytes (nothing pickled between ranks)
    everyone = [json.loads(text) for text in allgather_text(
        json.dumps(mine), name="slurm_train.facts", what="the ranks' placement facts",
        width=1024)]
    by_node: dict = {}
    for r in everyone:
        by_node.setdefault(r["slurm_nodeid"], []).append(r["rank"])
    wrong = [r["rank"] for r in everyone if sorted(r["node_group"]) != sorted(by_node[r["slurm_nodeid"]])]
    same = len({r["checksum"] for r in everyone}) == 1
    if hvd.rank() == 0:
        for r in everyone:
            print(f"slurm train: rank {r['rank']} on {r['slurmd_nodename']} (SLURM_NODEID "
                  f"{r['slurm_nodeid']}, host {r['host']}): node group {r['node_group']}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "placement.json").write_text(json.dumps(
            {"ranks": everyone, "groups_follow_slurm_nodes": not wrong,
             "parameters_equal": same}, indent=1))
        print(f"slurm train: {'ok' if not wrong and same else 'FAILED'} (node groups follow "
              f"SLURM's nodes: {not wrong}; parameters equal on every rank: {same})", flush=True)
    return 0 if not wrong and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
