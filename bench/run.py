"""``make bench``: launch bench_averaging.py for each transport and rank count, then write
``results/bench/bench.md`` (tables, target checks) and ``results/bench/bench.png``.

The 2- and 4-rank runs of one controller run back to back on this machine. Then, per
controller, short 4-rank launches that time only the hierarchy levels alternate between groups
registered dynamically (``hva.init()``) and at start-up (``hva.init(group_sizes=[2])``, no
dynamic process sets), to compare the levels' allreduces; alternating launches keep a slow
phase of the machine from landing on one mode only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HVA = "hva.average_parameters"
TORCH = "PyTorch utils.average_parameters (Gloo)"
FLOOR = "floor: one allreduce_ of a flat buffer"
FLOOR_POLLED = "floor, polled wait (as hva waits)"
GLOBAL_LEVEL = "hva level: all ranks"
PAIR_LEVEL = "hva level: groups of 2"
BIG = "resnet-like 161 tensors"
TINY = "tiny MLP"
RUNS = [("mpi", 2, "dynamic"), ("mpi", 4, "dynamic"), ("gloo", 2, "dynamic"), ("gloo", 4, "dynamic")]
LEVEL_ROUNDS = 3  # static/dynamic launch pairs per controller


def launch(controller: str, np: int, sets: str, out: Path, reps: int, port: int,
           extra: tuple[str, ...] = ()) -> None:
    env = dict(os.environ, BENCH_TORCH_PORT=str(port))
    for key in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
                "OMPI_MCA_rmaps_base_oversubscribe"):
        env.setdefault(key, "1")
    cmd = [str(BIN / "horovodrun"), f"--{controller}", "-np", str(np), "-H", f"localhost:{np}",
           str(BIN / "python"), str(ROOT / "bench" / "bench_averaging.py"), "--out", str(out),
           "--reps", str(reps), "--process-sets", sets, *extra]
    print(f"=== {' '.join(cmd[1:])}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if "] " in line and (" ms" in line or "Error" in line or "Traceback" in line):
            print("   ", line, flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-4000:])
        raise SystemExit(f"benchmark run failed ({controller} np={np} {sets}), rc {proc.returncode}")
    print(f"    {time.monotonic() - start:.0f} s", flush=True)


def floor_s(shape_set: dict) -> float:
    """The transport's floor: the faster of the two single-buffer allreduces (a blocking wait
    and a polled one; with more ranks than cores the blocking wait competes for the CPU)."""
    methods = shape_set["methods"]
    return min(methods[m]["min_s"] for m in (FLOOR, FLOOR_POLLED) if m in methods)


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def report(reports: dict, level_reports: dict) -> str:
    first = next(iter(reports.values()))
    lines = [f"# Averaging benchmark\n",
             f"Machine: {first['host']}, {first['cpus']} CPUs, torch {first['torch']}, "
             f"Horovod {first['horovod']}, CPU tensors, float32. Times are the slowest rank's, "
             "min (median) over repetitions, in ms. Ranks share the machine (4 ranks on "
             f"{first['cpus']} CPUs are oversubscribed).\n"]
    checks = []
    for (controller, np, sets), rep in reports.items():
        if sets != "dynamic":
            continue
        lines.append(f"\n## {controller.upper()}, {np} ranks\n")
        names = list(rep["shape_sets"])
        methods = list(rep["shape_sets"][names[0]]["methods"])
        lines.append("| method | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for m in methods:
            cells = []
            for n in names:
                r = rep["shape_sets"][n]["methods"].get(m)
                cells.append(f"{ms(r['min_s'])} ({ms(r['median_s'])})" if r else "")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        for label, fn in [
            ("hva / PyTorch (min)", lambda s: s["methods"][HVA]["min_s"] / s["methods"][TORCH]["min_s"]),
            ("hva / floor (min; the faster floor)", lambda s: s["methods"][HVA]["min_s"] / floor_s(s)),
            ("hva GB/s (payload bytes / min time)", lambda s: s["bytes"] / s["methods"][HVA]["min_s"] / 1e9),
            ("non-firing step, us", lambda s: s["non_firing_step_us"]),
        ]:
            lines.append(f"| **{label}** | " + " | ".join(f"{fn(rep['shape_sets'][n]):.3f}" for n in names) + " |")
        lines.append("\nPeak extra resident memory during one call (MiB, above the resident size "
                     "before it):\n")
        lines.append("| call | " + " | ".join(f"{n} ({rep['shape_sets'][n]['bytes'] / 2**20:.0f} MiB of params)" for n in names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for m in rep["shape_sets"][names[0]]["peak_extra_mib"]:
            lines.append(f"| {m} | " + " | ".join(f"{rep['shape_sets'][n]['peak_extra_mib'][m]:.0f}" for n in names) + " |")
        big = rep["shape_sets"][BIG]
        to_torch = big["methods"][HVA]["min_s"] / big["methods"][TORCH]["min_s"]
        to_torch_median = big["methods"][HVA]["median_s"] / big["methods"][TORCH]["median_s"]
        to_floor = big["methods"][HVA]["min_s"] / floor_s(big)
        checks.append(f"- {controller} np={np}, {BIG}: hva/PyTorch {to_torch:.2f} (target <= 0.40: "
                      f"{'met' if to_torch <= 0.40 else 'MISSED'}; by medians {to_torch_median:.2f}), "
                      f"hva/floor {to_floor:.2f} "
                      f"(target <= 1.15: {'met' if to_floor <= 1.15 else 'MISSED'})")
        worst_us = max(s["non_firing_step_us"] for s in rep["shape_sets"].values())
        checks.append(f"- {controller} np={np}: slowest non-firing step {worst_us:.2f} us (target < 10: "
                      f"{'met' if worst_us < 10 else 'MISSED'})")
    for controller in ("mpi", "gloo"):
        for shape_set in (BIG, TINY):
            for method in (GLOBAL_LEVEL, PAIR_LEVEL):
                level = {mode: [r["shape_sets"][shape_set]["methods"][method]["min_s"]
                                for (c, _, m, _), r in level_reports.items()
                                if c == controller and m == mode and shape_set in r["shape_sets"]]
                         for mode in ("dynamic", "static")}
                if not (level["dynamic"] and level["static"]):
                    continue
                d, s = min(level["dynamic"]), min(level["static"])
                each = "; ".join(f"{mode} " + ", ".join(ms(x) for x in xs) for mode, xs in level.items())
                target = (f" (target <= 1.05: {'met' if d / s <= 1.05 else 'MISSED'})"
                          if method == GLOBAL_LEVEL else "")
                checks.append(f"- {controller} np=4, {shape_set}, {method}: dynamic {ms(d)} ms vs "
                              f"registered at start-up {ms(s)} ms (min over {len(level['dynamic'])} "
                              f"alternating launches each: {each}), ratio {d / s:.3f}{target}")
    lines.append("\n## Targets\n")
    lines.extend(checks)
    return "\n".join(lines) + "\n"


def chart(reports: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [k for k in reports if k[2] == "dynamic"]
    methods = [HVA, TORCH, "Horovod per-tensor allreduce_async_", "Horovod grouped_allreduce_", FLOOR]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        values = [reports[k]["shape_sets"][BIG]["methods"][m]["min_s"] * 1e3 for k in runs]
        ax.bar([j + i * width for j in range(len(runs))], values, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(runs))])
    ax.set_xticklabels([f"{c.upper()} np={n}" for c, n, _ in runs])
    ax.set_ylabel("ms (min over repetitions)")
    ax.set_title(f"Averaging {BIG} (float32, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "results" / "bench"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite bench.md/png from the JSON files already in --out")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    reports, level_reports = {}, {}
    for i, (controller, np, sets) in enumerate(RUNS):
        path = out_dir / f"{controller}-np{np}-{sets}.json"
        if not args.report_only:
            launch(controller, np, sets, path, args.reps, 29533 + i)
        if path.exists():
            reports[(controller, np, sets)] = json.loads(path.read_text())
    for controller in ("mpi", "gloo"):
        for round_ in range(LEVEL_ROUNDS):
            for sets in ("static", "dynamic"):
                path = out_dir / f"levels-{controller}-np4-{sets}-{round_}.json"
                if not args.report_only:
                    launch(controller, 4, sets, path, args.reps, 29600 + len(level_reports),
                           ("--levels-only", "--shapes", BIG, TINY))
                if path.exists():
                    level_reports[(controller, 4, sets, round_)] = json.loads(path.read_text())
    text = report(reports, level_reports)
    (out_dir / "bench.md").write_text(text)
    chart(reports, out_dir / "bench.png")
    print(text)
    print(f"wrote {out_dir / 'bench.md'} and {out_dir / 'bench.png'}")


if __name__ == "__main__":
    main()
