"""Eager updates (arXiv 2502.12996) against this library's overlapped DiLoCo, per inner step.

The main job's 4 ranks are simulated in one process: the same task, model, starting point,
batches per rank, inner AdamW and outer Nesterov step with its momentum warmed up (the race's
defaults), so what differs between the variants is the outer step alone, measured in held-out
loss of the ranks' averaged model against inner steps, without a link or a host's speed. The
schedule is the averagers': a round fires after the inner step whose counter ``c`` (from 0) is a
multiple of ``H``, and a round left in flight for ``d`` steps is applied after step ``c + d``,
before any round that fires there.

- ``blocking``: DiLoCo's outer step at every firing (``delay=0``).
- ``delay-half``: ``hva.DiLoCo`` with ``delay=H/2``, the race's: the outer step takes the
  average progress of the snapshot, and each rank keeps its own progress made since it.
- ``delay-whole``: the same with the round applied a whole phase later (``delay=H``, which the
  library refuses: a round must land before the next one at its level starts).
- ``eager-whole``: Eager updates with ``delay=H``: each rank keeps its own global copy and outer
  optimizer; its outer step takes the average that has arrived (one phase stale) with its own
  stale share replaced by its fresh pseudo-gradient, and the rank restarts from its copy.

- ``allreduce``: the race's baseline, ``hvd.DistributedOptimizer``: one model stepped on the
  mean of the ranks' batch gradients at every step (no outer step). Beside it, the steps a local
  method needs for the baseline's loss at a given step say what a local step is worth, with no
  host's speed in the way; ``--inner-lr`` tries another inner learning rate for every variant.

``--race RESULTS`` also compares ``delay-half`` with the real 4-rank run of ``diloco`` in a race's
``results.json`` (the same seed), at the steps of that run's curve::

    python bench/eager_sim.py --seeds 0,1,2 --steps 384 --out results/eager_sim.json \\
        --race results/full-3seeds/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable, Optional

import torch

import hvd_averaging as hva
from hvd_averaging.examples.race_rules import time_to_reach
from hvd_averaging.examples.tasks import CharLMTask

__all__ = ["VARIANTS", "simulate"]

VARIANTS = ("blocking", "delay-half", "delay-whole", "eager-whole", "allreduce")


def _outer(params: list, lr: float, momentum: float, warmup: int):
    outer = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)
    return outer, hva.OuterMomentumWarmup(outer, warmup)


def _outer_step(outer, schedule, params: list, grads: list) -> None:
    for param, grad in zip(params, grads):
        param.grad = grad
    outer.step()
    schedule.step()
    for param in params:
        param.grad = None


def _vectors(models: list) -> list[torch.Tensor]:
    return [torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone() for m in models]


def _set(model: torch.nn.Module, vector: torch.Tensor) -> None:
    torch.nn.utils.vector_to_parameters(vector, model.parameters())


def _gradient_allreduce(task: CharLMTask, seed: int, ranks: int, steps: int, lr: float,
                        eval_at: Callable[[int], bool]) -> list:
    """The baseline: every step on the mean of the ranks' batch gradients (the gradient of
    their mean loss), as Horovod's allreduce of gradients gives every rank."""
    model = task.model(seed)
    optimizer = task.inner_optimizer(model.parameters(), lr)
    batches = [task.batches(rank, ranks, seed) for rank in range(ranks)]
    curve = []
    for counter in range(steps):
        optimizer.zero_grad()
        (sum(task.loss(model, *next(feed)) for feed in batches) / ranks).backward()
        optimizer.step()
        if eval_at(counter + 1):
            with torch.no_grad():
                curve.append((counter + 1, task.evaluate(model)))
    return curve


