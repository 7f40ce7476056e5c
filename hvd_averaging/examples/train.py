"""The main job: synchronous SGD vs. local, post-local, hierarchical SGD and DiLoCo, same budget.

``--task charlm`` (default): a character-level transformer language model on the Python standard
library's source; ``--task digits``: the digits MLP (fast, for tests). Every method gets the same
seed, model, data shards and number of steps. Rank 0 prints progress and a table (final metric,
wall time without evaluation, time to reach synchronous SGD's final held-out loss, global and
local rounds, bytes over the link between nodes counted by the library) and writes
``results.json``, ``results.md`` and the plots (metric against wall time and against global
rounds).

    horovodrun -np 4 python -m hvd_averaging.examples.train --out results/demo
    python tools/run_demo.py      # the same on 2 emulated nodes with a slow link (make demo)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from hvd_averaging.examples.tasks import TASKS

__all__ = ["main", "parse_hierarchy", "METHODS"]

METHODS = ("sync", "local", "postlocal", "hierarchical", "diloco", "hierdiloco")


def parse_hierarchy(text: str) -> dict[int, int]:
    """``"2:2,8:4"`` -> ``{2: 2, 8: 4}`` (period:group size pairs)."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return {int(p): int(s) for p, s in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--hierarchy {text!r}: expected period:size pairs like 2:2,8:4") from None


