"""``make bench``: launch bench_averaging.py for each transport and rank count, then write
``results/bench/bench.md`` (tables, target checks) and ``results/bench/bench.png``; then the
cluster section: bench_cluster.py on emulated nodes (tools/cluster.py) joined by a 200 Mbit/s
link, written to the same report and ``results/bench/cluster.png`` (one line says why not
where this machine cannot emulate nodes).

The 2- and 4-rank runs of one controller run back to back on this machine. Then, per
controller, short 4-rank launches that time only the hierarchy levels alternate between groups
registered dynamically (``hva.init()``) and at start-up (``hva.init(group_sizes=[2])``, no
dynamic process sets), to compare the levels' allreduces; alternating launches keep a slow
phase of the machine from landing on one mode only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tools"))
from cluster import Cluster, ClusterUnavailable, check_privileges  # noqa: E402
from rank_output import launch_env  # noqa: E402

from labels import (BIG, CLUSTER_METHODS, FLOOR, FLOOR_POLLED, GLOBAL_LEVEL, GROUPED, HVA,
                    PAIR_LEVEL, PER_TENSOR, TINY, TORCH)

CLUSTER_RATE_MBIT = 200
# (controller, ranks per node, with the overlapped-training part). One rank per node: what the
# transport reaches on this link when only two processes share the machine's CPUs.
CLUSTER_RUNS = [("mpi", 2, True), ("mpi", 4, False), ("gloo", 2, False), ("mpi", 1, False),
                ("gloo", 1, False)]
C_HOROVOD, C_FLAT, C_NA, C_NA16, C_FLAT16, C_NA8, C_NODE, C_CHOSEN = CLUSTER_METHODS
RUNS = [("mpi", 2, "dynamic"), ("mpi", 4, "dynamic"), ("gloo", 2, "dynamic"), ("gloo", 4, "dynamic")]
LEVEL_ROUNDS = 3  # static/dynamic launch pairs per controller


def launch(controller: str, np: int, sets: str, out: Path, reps: int, port: int,
           extra: tuple[str, ...] = (), tree: Optional[Path] = None) -> None:
    """One launch of ``bench/bench_averaging.py`` (its JSON goes to ``out``); ``tree``: another
    checkout whose package it imports instead of this one (bench/compare_revisions.py)."""
    env = launch_env(BENCH_TORCH_PORT=str(port),
                     **({} if tree is None else {"PYTHONPATH": str(tree)}))
    cmd = [str(BIN / "horovodrun"), f"--{controller}", "-np", str(np), "-H", f"localhost:{np}",
           str(BIN / "python"), str(ROOT / "bench" / "bench_averaging.py"), "--out", str(out),
           "--reps", str(reps), "--process-sets", sets, *extra]
    print(f"=== {' '.join(cmd[1:])}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree or ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
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


def grouped_bars(path: Path, groups: list[str], series: dict[str, list[float]], ylabel: str,
                 title: str, lines: tuple[float, ...] = ()) -> None:
    """One bar per series in each group, dashed horizontal ``lines``, saved to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=label)
    for y, style in zip(lines, ("--", ":")):
        ax.axhline(y, color="black" if style == "--" else "grey", linestyle=style, linewidth=1)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def chart(reports: dict, path: Path) -> None:
    runs = [k for k in reports if k[2] == "dynamic"]
    methods = [HVA, TORCH, PER_TENSOR, GROUPED, FLOOR]
    grouped_bars(path, [f"{c.upper()} np={n}" for c, n, _ in runs],
                 {m: [reports[k]["shape_sets"][BIG]["methods"][m]["min_s"] * 1e3 for k in runs]
                  for m in methods},
                 "ms (min over repetitions)", f"Averaging {BIG} (float32, CPU)")


def launch_on_cluster(controller: str, per_node: int, overlap: bool, out: Path, reps: int) -> None:
    env = launch_env(OMPI_MCA_mpi_yield_when_idle="1")  # ranks oversubscribe the cores
    with Cluster(2, CLUSTER_RATE_MBIT) as cluster:
        cmd = [str(BIN / "horovodrun"), f"--{controller}", "-np", str(2 * per_node),
               "-H", cluster.hosts_arg(per_node), "--network-interface", "eth0",
               str(BIN / "python"), str(ROOT / "bench" / "bench_cluster.py"), "--out", str(out),
               "--reps", str(reps), "--rate-mbit", str(CLUSTER_RATE_MBIT),
               *(["--overlap"] if overlap else [])]
        print(f"=== 2 emulated nodes x {per_node}, {CLUSTER_RATE_MBIT} Mbit/s: {' '.join(cmd[1:8])} ...",
              flush=True)
        result = cluster.run(cmd, env=env, cwd=str(ROOT), timeout_s=900)
    for line in result.output.splitlines():
        if " ms" in line and ("<stdout>" in line) and ("[1,0]" in line or "[0]" in line):
            print("   ", line.split(">:", 1)[-1], flush=True)
    if result.returncode != 0:
        print(result.output[-4000:])
        raise SystemExit(f"cluster benchmark failed ({controller}, 2 x {per_node}), rc {result.returncode}")
    print(f"    {result.seconds:.0f} s", flush=True)