def simulate(variant: str, task: CharLMTask, seed: int, ranks: int, steps: int, period: int,
             outer_lr: float, momentum: float, warmup: int, eval_at: Callable[[int], bool],
             inner_lr: Optional[float] = None) -> list:
    """``[(steps taken, held-out loss of the ranks' average)]`` at the steps ``eval_at`` picks;
    ``inner_lr`` defaults to the task's (the race's)."""
    lr = task.default_lr if inner_lr is None else inner_lr
    if variant == "allreduce":
        return _gradient_allreduce(task, seed, ranks, steps, lr, eval_at)
    with torch.no_grad():
        return _local_steps(variant, task, seed, ranks, steps, period, outer_lr, momentum, warmup,
                            eval_at, lr)


def _local_steps(variant: str, task: CharLMTask, seed: int, ranks: int, steps: int, period: int,
                 outer_lr: float, momentum: float, warmup: int, eval_at: Callable[[int], bool],
                 lr: float) -> list:
    models = [task.model(seed) for _ in range(ranks)]
    inner = [task.inner_optimizer(m.parameters(), lr) for m in models]
    batches = [task.batches(rank, ranks, seed) for rank in range(ranks)]
    start = _vectors(models[:1])[0]
    copies = 1 if variant != "eager-whole" else ranks  # global copies: one, or one per rank
    globals_ = [start.clone() for _ in range(copies)]
    outers = [_outer([g], outer_lr, momentum, warmup) for g in globals_]
    delay = {"blocking": 0, "delay-half": period // 2}.get(variant, period)
    in_flight: Optional[tuple[int, torch.Tensor, list]] = None  # (apply after, average, snapshots)
    # eager: the average of the round sent a phase ago, and each rank's own share of it
    arrived: Optional[torch.Tensor] = None
    own_sent: Optional[list] = None
    eval_model, curve = task.model(seed), []
    for counter in range(steps):
        for model, opt, feed in zip(models, inner, batches):
            x, y = next(feed)
            with torch.enable_grad():
                opt.zero_grad()
                task.loss(model, x, y).backward()
            opt.step()
        params = _vectors(models)
        fires = counter % period == 0
        if in_flight and counter >= in_flight[0]:
            _, progress, snapshots = in_flight
            _outer_step(*outers[0], globals_, [-progress])
            for model, now, snapshot in zip(models, params, snapshots):
                _set(model, globals_[0] + (now - snapshot))
            in_flight, params = None, _vectors(models)
        if fires and variant != "eager-whole":
            progress = torch.stack([p - globals_[0] for p in params]).mean(0)
            if delay:
                in_flight = (counter + delay, progress, params)
            else:
                _outer_step(*outers[0], globals_, [-progress])
                for model in models:
                    _set(model, globals_[0])
        elif fires:  # eager-whole: the round sent a phase ago has landed by now
            fresh = [g - p for g, p in zip(globals_, params)]  # pseudo-gradient per rank
            for rank, model in enumerate(models):
                if arrived is None:  # nothing has arrived yet: the rank's own share alone
                    grad = fresh[rank] / ranks
                else:
                    grad = arrived + (fresh[rank] - own_sent[rank]) / ranks
                outer, schedule = outers[rank]
                _outer_step(outer, schedule, [globals_[rank]], [grad])
                _set(model, globals_[rank])
            arrived, own_sent = torch.stack(fresh).mean(0), fresh
        if eval_at(counter + 1):
            _set(eval_model, torch.stack(_vectors(models)).mean(0))
            curve.append((counter + 1, task.evaluate(eval_model)))
    return curve


def _against_the_baseline(runs: list, variants: list, marks: list, every: int) -> None:
    """Per variant: the steps to the baseline's held-out loss after ``n`` steps (its own seed's),
    over ``n``: how many local steps one baseline step is worth, mean (min-max) over seeds."""
    print("\nsteps to the baseline's loss after n of its steps, over n (mean, min-max over seeds):")
    print("| variant | " + " | ".join(f"n = {n}" for n in marks) + " |")
    print("|---|" + "---|" * len(marks))
    for variant in variants:
        cells = []
        for n in marks:
            ratios = []
            for base in (r for r in runs if r["variant"] == "allreduce"):
                target = dict(map(tuple, base["curve"]))[n]
                curve = next(r["curve"] for r in runs
                             if r["variant"] == variant and r["seed"] == base["seed"])
                reached = time_to_reach([p for p in curve if p[0] % every == 0 or p[0] == n],
                                        target)
                ratios.append(None if reached is None else reached / n)
            cells.append("not reached" if None in ratios else
                         f"{statistics.fmean(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"| {variant} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=384)
    parser.add_argument("--period", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--inner-lr", type=float, default=None,
                        help="every variant's inner learning rate (default: the race's)")
    parser.add_argument("--outer-lr", type=float, default=0.5)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--outer-momentum-warmup", type=int, default=8)
    parser.add_argument("--every", type=int, default=8, help="evaluate every this many steps")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--race", type=Path, help="a race's results.json to compare delay-half with")
    parser.add_argument("--baseline-steps", default="60,90",
                        help="with allreduce: each variant's steps to the baseline's loss after "
                             "this many steps, over them")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = CharLMTask()
    seeds = [int(s) for s in args.seeds.split(",")]
    marks = [int(n) for n in args.baseline_steps.split(",")]
    race_steps = {}
    if args.race:  # the real run's evaluation points, per seed
        race = json.loads(args.race.read_text())
        diloco = next(m for m in race["methods"] if m["method"] == "diloco")
        race_steps = {s["seed"]: {int(p[1]): p[-1] for p in s["curve"]} for s in diloco["seeds"]}
    results = {"settings": vars(args) | {"out": str(args.out), "race": str(args.race)}, "runs": []}
    for seed in seeds:
        real = race_steps.get(seed, {})
        for variant in args.variants.split(","):
            curve = simulate(variant, task, seed, args.ranks, args.steps, args.period,
                             args.outer_lr, args.outer_momentum, args.outer_momentum_warmup,
                             lambda n: n % args.every == 0 or (variant == "delay-half" and n in real)
                             or (variant == "allreduce" and n in marks),
                             args.inner_lr)
            results["runs"].append({"seed": seed, "variant": variant, "curve": curve})
            print(f"seed {seed} {variant:12s} loss at " + ", ".join(
                f"{n}: {loss:.4f}" for n, loss in curve if n % (4 * args.every) == 0), flush=True)
            if variant == "delay-half" and real:
                pairs = [(n, loss, real[n]) for n, loss in curve if n in real]
                gaps = [abs(a - b) for _, a, b in pairs]
                print(f"  against the real 4-rank run at {len(pairs)} of its points: largest gap "
                      f"{max(gaps):.4f}, first 5: " + ", ".join(
                          f"step {n} {a:.4f}/{b:.4f}" for n, a, b in pairs[:5]), flush=True)
    targets = [2.4, 2.3, 2.2, 2.1, 2.0]
    print("\nsteps to a held-out loss, mean over seeds (between the evaluations around it):")
    print("| variant | " + " | ".join(str(t) for t in targets) + " | loss at the last step |")
    print("|---|" + "---|" * (len(targets) + 1))
    for variant in args.variants.split(","):
        runs = [r["curve"] for r in results["runs"] if r["variant"] == variant]
        cells = []
        for target in targets:
            # steps where each curve first reaches it, between the evaluations around it
            reached = [time_to_reach([p for p in c if p[0] % args.every == 0], target) for c in runs]
            cells.append("-" if None in reached else f"{statistics.fmean(reached):.0f}")
        last = statistics.fmean(c[-1][1] for c in runs)
        print(f"| {variant} | " + " | ".join(cells) + f" | {last:.4f} |")
    if "allreduce" in args.variants.split(","):
        _against_the_baseline(results["runs"], args.variants.split(","), marks, args.every)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
