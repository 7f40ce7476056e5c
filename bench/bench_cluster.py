"""Global averaging across emulated nodes, side by side in one run: Horovod's flat allreduce,
hvd_averaging flat, node-aware, float16 and int8 on the wire (with the bytes each one sent on
the node's link, and int8's time per stage); and training with averaging overlapped
(``delay``) against training with none. Launched on the emulated cluster by ``bench/run.py``:

    python tools/cluster.py --nodes 2 --rate-mbit 200 -- horovodrun --mpi -np 4 -H {hosts:2} \\
        --network-interface eth0 python bench/bench_cluster.py --out results/bench/cluster.json

Every timed repetition starts after a barrier; its time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from hvd_averaging.rounds import average_tensors
from hvd_averaging.routes import averaging_route, routes
from hvd_averaging.placement import rank_to_node
from hvd_averaging.wire import Int8

from bench_averaging import timed_interleaved
from bench_common import equal_shapes, make_params, node_link_bytes, slowest_rank, stage_times
from labels import (HOROVOD_FLAT, HVA_CHOSEN, HVA_FLAT, HVA_FLAT_FP16, HVA_NODE_AWARE,
                    HVA_NODE_AWARE_FP16, HVA_NODE_AWARE_INT8, INTRA_NODE)


def int8_stage_times(params, reps: int) -> dict:
    """Where an int8 node-aware round's time goes, per stage (see :func:`stage_times`)."""
    buffer = torch.cat([p.detach().reshape(-1) for p in params])
    route = routes().route(hvd.global_process_set, buffer.numel() * 4)
    return stage_times(Int8().codec().transport(route), buffer, reps, "int8")


class Compute:
    """A fixed amount of work per training step (matrix products on one thread)."""

    def __init__(self, seconds: float):
        self.a = torch.randn(256, 256)
        self.iterations = 5
        self.run()  # warm-up
        self.iterations = 50
        start = time.perf_counter()
        self.run()
        per_iteration = (time.perf_counter() - start) / 50
        self.iterations = max(1, round(seconds / per_iteration))
        # the same work on every rank: agree on the iteration count
        self.iterations = int(hvd.allreduce(torch.tensor([self.iterations]), op=hvd.Min,
                                            name="bench.compute"))

    def run(self) -> None:
        x = self.a
        for _ in range(self.iterations):
            x = torch.tanh(x @ self.a) * 0.5