def build_optimizer(method: str, model, args, task, total_steps: int):
    """The method as one optimizer object: the training loop is the same for all."""
    local = task.inner_optimizer(model.parameters(), args.lr)
    if method == "sync":
        # a warm-up spanning the whole run is synchronous SGD: gradients averaged every step
        return hva.PostLocalSGD(local, model.named_parameters(), start_localSGD_iter=total_steps,
                                averager=hva.PeriodicModelAverager(2, warmup_steps=total_steps))
    if method == "local":
        return hva.PostLocalSGDOptimizer(local, hva.PeriodicModelAverager(args.period))
    if method == "postlocal":
        start = max(1, total_steps * args.warmup_percent // 100)
        return hva.PostLocalSGD(
            local, model.named_parameters(), start_localSGD_iter=start,
            averager=hva.PeriodicModelAverager(args.period, warmup_steps=start),
            local_group_size=args.local_group_size)
    if method == "hierarchical":
        return hva.PostLocalSGDOptimizer(local, hva.HierarchicalModelAverager(args.hierarchy))
    if method == "diloco":
        return hva.DiLoCo(local, hva.PeriodicModelAverager(args.outer_period))
    if method == "hierdiloco":
        return hva.DiLoCo(local, hva.HierarchicalModelAverager(args.outer_hierarchy))
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def label(method: str, args) -> str:
    levels = lambda h: ",".join(f"{p}:{s}" for p, s in h.items())  # noqa: E731
    return {
        "sync": "synchronous SGD",
        "local": f"local SGD (period {args.period})",
        "postlocal": (f"post-local SGD (warm-up {args.warmup_percent}%, period {args.period}, "
                      f"node-local grads in groups of {args.local_group_size})"),
        "hierarchical": f"hierarchical SGD {levels(args.hierarchy)}",
        "diloco": f"DiLoCo (outer step every {args.outer_period})",
        "hierdiloco": f"hierarchical DiLoCo {levels(args.outer_hierarchy)}",
    }[method]


def train(method: str, args, task) -> dict:
    rank, size = hvd.rank(), hvd.size()
    total_steps = args.steps
    model = task.model(args.seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = build_optimizer(method, model, args, task, total_steps)
    batches = task.batches(rank, size, args.seed)
    eval_every = max(1, total_steps // args.evals)
    hva.reset_traffic()
    curve = [(0.0, 0, task.evaluate(model))]  # (seconds without evaluation, global rounds, metric)
    hvd.barrier()
    start = time.perf_counter()
    evaluating = 0.0
    for step in range(total_steps):
        x, y = next(batches)
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()
        if (step + 1) % eval_every == 0 and step + 1 < total_steps:
            began = time.perf_counter()
            metric = task.evaluate(model)  # every rank its own model, so all pay the same
            evaluating += time.perf_counter() - began
            curve.append((time.perf_counter() - start - evaluating,
                          hva.traffic().global_allreduces, metric))
            if rank == 0 and not args.quiet:
                print(f"  {method:<12} step {step + 1:>5}/{total_steps}  rank-0 {task.metric} "
                      f"{metric:.4f}  {curve[-1][0]:6.1f} s  global rounds "
                      f"{hva.traffic().global_allreduces}", flush=True)
    # one final global average so every rank ends with the same model (counted below)
    hva.average_parameters(model.parameters())
    hvd.barrier()
    wall = time.perf_counter() - start - evaluating
    final = task.evaluate(model)
    counted = hva.traffic()
    curve.append((wall, counted.global_allreduces, final))
    agreed = hvd.allgather_object(round(final, 6))
    assert len(set(agreed)) == 1, f"ranks disagree on the final model: {agreed}"
    return {
        "method": method,
        "label": label(method, args),
        "final_metric": final,
        "global_allreduces": counted.global_allreduces,
        "local_allreduces": counted.local_allreduces,
        "bytes_per_rank": counted.bytes,
        "cross_node_bytes_per_rank": counted.cross_node_bytes,
        "wall_s": wall,
        "steps": total_steps,
        "curve": curve,
    }


def time_to_reach(result: dict, target: float, lower_is_better: bool) -> float | None:
    """First wall time (without evaluation) at which the metric reached ``target``."""
    for seconds, _, metric in result["curve"]:
        if (metric <= target) if lower_is_better else (metric >= target):
            return seconds
    return None


def table(results: list[dict], task) -> str:
    base = results[0]
    lower = task.lower_is_better
    # within 2% of synchronous SGD's final metric
    target = base["final_metric"] * (1.02 if lower else 0.98)
    extra = " | perplexity" if lower else ""
    rows = [f"| method | final {task.metric}{extra} | wall s | time to sync's final "
            "(within 2%) | global rounds | local rounds | MB/rank over the link between nodes |",
            "|---|---|---|---|---|---|---|" + ("---|" if lower else "")]
    for r in results:
        reached = time_to_reach(r, target, lower)
        ppl = f" | {task.perplexity(r['final_metric']):.2f}" if lower else ""
        rows.append(
            f"| {r['label']} | {r['final_metric']:.4f}{ppl} | {r['wall_s']:.1f} | "
            f"{'not reached' if reached is None else f'{reached:.1f} s'} | "
            f"{r['global_allreduces']} | {r['local_allreduces']} | "
            f"{r['cross_node_bytes_per_rank'] / 1e6:.1f} |")
    return "\n".join(rows)


def plot(results: list[dict], task, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for index, (name, xlabel) in enumerate((
            ("vs_wall_time", "wall-clock seconds (evaluation excluded)"),
            ("vs_global_rounds", "global communication rounds (allreduces over all ranks)"))):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in results:
            xs = [point[index] for point in r["curve"]]
            ax.plot(xs, [point[2] for point in r["curve"]], marker=".", label=r["label"])
        if index == 1:
            ax.set_xscale("symlog")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{task.metric} (rank 0's model)")
        ax.set_title(f"{task.name}, {hvd.size()} ranks, {results[0]['steps']} steps per method")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{task.metric.replace(' ', '_').replace('-', '_')}_{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path.name)
    return written


def measure_regime(task, args) -> str:
    """One training step's compute against one synchronous gradient allreduce, measured here."""
    model = task.model(args.seed)
    opt = task.inner_optimizer(model.parameters(), args.lr)
    batches = task.batches(hvd.rank(), hvd.size(), args.seed)
    grads = [torch.zeros_like(p) for p in model.parameters()]
    computes, allreduces = [], []
    for i in range(6):
        x, y = next(batches)
        hvd.barrier()
        began = time.perf_counter()
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()
        computes.append(time.perf_counter() - began)
        hvd.barrier()
        began = time.perf_counter()
        hvd.grouped_allreduce_(grads, op=hvd.Average, name="demo.regime")
        allreduces.append(time.perf_counter() - began)
    compute = sorted(computes[1:])[len(computes[1:]) // 2]
    allreduce = sorted(allreduces[1:])[len(allreduces[1:]) // 2]
    slowest = max(hvd.allgather_object((compute, allreduce), name="demo.regime.all"))
    compute, allreduce = slowest
    params = sum(p.numel() for p in model.parameters())
    return (f"{params / 1e3:.0f} k parameters; one training step {compute * 1e3:.0f} ms of compute, "
            f"one synchronous gradient allreduce {allreduce * 1e3:.0f} ms: ratio "
            f"{allreduce / compute:.1f}x (medians of 5, slowest rank)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=tuple(TASKS), default="charlm")
    parser.add_argument("--method", choices=("all",) + METHODS, default="all")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per method (default: charlm 200, digits 20 epochs)")
    parser.add_argument("--period", type=int, default=16, help="local/post-local averaging period")
    parser.add_argument("--hierarchy", type=parse_hierarchy, default=None,
                        help="period:size pairs (default 2:2,16:WORLD)")
    parser.add_argument("--outer-period", type=int, default=16, help="DiLoCo: steps per outer step")
    parser.add_argument("--outer-hierarchy", type=parse_hierarchy, default=None,
                        help="hierarchical DiLoCo period:size pairs (default 2:2,16:WORLD)")
    parser.add_argument("--warmup-percent", type=int, default=10,
                        help="post-local SGD: share of steps with global gradient allreduce")
    parser.add_argument("--local-group-size", type=int, default=2,
                        help="post-local SGD: gradient group size after warm-up (the node)")
    parser.add_argument("--lr", type=float, default=None, help="inner learning rate")
    parser.add_argument("--evals", type=int, default=15, help="evaluations per method")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/demo"))
    parser.add_argument("--fast", action="store_true", help="a short run (for tests)")
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    hva.init()
    torch.set_num_threads(1)  # ranks share the cores
    task = TASKS[args.task]()
    size = hvd.size()
    if args.steps is None:
        args.steps = 200 if args.task == "charlm" else 20 * task.steps_per_epoch(size)
    if args.fast:
        args.steps = 40 if args.task == "charlm" else 2 * task.steps_per_epoch(size)
    args.lr = task.default_lr if args.lr is None else args.lr
    pair = min(2, size)
    args.hierarchy = args.hierarchy or {2: pair, 16: size}
    args.outer_hierarchy = args.outer_hierarchy or {2: pair, 16: size}
    args.local_group_size = min(args.local_group_size, size)
    methods = METHODS if args.method == "all" else ("sync", args.method)
    methods = tuple(dict.fromkeys(methods))  # the baseline always runs first
    regime = measure_regime(task, args)
    if hvd.rank() == 0:
        print(f"{task.describe()}; {size} ranks; {regime}", flush=True)
    results = [train(method, args, task) for method in methods]
    if hvd.rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        md = table(results, task)
        print("\n" + md, flush=True)
        (args.out / "results.md").write_text(f"{task.describe()}; {size} ranks; {regime}\n\n{md}\n")
        (args.out / "results.json").write_text(json.dumps(
            {"task": args.task, "metric": task.metric, "lower_is_better": task.lower_is_better,
             "ranks": size, "steps": args.steps, "lr": args.lr,
             "seed": args.seed, "regime": regime, "results": results}, indent=1))
        plots = plot(results, task, args.out)
        print(f"\nwrote {args.out}/results.md, results.json, {', '.join(plots)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
