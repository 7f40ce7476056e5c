"""The single-host float32 path of two revisions side by side: launches of
``bench/bench_averaging.py`` (this tree's copy) alternate between a git worktree of each revision,
so that a slow phase of the machine hits both alike. Each launch times ``hva.average_parameters``
and the floor (one allreduce of a flat buffer) interleaved in the same process; the report gives,
per revision, controller and shape set, the minimum over launches of each launch's minimum, and
the median of its ratio to that launch's floor (which takes out the machine's phase):

    python bench/compare_revisions.py --old 4447550 --new HEAD --rounds 3 --out results/revisions.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import run  # this folder's make bench driver: its launch of bench_averaging.py
from labels import BIG, FLOOR, HVA, TINY, TRANSFORMER

ROOT = Path(__file__).resolve().parents[1]


def worktree(revision: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(where),
                    revision], check=True)
    return where


def launch(tree: Path, controller: str, np: int, shapes: list[str], reps: int, out: Path) -> dict:
    """One launch importing ``tree``'s package; its report."""
    run.launch(controller, np, "dynamic", out, reps, port=29541, extra=("--shapes", *shapes),
               tree=tree)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3, help="launch pairs per controller")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--controllers", default="mpi,gloo")
    parser.add_argument("--shapes", nargs="*",
                        default=[BIG, TRANSFORMER, TINY])
    parser.add_argument("--out", type=Path, required=True, help="markdown report")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hva-revisions-"))
    trees = {}
    try:
        for label, revision in (("old", args.old), ("new", args.new)):
            sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", revision],
                                 check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
            trees[label] = (sha, worktree(sha, scratch / label))
        runs: dict = {}  # (controller, shape set, label) -> [(hva min, floor min)]
        for controller in args.controllers.split(","):
            for round_ in range(args.rounds):
                order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
                for label in order:
                    started = time.monotonic()
                    report = launch(trees[label][1], controller, args.np, args.shapes, args.reps,
                                    scratch / f"{controller}-{round_}-{label}.json")
                    for shape_set, result in report["shape_sets"].items():
                        times = result["methods"]
                        runs.setdefault((controller, shape_set, label), []).append(
                            (times[HVA]["min_s"], times[FLOOR]["min_s"]))
                    print(f"{controller} round {round_} {label} ({trees[label][0]}): "
                          f"{time.monotonic() - started:.0f} s", flush=True)
        lines = [f"# Single-host float32 averaging, {trees['old'][0]} (old) vs {trees['new'][0]} (new)",
                 "", f"`python bench/compare_revisions.py --old {args.old} --new {args.new} "
                 f"--rounds {args.rounds}`: {args.np} ranks on one host, {args.rounds} launch pairs "
                 f"per controller in alternating order, {args.reps} repetitions per launch (the "
                 "slowest rank's time); min over launches, and the median over launches of "
                 "hva's min / the same launch's floor min.", "",
                 "| controller | shapes | old min | new min | new / old | old / floor | new / floor |",
                 "|---|---|---|---|---|---|---|"]
        for controller in args.controllers.split(","):
            for shape_set in args.shapes:
                old = runs[(controller, shape_set, "old")]
                new = runs[(controller, shape_set, "new")]
                old_min, new_min = min(h for h, _ in old), min(h for h, _ in new)
                old_ratio = statistics.median(h / f for h, f in old)
                new_ratio = statistics.median(h / f for h, f in new)
                lines.append(f"| {controller} | {shape_set} | {old_min * 1e3:.2f} ms | "
                             f"{new_min * 1e3:.2f} ms | {new_min / old_min:.3f} | "
                             f"{old_ratio:.3f} | {new_ratio:.3f} |")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    finally:
        for _, tree in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           check=False)


if __name__ == "__main__":
    main()