def training(averager, params, compute: Compute, steps: int, tag: str) -> dict:
    """Seconds per step (slowest rank) and the cost of average_parameters on the steps that
    only keep a round moving."""
    call_us = []
    hvd.barrier()
    start = time.perf_counter()
    for step in range(steps):
        compute.run()
        if averager is not None:
            t0 = time.perf_counter()
            averager.average_parameters(params)
            call_us.append((step, (time.perf_counter() - t0) * 1e6))
    elapsed = slowest_rank(time.perf_counter() - start, f"train.{tag}")
    result = {"step_s": elapsed / steps}
    if averager is not None and getattr(averager, "delay", 0):
        period, delay = averager.period, averager.delay
        polling = [us for step, us in call_us if 0 < step % period < delay]
        result["polling_call_us_median"] = statistics.median(polling)
        result["polling_call_us_max"] = max(polling)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mb", type=float, default=16.0)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rate-mbit", type=float, required=True)
    parser.add_argument("--overlap", action="store_true", help="also time training with averaging overlapped")
    parser.add_argument("--step-ms", type=float, default=120.0)
    parser.add_argument("--delay", type=int, default=4,
                        help="smallest delay; raised until one averaging round fits into it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_node = int(os.environ.get("HOROVOD_LOCAL_SIZE") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or 1)
    # The node groups (and with them the rails) registered at start-up, as the README advises:
    # Horovod then runs without dynamic process sets, whose per-cycle coordination over the
    # loaded link can hold up an enqueue. (Gloo across hosts falls back to dynamic, with a warning.)
    hva.init(group_sizes=[per_node] if per_node > 1 else None)
    hva.set_timeout(120)
    rank, size = hvd.rank(), hvd.size()
    nodes = rank_to_node()
    node_count = len(set(nodes))
    node_ranks = [r for r in range(size) if nodes[r] == nodes[rank]]
    node_sets = {}
    for node in dict.fromkeys(nodes):
        group = [r for r in range(size) if nodes[r] == node]
        node_sets[node] = hva.process_set(group) if len(group) < size else hvd.global_process_set
    my_node_set = node_sets[nodes[rank]]

    shapes = equal_shapes(args.mb, args.tensors)
    sets_of_params = {label: make_params(shapes, seed=rank)
                      for label in (HVA_FLAT, HVA_NODE_AWARE, HVA_NODE_AWARE_FP16, HVA_FLAT_FP16,
                                    HVA_NODE_AWARE_INT8, INTRA_NODE, HVA_CHOSEN)}
    numel = sum(p.numel() for p in sets_of_params[HVA_FLAT])
    flat = torch.randn(numel)
    fp16 = hvd.Compression.fp16
    methods = {
        HOROVOD_FLAT: lambda: hvd.allreduce_(flat, op=hvd.Average, name="bench.horovod.flat"),
        HVA_FLAT: lambda: average_tensors(sets_of_params[HVA_FLAT], node_aware=False, name="b.flat"),
        HVA_NODE_AWARE: lambda: average_tensors(sets_of_params[HVA_NODE_AWARE], node_aware=True,
                                                name="b.na"),
        HVA_NODE_AWARE_FP16: lambda: average_tensors(sets_of_params[HVA_NODE_AWARE_FP16],
                                                     compression=fp16, node_aware=True,
                                                     name="b.na16"),
        HVA_NODE_AWARE_INT8: lambda: average_tensors(sets_of_params[HVA_NODE_AWARE_INT8],
                                                     compression="int8", node_aware=True,
                                                     name="b.na8"),
        HVA_FLAT_FP16: lambda: average_tensors(sets_of_params[HVA_FLAT_FP16], compression=fp16,
                                               node_aware=False, name="b.flat16"),
        INTRA_NODE: lambda: average_tensors(sets_of_params[INTRA_NODE], my_node_set, name="b.node"),
        # the library's default: the faster way, timed at the first round (in the warm-up)
        HVA_CHOSEN: lambda: average_tensors(sets_of_params[HVA_CHOSEN], name="b.chosen"),
    }
    results = timed_interleaved(methods, args.reps, "cluster")
    for index, (label, fn) in enumerate(methods.items()):
        results[label]["link_bytes_per_rank"] = node_link_bytes(fn, len(node_ranks), index)
    nbytes = numel * 4
    # each node must receive 2 (n-1)/n of the buffer (reduce-scatter + allgather between nodes)
    link_limit_s = 2 * (node_count - 1) / node_count * nbytes * 8 / (args.rate_mbit * 1e6)
    report = {"ranks": size, "nodes": node_count, "ranks_per_node": len(node_ranks),
              "controller": "mpi" if hvd.mpi_enabled() else "gloo", "rate_mbit": args.rate_mbit,
              "bytes": nbytes, "tensors": args.tensors, "link_limit_s": link_limit_s,
              "route": averaging_route(hvd.global_process_set, nbytes),
              "routes_chosen": hva.traffic().routes,
              "cpus": os.cpu_count(), "methods": results,
              "int8_stages": int8_stage_times(sets_of_params[HVA_NODE_AWARE_INT8], args.reps)}

    if args.overlap:
        compute = Compute(args.step_ms / 1e3)
        params = make_params(shapes, seed=rank)
        # One averaging must fit into `delay` steps of compute: measure both here (a short run
        # without averaging, one averaging round while training), then choose the delay with a
        # margin and the period just above it.
        base = training(None, params, compute, 16, "probe.none")["step_s"]
        probe = hva.PeriodicModelAverager(1 << 30)
        hvd.barrier()
        t0 = time.perf_counter()
        probe.average_parameters(params)
        round_s = slowest_rank(time.perf_counter() - t0, "probe.round")
        delay = max(args.delay, math.ceil(1.5 * round_s / base))
        period = delay + 4
        steps = period * 4
        overlap = {"period": period, "delay": delay, "steps": steps,
                   "averaging_round_s": round_s, "compute_step_s": base}
        overlap["no averaging"] = training(None, params, compute, steps, "none")
        overlap["local SGD, delay 0"] = training(
            hva.PeriodicModelAverager(period), params, compute, steps, "sync")
        overlap[f"local SGD, delay {delay}"] = training(
            hva.PeriodicModelAverager(period, delay=delay), params, compute, steps, "delayed")
        overlap[f"local SGD, delay {delay}, fp16 wire"] = training(
            hva.PeriodicModelAverager(period, delay=delay, compression=fp16),
            params, compute, steps, "delayed16")
        # What a polling call costs by itself: a round in flight (its transfer still uses the
        # CPUs), no training competing for them.
        averager = hva.PeriodicModelAverager(1000, delay=999)
        averager.average_parameters(params)
        idle_us = []
        for _ in range(200):
            t0 = time.perf_counter()
            averager.average_parameters(params)
            idle_us.append((time.perf_counter() - t0) * 1e6)
            time.sleep(0.002)
        overlap["polling call, nothing else running"] = {
            "median_us": statistics.median(idle_us), "max_us": max(idle_us),
            "slowest_rank_median_us": slowest_rank(statistics.median(idle_us), "idle") }
        report["overlap"] = overlap
    if rank == 0:
        for label, r in results.items():
            print(f"[{size} ranks, {node_count} nodes] {label}: {r['min_s'] * 1e3:.0f} ms "
                  f"(median {r['median_s'] * 1e3:.0f}); link limit {link_limit_s * 1e3:.0f} ms", flush=True)
        for label, r in report.get("overlap", {}).items():
            if isinstance(r, dict) and "step_s" in r:
                print(f"[{size} ranks] {label}: {r['step_s'] * 1e3:.1f} ms/step"
                      + (f", polling calls median {r['polling_call_us_median']:.1f} us, max "
                         f"{r['polling_call_us_max']:.0f} us" if "polling_call_us_median" in r else ""),
                      flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
