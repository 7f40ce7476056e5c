"""int8 on the wire against float32, in the main job's training: the same methods, task, seed and
number of steps, only what the top level (the one that crosses the link) sends differs. Each
run's held-out loss is the main job's (``evaluate_snapshots`` of the rank-averaged model, or
DiLoCo's global copy, after the last step). Launched on the emulated cluster:

    python tools/cluster.py --nodes 2 --rate-mbit 200 -- horovodrun --mpi -np 4 -H {hosts:2} \\
        --network-interface eth0 python bench/int8_quality.py --out results/int8_quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from hvd_averaging.examples.methods import build_trainer, label
from hvd_averaging.examples.race import RaceLimits, evaluate_snapshots, run_method
from hvd_averaging.examples.tasks import TASKS
from hvd_averaging.examples.train import parse_args

WIRES = (("none", False), ("int8", False), ("int8", True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=257, help="steps per run (257: local SGD's last step averages)")
    parser.add_argument("--methods", default="local,diloco")
    parser.add_argument("--seed", type=int, default=0)
    mine, rest = parser.parse_known_args()
    args = parse_args(rest)  # the main job's defaults (periods, lr, outer optimizer)
    hva.init()
    torch.set_num_threads(1)
    task = TASKS[args.task]()
    size = hvd.size()
    args = args.for_world(task.default_lr, size)
    eval_model = task.model(mine.seed)
    results = []
    for method in mine.methods.split(","):
        for compression, feedback in WIRES:
            wired = args.with_wire(compression, feedback)
            model = task.model(mine.seed)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            trainer = build_trainer(method, model, task, wired)
            name = f"q.{method}.{compression}.{int(feedback)}"
            hva.reset_traffic()
            began = time.monotonic()
            run = run_method(trainer, task.batches(hvd.rank(), size, mine.seed),
                             RaceLimits(budget_s=None, steps=mine.steps, grid_points=1, label=name),
                             link_interface="eth0", quiet=True, name=name)
            curve = evaluate_snapshots([run.final], eval_model, task.evaluate, None, f"{name}.eval")
            if hvd.rank() == 0:
                results.append({"method": method, "label": label(method, wired),
                                "compression": compression, "error_feedback": feedback,
                                "steps": run.steps, "final_loss": curve[-1][-1],
                                "cross_node_mb_per_rank": hva.traffic().cross_node_bytes / 1e6,
                                "seconds": time.monotonic() - began})
                print(f"{results[-1]['label']}: {run.steps} steps, held-out loss "
                      f"{results[-1]['final_loss']:.5f}", flush=True)
    if hvd.rank() == 0:
        for r in results:
            base = next(b for b in results if b["method"] == r["method"] and b["compression"] == "none")
            r["relative_to_float32"] = r["final_loss"] / base["final_loss"] - 1
        mine.out.parent.mkdir(parents=True, exist_ok=True)
        mine.out.write_text(json.dumps({"seed": mine.seed, "ranks": size, "runs": results}, indent=1))
        for r in results:
            print(f"{r['method']:<8} {r['compression']:<5} feedback={r['error_feedback']!s:<5} "
                  f"loss {r['final_loss']:.5f} ({r['relative_to_float32'] * 100:+.2f}% vs float32), "
                  f"{r['cross_node_mb_per_rank']:.1f} MB counted across the link per rank", flush=True)


if __name__ == "__main__":
    sys.exit(main())
