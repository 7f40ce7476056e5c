"""The race's regime, measured on the machine it runs on: one training step's compute and the
baseline's gradient allreduce across the link, the link rate moved (with ``tools/run_demo.py``)
until the allreduce costs 4-5x a step, and the way the averaging crosses the link chosen before
the race starts (the library times it at a set's first round of a size: not inside a method's
budget)."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from hvd_averaging.deadlines import blocking_call
from hvd_averaging.examples.collectives import allgather_rows, barrier
from hvd_averaging.rounds import average_tensors

__all__ = ["TARGET_RATIO", "measure_regime", "calibrate", "check_link_fits_timeout"]

TARGET_RATIO = (4.0, 5.0)  # the baseline's allreduce across the link against a step's compute


def measure_regime(task, args, repeats: int = 5) -> tuple[float, float]:
    """One training step's compute and one gradient allreduce as the baseline sends it (fp16
    when ``--baseline-fp16``), medians of ``repeats`` after a warm-up, slowest rank."""
    model = task.model(args.seed)
    opt = task.inner_optimizer(model.parameters(), args.lr)
    batches = task.batches(hvd.rank(), hvd.size(), args.seed)
    dtype = torch.float16 if args.baseline_fp16 else torch.float32
    grads = [torch.zeros_like(p, dtype=dtype) for p in model.parameters()]
    computes, allreduces = [], []
    for _ in range(repeats + 1):
        x, y = next(batches)
        barrier("calibration: before a step")
        began = time.perf_counter()
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()
        computes.append(time.perf_counter() - began)
        barrier("calibration: before the allreduce")
        began = time.perf_counter()
        with blocking_call("calibration: the baseline's gradient allreduce"):
            hvd.grouped_allreduce_(grads, op=hvd.Average, name="demo.regime")
        allreduces.append(time.perf_counter() - began)
    mine = (statistics.median(computes[1:]), statistics.median(allreduces[1:]))
    measured = allgather_rows(mine, "demo.regime.all", "the calibration's timings")
    return max(c for c, _ in measured), max(a for _, a in measured)


def _request_rate(args, rate_mbit: float, attempt: int) -> None:
    """Ask tools/run_demo.py to set the link rate, and wait for it: the request and the answer
    are files in the ``--rate-control`` folder (``rate-request-N`` holding the rate, then
    ``rate-set-N``), so no launcher's output format is involved (MPI and Gloo alike)."""
    if hvd.rank() == 0:
        folder = Path(args.rate_control)
        done = folder / f"rate-set-{attempt}"
        (folder / f"rate-request-{attempt}.partial").write_text(f"{rate_mbit:.4f}\n")
        os.replace(folder / f"rate-request-{attempt}.partial", folder / f"rate-request-{attempt}")
        deadline = time.monotonic() + 60
        while not done.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the demo's launcher did not set the link rate ({done} missing)")
            time.sleep(0.1)
    barrier("the launcher set the link rate")


def calibrate(task, args) -> dict:
    """Measure the regime; with ``--rate-control``, move the link rate until the baseline's
    allreduce costs 4-5x a step's compute (a = overhead + k / rate, fitted on the last two)."""
    rate, points = args.rate_mbit, []
    attempts = 5
    for attempt in range(attempts):
        compute, allreduce = measure_regime(task, args)
        points.append({"rate_mbit": rate, "compute_step_s": compute, "allreduce_s": allreduce})
        ratio = allreduce / compute
        if hvd.rank() == 0 and not args.quiet:
            where = f"{rate:.2f} Mbit/s" if rate else "an unlimited link"
            print(f"  regime at {where}: step {compute * 1e3:.0f} ms "
                  f"of compute, allreduce {allreduce * 1e3:.0f} ms: {ratio:.1f}x", flush=True)
        # the last attempt keeps its rate: the race runs at a rate that was measured
        if args.rate_control is None or rate is None or attempt == attempts - 1 \
                or TARGET_RATIO[0] <= ratio <= TARGET_RATIO[1]:
            break
        want = compute * sum(TARGET_RATIO) / 2
        new_rate = rate * ratio / (sum(TARGET_RATIO) / 2)
        if len(points) >= 2 and points[-2]["rate_mbit"] != rate:
            (r0, a0), (r1, a1) = ((p["rate_mbit"], p["allreduce_s"]) for p in points[-2:])
            slope = (a0 - a1) / (1 / r0 - 1 / r1)
            overhead = a1 - slope / r1
            if slope > 0 and want > overhead:
                new_rate = slope / (want - overhead)
        rate = min(max(new_rate, 0.5), 10_000.0)
        _request_rate(args, rate, attempt)
    compute, allreduce = points[-1]["compute_step_s"], points[-1]["allreduce_s"]
    return {"compute_step_s": compute, "allreduce_s": allreduce, "ratio": allreduce / compute,
            "rate_mbit": rate, "calibrated": args.rate_control is not None and len(points) > 1,
            "target_ratio": list(TARGET_RATIO), "attempts": points, "routes": choose_route(task, args)}


def choose_route(task, args) -> dict:
    """One average of a model's copy over all ranks: where the set can cross the link
    node-aware, the library measures which way is faster now (``HVA_ROUTE``), so that no method
    pays for it in its budget. Returns ``hva.traffic().routes`` (empty where there was no
    choice to make)."""
    hva.reset_traffic()
    copy = [p.detach().clone() for p in task.model(args.seed).parameters()]
    average_tensors(copy, bind=False, name="demo.route", context="choosing the route")
    chosen = hva.traffic().routes
    if hvd.rank() == 0 and not args.quiet:
        for where, how in chosen.items():
            print(f"  the way across the link for {where}: {how}", flush=True)
    return chosen


def check_link_fits_timeout(regime: dict, args) -> None:
    """A model average across this link must fit the library's timeout (with room to spare)."""
    model_average_s = regime["allreduce_s"] * (2 if args.baseline_fp16 else 1)
    if model_average_s > hva.timeout() / 2:
        raise ValueError(
            f"link rate {regime['rate_mbit']} Mbit/s: one model average takes about "
            f"{model_average_s:.1f} s, more than half the averaging timeout ({hva.timeout():g} s); "
            "raise --rate-mbit or HVA_TIMEOUT_SECONDS")
