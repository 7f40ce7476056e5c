"""Averaging cost, side by side in one run: hvd_averaging against PyTorch's averaging util and
raw Horovod, on the same tensors and ranks. Launch under horovodrun (``bench/run.py`` does):

    horovodrun -np 2 -H localhost:2 python bench/bench_averaging.py --out results/bench/mpi-np2.json

Every timed repetition starts after a barrier; a repetition's time is the slowest rank's, and
the report gives the minimum and median over repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import horovod
import horovod.torch as hvd
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import utils as torch_averaging

import hvd_averaging as hva
from hvd_averaging.rounds import average_tensors
from hvd_averaging.deadlines import bounded_collective

from bench_common import make_params, slowest_rank
from labels import (BIG, FIRST_CALL, FLOOR, FLOOR_POLLED, GLOBAL_LEVEL, GROUPED, HVA, MEMCPY,
                    PAIR_LEVEL, PER_TENSOR, TINY, TORCH, TRANSFORMER)


def resnet_like() -> list[tuple[int, ...]]:
    """161 tensors, about 42M float32 parameters: a few large conv kernels, many small ones."""
    shapes = [(1024, 512, 3, 3)] * 8 + [(512, 512, 3, 3)] * 2      # 42.5M in 10 tensors
    shapes += [(256, 256, 1, 1)] * 3 + [(512, 128, 1, 1)] * 2       # 0.3M
    shapes += [(256,)] * 73 + [(1024,)] * 73                         # biases and norms
    assert len(shapes) == 161
    return shapes


def transformer_like(layers: int = 24, d: int = 256) -> list[tuple[int, ...]]:
    """Hundreds of small tensors: per layer q/k/v/out projections, MLP, two norms."""
    shapes = [(8000, d)]
    for _ in range(layers):
        shapes += [(d, d), (d,)] * 4 + [(4 * d, d), (4 * d,), (d, 4 * d), (d,)] + [(d,), (d,)] * 2
    return shapes


def tiny_mlp() -> list[tuple[int, ...]]:
    return [(128, 64), (128,), (10, 128), (10,)]


SHAPE_SETS = {BIG: resnet_like, TRANSFORMER: transformer_like, TINY: tiny_mlp}


def polled_floor(flat: torch.Tensor, tag: str) -> None:
    """One allreduce of the flat buffer, waited for as the library waits (polled, bounded)."""
    with bounded_collective("floor") as collective:
        collective.wait([hvd.allreduce_async_(flat, op=hvd.Average, name=f"bench.flatp.{tag}")])


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_mib(fn) -> float:
    """Peak resident memory above the current one while ``fn`` runs (Linux: reset VmHWM)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_kib("VmRSS")
    fn()
    return max(0, rss_kib("VmHWM") - before) / 1024


