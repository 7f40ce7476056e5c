"""The main job: a time-to-quality race on the link between nodes.

The baseline is what a Horovod user runs today, ``hvd.DistributedOptimizer``; it trains a fixed
number of steps and its wall time (evaluation excluded) is the budget. Every other method trains
as many steps as fit in that budget. The model each method would hand a user (the average over
ranks, for every method) is evaluated on one shared wall-clock grid; the target is the
baseline's final held-out loss. Rank 0 prints progress, a table and writes ``results.json``,
``results.md`` and two plots (held-out loss against wall time and against MB across the link).

    horovodrun -np 4 python -m hvd_averaging.examples.train --out results/demo
    python tools/run_demo.py      # on 2 emulated nodes, the link rate calibrated (make demo)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from hvd_averaging.deadlines import blocking_call
from hvd_averaging.examples.calibration import calibrate, check_link_fits_timeout
from hvd_averaging.examples.collectives import allgather_rows, barrier
from hvd_averaging.examples.methods import (DEFAULT_METHODS, build_trainer, check_race_args,
                                            label, parse_hierarchy, parse_methods)
from hvd_averaging.examples.race import RaceLimits, evaluate_snapshots, run_method, shared_folder
from hvd_averaging.examples.race_rules import grid_times, pick_on_grid, speedup_at, time_to_reach
from hvd_averaging.examples.report import plot, speedup_ceiling, summarize, table
from hvd_averaging.examples.settings import RaceSettings
from hvd_averaging.examples.tasks import TASKS
from hvd_averaging.wire import WIRE_FORMATS

__all__ = ["main", "parse_args", "race_one_seed", "EARLY_S"]

EARLY_S = 60.0  # a long race also reports the speed-up after the first minute ("speedup_at_60s")

def race_one_seed(seed: int, args, task, baseline_steps: int, snapshots_dir) -> tuple[float, list[dict]]:
    """Every method once with this seed; returns (budget in seconds, per-method results, rank 0
    only: the others get empty dicts)."""
    budget, results, target, baseline_curve = args.budget_s, [], None, None
    eval_model = task.model(seed)
    for method in args.methods:
        model = task.model(seed)
        with blocking_call(f"{method}: the starting model from rank 0"):
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        warmup = max(1, baseline_steps * args.warmup_percent // 100)
        trainer = build_trainer(method, model, task, args, warmup_steps=warmup)
        by_steps = method == "baseline" and args.budget_s is None
        limits = RaceLimits(budget_s=None if by_steps else budget,
                            steps=baseline_steps if by_steps else None,
                            grid_points=args.grid_points, label=method)
        hva.reset_traffic()
        run = run_method(trainer, task.batches(hvd.rank(), hvd.size(), seed), limits,
                         link_interface=args.link_interface, quiet=args.quiet,
                         name=f"race.{seed}.{method}")
        stages = run.stage_seconds()
        # the ways across the link chosen during this method's run (a wire format's first
        # round measures its own; a choice made earlier in the job is reused, not listed again)
        routes = hva.traffic().routes
        walls = allgather_rows((run.wall_s, run.compute_s / run.wall_s,
                                run.communication_s / run.wall_s, run.compute_s / max(1, run.steps),
                                *stages.values()),
                               f"race.{seed}.{method}.wall", f"{method}: every rank's wall time")
        wall = max(w[0] for w in walls)
        budget = wall if budget is None else budget
        points = pick_on_grid(run.snapshots, grid_times(budget, args.grid_points), run.final)
        folder = snapshots_dir / f"seed{seed}-{method}" if snapshots_dir else None
        curve = evaluate_snapshots(points, eval_model, task.evaluate, folder,
                                   f"race.{seed}.{method}.eval")
        if hvd.rank() != 0:
            results.append({})
            continue
        final = curve[-1][-1]
        target = final if method == "baseline" and target is None else target
        baseline_curve = curve if method == "baseline" else baseline_curve
        # a long race: would the speed-up seen after one minute have held to the end?
        early = (speedup_at(baseline_curve, curve, EARLY_S, task.lower_is_better)
                 if baseline_curve is not None and budget >= 2 * EARLY_S else None)
        reached = time_to_reach(curve, target, task.lower_is_better) if target is not None else None
        results.append({
            "seed": seed, "final_loss": final, "steps": run.steps, "wall_s": wall,
            "time_to_target_s": reached,
            "speedup_vs_baseline": budget / reached if reached else None,
            "speedup_at_60s": early,
            "compute_utilization": statistics.fmean(w[1] for w in walls),
            # the rest of the wall time: waiting for or running communication, then the race's
            # own bookkeeping (the stop agreement, reading the loss)
            "communication_share": statistics.fmean(w[2] for w in walls),
            # seconds of compute per step in this run (rank mean): the host's speed while the
            # method ran, beside the calibration's step (a shared host's speed drifts)
            "compute_step_s": statistics.fmean(w[3] for w in walls),
            # per stage, from the library's counters: its share of the wall time (rank mean)
            "stage_shares": {stage: statistics.fmean(w[4 + i] / w[0] for w in walls)
                             for i, stage in enumerate(stages)},
            "cross_node_mb_per_rank": curve[-1][2], "target_loss": target, "budget_s": budget,
            "routes_chosen": routes, "curve": curve})
        if not args.quiet:
            for where, how in routes.items():
                print(f"  {method}: the way across the link for {where}: {how}", flush=True)
            print(f"  {method:<12} done: {run.steps} steps, {wall:.1f} s, {task.metric} {final:.4f}"
                  f"{'' if reached is None else f', target reached at {reached:.1f} s'}", flush=True)
    return budget, results


def parse_args(argv=None) -> RaceSettings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=tuple(TASKS), default="charlm")
    parser.add_argument("--methods", type=parse_methods, default=DEFAULT_METHODS,
                        help=f"comma-separated (default {','.join(DEFAULT_METHODS)})")
    parser.add_argument("--steps", type=int, default=None,
                        help="the baseline's steps (default: what fits in --target-budget-s)")
    parser.add_argument("--target-budget-s", type=float, default=70.0,
                        help="aim for a budget this long, from the measured regime")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="every method's budget, the baseline's too (default: the baseline's wall)")
    parser.add_argument("--period", type=int, default=16, help="local SGD's averaging period")
    parser.add_argument("--delay", type=int, default=8,
                        help="the overlapped local and hierarchical SGD's overlap (steps)")
    parser.add_argument("--node-delay", type=int, default=1,
                        help="the overlapped hierarchical methods' lower levels (inside a node) "
                             "overlap this many steps too (0: blocking; default 1, measured "
                             "in docs/demo.md)")
    parser.add_argument("--hierarchy", type=parse_hierarchy, default=None,
                        help="hierarchical SGD's period:size pairs (default 4:2,16:WORLD: node "
                             "rounds every 4 steps where 4 divides --period, else 2)")
    parser.add_argument("--outer-period", type=int, default=16, help="DiLoCo's H")
    parser.add_argument("--outer-hierarchy", type=parse_hierarchy, default=None,
                        help="hierarchical DiLoCo's period:size pairs (default 4:2,H:WORLD, "
                             "as --hierarchy)")
    parser.add_argument("--outer-delay", type=int, default=8,
                        help="inner steps the outer round overlaps (0: synchronous DiLoCo)")
    parser.add_argument("--outer-lr", type=float, default=0.5,
                        help="DiLoCo's outer lr (0.5 with Nesterov 0.9: the sweep, docs/demo.md)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov when > 0")
    parser.add_argument("--outer-momentum-warmup", type=int, default=8,
                        help="outer steps over which a nonzero outer momentum rises from 0 "
                             "(hva.OuterMomentumWarmup; 0: none; 8: the A/B in docs/demo.md)")
    parser.add_argument("--warmup-percent", type=int, default=10,
                        help="post-local SGD: the share of the baseline's steps with gradient allreduce")
    parser.add_argument("--local-group-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=None, help="inner learning rate, every method")
    parser.add_argument("--baseline-fp16", action="store_true",
                        help="the baseline sends float16 gradients (hvd.Compression.fp16)")
    parser.add_argument("--cross-node-compression", choices=WIRE_FORMATS.names,
                        default="none", help="what the averaging methods' top level (the one "
                        "that crosses the link) sends: compression= of the library")
    parser.add_argument("--error-feedback", action="store_true",
                        help="int8's error feedback on that level")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds 0..N-1 (default 1; 3 with --full or --long)")
    parser.add_argument("--full", action="store_true", help="3 seeds")
    parser.add_argument("--long", action="store_true",
                        help="3 seeds, the baseline about 5 minutes (--target-budget-s 300)")
    parser.add_argument("--grid-points", type=int, default=40, help="evaluations per method")
    parser.add_argument("--rate-mbit", type=float, default=None, help="the link rate now (run_demo)")
    parser.add_argument("--rate-control", default=None,
                        help="folder for the rate handshake with tools/run_demo.py (calibration)")
    parser.add_argument("--link-interface", default=None,
                        help="count bytes sent by this interface (the emulated node's link)")
    parser.add_argument("--seed", type=int, default=0, help="the regime measurement's seed")
    parser.add_argument("--out", type=Path, default=Path("results/demo"))
    parser.add_argument("--fast", action="store_true", help="a short race (for tests)")
    parser.add_argument("--quiet", action="store_true")
    settings = RaceSettings.from_args(parser.parse_args(argv))
    check_race_args(settings)
    return settings


def main(argv=None) -> int:
    args = parse_args(argv)
    hva.init()
    torch.set_num_threads(1)  # ranks share the cores
    task = TASKS[args.task]()
    size = hvd.size()
    args = args.for_world(task.default_lr, size)
    regime = calibrate(task, args)
    check_link_fits_timeout(regime, args)
    baseline_steps = args.steps or max(4, round(
        args.target_budget_s / (regime["compute_step_s"] + regime["allreduce_s"])))
    link = f"{regime['rate_mbit']:.2f} Mbit/s" if regime["rate_mbit"] else "not limited"
    if hvd.rank() == 0:
        print(f"{task.describe()}; {size} ranks; link {link}: one step "
              f"{regime['compute_step_s'] * 1e3:.0f} ms of compute, the baseline's allreduce "
              f"{regime['allreduce_s'] * 1e3:.0f} ms ({regime['ratio']:.1f}x); baseline "
              f"{baseline_steps} steps, every other method the same wall time", flush=True)
    snapshots_dir = args.out / ".snapshots" if shared_folder(args.out) else None
    per_method = {m: [] for m in args.methods}
    budgets = []
    for seed in range(args.seeds):
        budget, results = race_one_seed(seed, args, task, baseline_steps, snapshots_dir)
        budgets.append(budget)
        for method, result in zip(args.methods, results):
            per_method[method].append(result)
    barrier("the race is over")
    if hvd.rank() == 0 and snapshots_dir is not None:
        shutil.rmtree(snapshots_dir, ignore_errors=True)  # emptied rank by rank: only folders left
    if hvd.rank() == 0:
        ceiling = speedup_ceiling(per_method.get("baseline"), regime["compute_step_s"])
        methods = [summarize(m, label(m, args), seeds, ceiling, per_method.get("baseline"))
                   for m, seeds in per_method.items()]
        targets = [s["target_loss"] for s in methods[0]["seeds"]]
        target = statistics.fmean(targets) if None not in targets else None
        md = table(methods, task.metric)
        header = (f"{task.describe()}; {size} ranks; {args.seeds} seed(s); link "
                  f"{link}: step {regime['compute_step_s'] * 1e3:.0f} ms, "
                  f"baseline allreduce {regime['allreduce_s'] * 1e3:.0f} ms ({regime['ratio']:.1f}x); "
                  f"budget {statistics.fmean(budgets):.1f} s; target "
                  f"{'none (no baseline)' if target is None else f'{task.metric} {target:.4f}'}"
                  + ("" if ceiling is None else f"; speed-up ceiling {ceiling:.2f}x (the "
                     "baseline's step over a step of pure compute)"))
        print("\n" + header + "\n\n" + md, flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(header + "\n\n" + md + "\n")
        settings = args.as_json()
        (args.out / "results.json").write_text(json.dumps({
            "task": args.task, "metric": task.metric, "lower_is_better": task.lower_is_better,
            "ranks": size, "baseline_steps": baseline_steps, "target_loss": target,
            "target_loss_per_seed": targets, "budget_s": statistics.fmean(budgets),
            "budget_s_per_seed": budgets, "regime": regime, "speedup_ceiling": ceiling,
            "settings": settings,
            "methods": methods}, indent=1))
        title = (f"{task.name}, {size} ranks, link {link} "
                 f"(allreduce {regime['ratio']:.1f}x a step), {args.seeds} seed(s)"
                 + ("" if ceiling is None else f"; speed-up ceiling {ceiling:.2f}x"))
        plots = plot(methods, target, statistics.fmean(budgets), task.metric, title, args.out)
        print(f"\nwrote {args.out}/results.md, results.json, {', '.join(plots)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