def cluster_report(runs: dict) -> str:
    lines = [f"\n## Across 2 emulated nodes ({CLUSTER_RATE_MBIT} Mbit/s link)\n",
             "Network namespaces on this one machine (`tools/cluster.py`), a tbf rate limit on "
             "what each node receives; all ranks share this machine's CPUs. The link limit is "
             "the least time any averaging can take: each node must receive 2 (n-1)/n of the "
             "buffer. Times: the slowest rank's, min (median) over repetitions, ms.\n"]
    checks = []
    for (controller, per_node), rep in runs.items():
        limit = rep["link_limit_s"]
        methods = rep["methods"]
        horovod = methods[C_HOROVOD]["min_s"]
        lines.append(f"\n### {controller.upper()}, 2 nodes x {per_node} ranks, "
                     f"{rep['bytes'] / 2 ** 20:.0f} MiB float32 in {rep['tensors']} tensors; "
                     f"link limit {limit * 1e3:.0f} ms (float16: {limit * 500:.0f} ms)\n")
        lines.append("| method | ms | / link limit | / Horovod flat allreduce | MB sent on the link per rank (one round) |")
        lines.append("|---|---|---|---|---|")
        for label, r in methods.items():
            sent = r.get("link_bytes_per_rank")
            lines.append(f"| {label} | {ms(r['min_s'])} ({ms(r['median_s'])}) | "
                         f"{r['min_s'] / limit:.2f} | {r['min_s'] / horovod:.2f} | "
                         f"{'' if sent is None else f'{sent / 1e6:.2f}'} |")
        na, na16 = methods[C_NA]["min_s"], methods[C_NA16]["min_s"]
        if C_CHOSEN in methods:
            chosen = methods[C_CHOSEN]["min_s"]
            lines.append(f"\nThe way the library chose (HVA_ROUTE=measure): "
                         f"{'; '.join(f'{k}: {v}' for k, v in rep.get('routes_chosen', {}).items()) or 'no choice to make (the set cannot go node-aware)'}")
            checks.append(f"- {controller} 2x{per_node}, the way chosen: / Horovod flat "
                          f"{chosen / horovod:.2f} (target <= 1.02: "
                          f"{'met' if chosen / horovod <= 1.02 else 'MISSED'}), / link limit "
                          f"{chosen / limit:.2f}" + (f" (target <= 1.20 on 2 x 1: "
                          f"{'met' if chosen / limit <= 1.20 else 'MISSED'})" if per_node == 1 else ""))
        if C_NA8 in methods:
            na8 = methods[C_NA8]["min_s"]
            bytes_ratio = methods[C_NA8]["link_bytes_per_rank"] / methods[C_NA]["link_bytes_per_rank"]
            stages = rep.get("int8_stages", {})
            if stages:
                lines.append("\nint8 node-aware, per stage (slowest rank, min over repetitions, ms): " +
                             "; ".join(f"{k} {v * 1e3:.0f}" for k, v in stages.items()))
            checks.append(f"- {controller} 2x{per_node}, int8: time / float32 node-aware "
                          f"{na8 / na:.2f} (target <= 0.40: {'met' if na8 / na <= 0.40 else 'MISSED'}); "
                          f"bytes sent on the link / float32's {bytes_ratio:.3f} (target <= 0.27: "
                          f"{'met' if bytes_ratio <= 0.27 else 'MISSED'})")
        if per_node == 1:
            checks.append(f"- {controller} 2x1 (one rank per node: nothing to stage; what the "
                          f"transport reaches with the CPUs to itself): Horovod flat / link limit "
                          f"{horovod / limit:.2f}, hva / link limit {na / limit:.2f}, hva fp16 / "
                          f"float16 link limit {na16 / (limit / 2):.2f}")
            continue
        checks.append(f"- {controller} 2x{per_node}: node-aware / link limit {na / limit:.2f} "
                      f"(target <= 1.15: {'met' if na / limit <= 1.15 else 'MISSED'}), node-aware / "
                      f"Horovod flat {na / horovod:.2f} (target < 1: {'met' if na < horovod else 'MISSED'}); "
                      f"fp16 / fp32 node-aware {na16 / na:.2f} (target <= 0.55: "
                      f"{'met' if na16 / na <= 0.55 else 'MISSED'})")
        overlap = rep.get("overlap")
        if overlap:
            base = overlap["no averaging"]["step_s"]
            lines.append(f"\nTraining with local SGD every {overlap['period']} steps "
                         f"({overlap['steps']} steps, node-aware averaging of the same buffer), "
                         f"time per step; the delay ({overlap['delay']}) was chosen so that one "
                         f"averaging round ({overlap['averaging_round_s'] * 1e3:.0f} ms, timed "
                         f"alone) fits into it 1.5 times over steps of "
                         f"{overlap['compute_step_s'] * 1e3:.0f} ms:\n")
            lines.append("| run | ms/step | / no averaging | average_parameters while a round is in flight (median, max us) |")
            lines.append("|---|---|---|---|")
            for label, r in overlap.items():
                if not isinstance(r, dict) or "step_s" not in r:
                    continue
                polls = (f"{r['polling_call_us_median']:.1f}, {r['polling_call_us_max']:.0f}"
                         if "polling_call_us_median" in r else "")
                lines.append(f"| {label} | {r['step_s'] * 1e3:.1f} | {r['step_s'] / base:.3f} | {polls} |")
            idle = overlap["polling call, nothing else running"]
            lines.append(f"\nA polling call by itself (a round in flight, its transfer running, no "
                         f"training; 200 calls): median {idle['median_us']:.1f} us on rank 0, slowest rank's median "
                         f"{idle['slowest_rank_median_us']:.1f} us, max {idle['max_us']:.0f} us.\n")
            delayed = overlap[f"local SGD, delay {overlap['delay']}"]
            sync = overlap["local SGD, delay 0"]
            checks.append(f"- {controller} 2x{per_node}, overlapped averaging (period "
                          f"{overlap['period']}, delay {overlap['delay']}): {delayed['step_s'] / base:.3f}x "
                          f"the step time without averaging (target <= 1.10: "
                          f"{'met' if delayed['step_s'] / base <= 1.10 else 'MISSED'}); delay 0: "
                          f"{sync['step_s'] / base:.3f}x; a polling call by itself: slowest rank's "
                          f"median {idle['slowest_rank_median_us']:.1f} us (target < 10: "
                          f"{'met' if idle['slowest_rank_median_us'] < 10 else 'MISSED'}); during "
                          f"training: median {delayed['polling_call_us_median']:.1f} us, max "
                          f"{delayed['polling_call_us_max']:.0f} us")
    lines.append("\n### Cluster targets\n")
    lines.extend(checks)
    return "\n".join(lines) + "\n"