def timed_interleaved(methods: dict, reps: int, tag: str) -> dict:
    """Time every method ``reps`` times, round-robin (one repetition of each method per round),
    so that a slow phase of the machine hits all methods alike rather than one of them."""
    for fn in methods.values():
        fn()  # warm-up: buffers, response cache, first-call checks
    times = {label: [] for label in methods}
    for rep in range(reps):
        for i, (label, fn) in enumerate(methods.items()):
            hvd.barrier()
            start = time.perf_counter()
            fn()
            times[label].append(slowest_rank(time.perf_counter() - start, f"{tag}.{rep}.{i}"))
    return {label: {"min_s": min(t), "median_s": statistics.median(t), "reps": reps}
            for label, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file written by rank 0")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--process-sets", choices=["dynamic", "static"], default="dynamic",
                        help="how the groups of 2 are registered: dynamic (hva.init()) or at start-up "
                             "(hva.init(group_sizes=[2]))")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPE_SETS))
    parser.add_argument("--levels-only", action="store_true",
                        help="time only the hierarchy levels and the floor (dynamic vs static runs)")
    args = parser.parse_args()

    size = int(os.environ.get("HOROVOD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE"))
    pairs = [list(range(i, min(i + 2, size))) for i in range(0, size, 2)] if size > 2 else []
    if args.process_sets == "static" and pairs:
        hva.init(group_sizes=[2])  # the pairs registered at start-up, no dynamic process sets
    else:
        hva.init()
    rank, size = hvd.rank(), hvd.size()
    pair_sets = [hva.process_set(p) for p in pairs]  # registered (dynamic) or found (static)
    local_set = next((s for s, p in zip(pair_sets, pairs) if rank in p), hvd.global_process_set)

    master = hvd.broadcast_object(socket.gethostname() if rank == 0 else None, 0, name="bench.host")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1" if master == socket.gethostname() else master)
    os.environ.setdefault("MASTER_PORT", os.environ.get("BENCH_TORCH_PORT", "29533"))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    controller = "mpi" if hvd.mpi_enabled() else "gloo"

    report = {"controller": controller, "ranks": size, "process_sets": args.process_sets,
              "host": socket.gethostname(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "horovod": horovod.__version__, "shape_sets": {}}
    for set_name in args.shapes:
        shapes = SHAPE_SETS[set_name]()
        params = make_params(shapes, seed=rank)
        numel = sum(p.numel() for p in params)
        nbytes = numel * 4
        tag = set_name.split()[0]
        flat = torch.randn(numel)
        scratch = torch.empty_like(flat)
        torch_params = make_params(shapes, seed=rank)
        per_tensor_params = make_params(shapes, seed=rank)
        grouped_params = make_params(shapes, seed=rank)

        def per_tensor():
            handles = [hvd.allreduce_async_(p.data, op=hvd.Average, name=f"bench.pt.{tag}.{i}")
                       for i, p in enumerate(per_tensor_params)]
            for h in handles:
                hvd.synchronize(h)

        methods = {
            HVA: lambda: hva.average_parameters(params),
            TORCH: lambda: torch_averaging.average_parameters(iter(torch_params), dist.group.WORLD),
            PER_TENSOR: per_tensor,
            GROUPED: lambda: hvd.grouped_allreduce_([p.data for p in grouped_params],
                                                    op=hvd.Average, name=f"bench.grouped.{tag}"),
            FLOOR: lambda: hvd.allreduce_(flat, op=hvd.Average, name=f"bench.flat.{tag}"),
            FLOOR_POLLED: lambda: polled_floor(flat, tag),
            MEMCPY: lambda: scratch.copy_(flat),
        }
        if size > 2:
            methods[PAIR_LEVEL] = lambda: average_tensors(params, local_set)
            methods[GLOBAL_LEVEL] = lambda: average_tensors(params, hvd.global_process_set)
        reps = args.reps if numel > 1_000_000 else args.reps * 4
        if args.levels_only:
            methods = {k: v for k, v in methods.items()
                       if k in (PAIR_LEVEL, GLOBAL_LEVEL, FLOOR, FLOOR_POLLED)}
        results = timed_interleaved(methods, reps, tag)
        memory, non_firing_us = {}, None
        if not args.levels_only:
            # Peak extra memory of one call, after warm-up (the first hva call binds the storage).
            memory = {
                HVA: peak_extra_mib(lambda: hva.average_parameters(params)),
                TORCH: peak_extra_mib(
                    lambda: torch_averaging.average_parameters(iter(torch_params), dist.group.WORLD)),
                FLOOR: peak_extra_mib(
                    lambda: hvd.allreduce_(flat, op=hvd.Average, name=f"bench.flat.{tag}")),
            }
            first_bind = make_params(shapes, seed=rank)
            memory[FIRST_CALL] = peak_extra_mib(
                lambda: hva.average_parameters(first_bind))
            del first_bind

            averager = hva.PeriodicModelAverager(period=1 << 40)
            averager.average_parameters(params)  # step 0 fires; every later call is a non-firing step
            calls = 20000 if numel < 1_000_000 else 5000
            start = time.perf_counter()
            for _ in range(calls):
                averager.average_parameters(params)
            non_firing_us = (time.perf_counter() - start) / calls * 1e6

        report["shape_sets"][set_name] = {
            "tensors": len(shapes), "parameters": numel, "bytes": nbytes, "methods": results,
            "peak_extra_mib": memory, "non_firing_step_us": non_firing_us,
        }
        if rank == 0:
            line = ", ".join(f"{k}: {v['min_s'] * 1e3:.2f} ms" for k, v in results.items())
            print(f"[{controller} np={size} {args.process_sets}] {set_name}: {line}", flush=True)
        del params, torch_params, per_tensor_params, grouped_params, flat, scratch
    dist.destroy_process_group()
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
