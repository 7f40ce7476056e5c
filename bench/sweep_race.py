"""The race's hyper-parameters from a sweep: inner learning rate for every method (the baseline
included), the period H, DiLoCo's outer learning rate and momentum. Not part of ``make demo``.

Every configuration is one launch of ``hvd_averaging.examples.train`` on 2 emulated nodes x 2
ranks at one fixed link rate (``--rate-mbit``, e.g. the rate ``make demo`` calibrated, in its
results.json). Phase 1 races every method at each inner learning rate (the baseline sets the
budget); phases 2 and 3 give the local methods the phase's mean budget (``--budget-s``). Writes
``sweep.json`` and ``sweep.md`` (held-out loss at the budget per configuration) to ``--out``.

    python bench/sweep_race.py --rate-mbit 10.6 --out results/sweep
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from cluster import Cluster  # noqa: E402
from rank_output import launch_env  # noqa: E402

BIN = Path(sys.executable).parent


def race(cluster: Cluster, rate: float, out: Path, extra: list[str]) -> dict:
    """One launch of the race with ``extra`` arguments; its results.json."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [str(BIN / "horovodrun"), "--mpi", "-np", "4", "-H", cluster.hosts_arg(2),
            "--network-interface", "eth0", str(BIN / "python"), "-u", "-m",
            "hvd_averaging.examples.train", "--quiet", "--rate-mbit", str(rate),
            "--link-interface", "eth0", "--out", str(out), *extra]
    began = time.monotonic()
    proc = cluster.start(argv, env=launch_env(), cwd=str(ROOT))
    output = proc.stdout.read()
    if proc.wait() != 0:
        print(output[-4000:], flush=True)
        raise SystemExit(f"sweep: {' '.join(extra)} failed")
    print(f"  {' '.join(extra)}: {time.monotonic() - began:.0f} s", flush=True)
    return json.loads((out / "results.json").read_text())


def configurations(lrs, periods, outer) -> list[tuple[str, int, list[str]]]:
    """(name, phase, extra arguments) in order."""
    configs = [(f"lr {lr:g}", 1, ["--lr", str(lr)]) for lr in lrs]
    configs += [(f"H {h}", 2, ["--methods", "local,hierarchical,diloco,hierdiloco", "--period",
                               str(h), "--outer-period", str(h), "--outer-delay", str(h // 2)])
                for h in periods]
    configs += [(f"outer lr {lr:g} momentum {m:g}", 3,
                 ["--methods", "diloco,hierdiloco", "--outer-lr", str(lr), "--outer-momentum", str(m)])
                for lr, m in outer]
    return configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, required=True)
    parser.add_argument("--lrs", default="0.0015,0.003,0.006")
    parser.add_argument("--periods", default="8,32", help="H for phase 2 (16 is phase 1's)")
    parser.add_argument("--outer", default="0.5:0.9,1.0:0.9,0.7:0.0",
                        help="outer lr:momentum pairs for phase 3 (0.7:0.9 is phase 1's)")
    parser.add_argument("--target-budget-s", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=Path("results/sweep"))
    parser.add_argument("--reuse", action="store_true",
                        help="take configurations with a results.json in --out as done")
    args = parser.parse_args()
    os.chdir(ROOT)
    lrs = [float(x) for x in args.lrs.split(",")]
    configs = configurations(lrs, [int(x) for x in args.periods.split(",")],
                             [tuple(float(v) for v in pair.split(":")) for pair in args.outer.split(",")])
    rows, budgets = [], []
    with Cluster(2, args.rate_mbit) as cluster:
        for index, (name, phase, extra) in enumerate(configs):
            extra = [*extra, "--target-budget-s", str(args.target_budget_s)]
            if phase > 1:
                # later phases: phase 1's budget, at its best inner learning rate
                extra += ["--budget-s", f"{statistics.fmean(budgets):.2f}", "--lr", str(best_lr)]
            done = args.out / f"config{index}" / "results.json"
            if args.reuse and done.exists():  # a configuration a previous sweep finished
                result = json.loads(done.read_text())
            else:
                result = race(cluster, args.rate_mbit, args.out / f"config{index}", extra)
            if phase == 1:
                budgets.append(result["budget_s"])
            for m in result["methods"]:
                rows.append({"config": name, "phase": phase, "method": m["method"],
                             "label": m["label"], "final_loss": m["final_loss"], "steps": m["steps"],
                             "budget_s": result["budget_s"], "speedup": m["speedup_vs_baseline"]})
            if phase == 1 and index == len(lrs) - 1:
                # the inner lr where the averaging methods do best on average
                by_lr = {}
                for row in rows:
                    if row["method"] != "baseline":
                        by_lr.setdefault(row["config"], []).append(row["final_loss"])
                best = min(by_lr, key=lambda c: statistics.fmean(by_lr[c]))
                best_lr = lrs[list(by_lr).index(best)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps({"rate_mbit": args.rate_mbit, "rows": rows}, indent=1))
    lines = [f"Link {args.rate_mbit} Mbit/s, 2 emulated nodes x 2 ranks, one seed; held-out loss "
             "at the budget (lower is better)", "",
             "| configuration | method | held-out loss | steps | budget s | speed-up to baseline's final |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        lines.append(f"| {row['config']} | {row['label']} | {row['final_loss']:.4f} | "
                     f"{row['steps']:.0f} | {row['budget_s']:.1f} | {speedup} |")
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