def cluster_chart(runs: dict, path: Path) -> None:
    methods = [C_HOROVOD, C_FLAT, C_NA, C_FLAT16, C_NA16, C_NA8]
    grouped_bars(path, [f"{c.upper()} 2 nodes x {n}" for c, n in runs],
                 {m: [r["methods"][m]["min_s"] / r["link_limit_s"] if m in r["methods"] else 0.0
                      for r in runs.values()]
                  for m in methods},
                 "time / link limit (float32 bytes)",
                 f"Global averaging across 2 emulated nodes, {CLUSTER_RATE_MBIT} Mbit/s",
                 lines=(1.0, 1.15))


def cluster_section(out_dir: Path, reps: int, report_only: bool) -> str:
    runs = {}
    if not report_only:
        try:
            check_privileges()
        except ClusterUnavailable as why:
            return f"\n## Across emulated nodes\n\nNot measured: this machine cannot emulate nodes ({why}).\n"
    for controller, per_node, overlap in CLUSTER_RUNS:
        path = out_dir / f"cluster-{controller}-2x{per_node}.json"
        if not report_only:
            launch_on_cluster(controller, per_node, overlap, path, reps)
        if path.exists():
            runs[(controller, per_node)] = json.loads(path.read_text())
    if not runs:
        return "\n## Across emulated nodes\n\nNo cluster results in this folder.\n"
    cluster_chart(runs, out_dir / "cluster.png")
    return cluster_report(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "results" / "bench"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite bench.md/png from the JSON files already in --out")
    parser.add_argument("--cluster-only", action="store_true", help="only the cluster section")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.cluster_only:
        text = cluster_section(out_dir, args.reps, args.report_only)
        (out_dir / "cluster.md").write_text(text)
        print(text)
        return
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
    chart(reports, out_dir / "bench.png")
    text += cluster_section(out_dir, args.reps, args.report_only)
    (out_dir / "bench.md").write_text(text)
    print(text)
    print(f"wrote {out_dir / 'bench.md'}, {out_dir / 'bench.png'} and {out_dir / 'cluster.png'}")


if __name__ == "__main__":
    main()
