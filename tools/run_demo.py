"""``make demo``: the main job, a time-to-quality race on 2 emulated nodes x 2 ranks.

Starts the emulated cluster (tools/cluster.py) and runs ``hvd_averaging.examples.train`` across
it with horovodrun (over MPI, or Gloo with ``--gloo``). The link rate is calibrated on this
machine: the job measures one step's compute and the baseline's gradient allreduce, and asks for
another rate until the allreduce costs 4-5x a step. The request and the answer are files in a
folder both sides see (rank 0 writes ``rate-request-N`` holding the rate; this script sets it
with ``tc`` and writes ``rate-set-N``), so the channel does not depend on a launcher's output
format. ``--rate-mbit`` fixes the rate instead. Rank 0's output is shown as it comes; if the job
fails, the last lines of every rank's output follow. Where this machine cannot emulate nodes
(not root, no network namespaces) it runs the same job on this one host and says why in one
line. Output goes to ``--out`` (default results/demo); other arguments go to the training
script (e.g. ``--full`` for 3 seeds).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from cluster import Cluster, ClusterUnavailable, check_privileges
from rank_output import launch_env

ROOT = Path(__file__).resolve().parent.parent
# horovodrun tags each rank's line: "[1,R]<stdout>:" over MPI, "[R]<stdout>:" over Gloo
RANK_TAG = re.compile(r"^\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")
RANK_TAG_INSIDE = re.compile(r"\[(?:\d+,)?\d+\]<(?:stdout|stderr)>:")
TAIL_LINES = 15
BIN = Path(sys.executable).parent


class RankOutput:
    """Rank 0's lines shown as they come (the launcher's own too); every rank's last lines kept
    for a failure report."""

    def __init__(self) -> None:
        self.tails: dict[int, collections.deque] = {}

    def feed(self, line: str) -> None:
        tag = RANK_TAG.match(line)
        if tag is None:
            print(line, end="", flush=True)
            return
        # a rank's line can carry more tags inside it (the launcher tags each piece it reads)
        rank, text = int(tag.group(1)), RANK_TAG_INSIDE.sub("", line[tag.end():])
        self.tails.setdefault(rank, collections.deque(maxlen=TAIL_LINES)).append(
            f"{tag.group(2)}: {text}")
        if rank == 0 and tag.group(2) == "stdout":
            print(text, end="", flush=True)

    def failure_report(self) -> str:
        return "".join(f"\n--- the last lines of rank {rank}'s output:\n" + "".join(tail)
                       for rank, tail in sorted(self.tails.items()))


def answer_rate_requests(folder: Path, cluster: Cluster, stop: threading.Event) -> None:
    """Set the link rate each ``rate-request-N`` asks for, then write ``rate-set-N``."""
    answered = set()
    while not stop.wait(0.1):
        for request in sorted(folder.glob("rate-request-*")):
            attempt = request.name.rsplit("-", 1)[1]
            if attempt in answered or not attempt.isdigit():
                continue
            rate = float(request.read_text())
            for node in range(len(cluster.nodes)):
                cluster.set_rate(node, rate)
            answered.add(attempt)
            (folder / f"rate-set-{attempt}").touch()
            print(f"make demo: link rate set to {rate:.2f} Mbit/s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="link rate between the 2 emulated nodes (default: calibrated)")
    parser.add_argument("--start-rate-mbit", type=float, default=16.0,
                        help="where the calibration starts")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--gloo", action="store_true", help="horovodrun --gloo instead of --mpi")
    parser.add_argument("--out", default="results/demo")
    args, train_args = parser.parse_known_args()
    train = [str(BIN / "python"), "-u", "-m", "hvd_averaging.examples.train",
             "--out", str((ROOT / args.out).resolve()), *train_args]
    np = 2 * args.ranks_per_node
    controller = "--gloo" if args.gloo else "--mpi"
    env = launch_env()
    try:
        check_privileges()
    except ClusterUnavailable as why:
        print(f"make demo: on this one host, not on emulated nodes: {why}", flush=True)
        return subprocess.call([str(BIN / "horovodrun"), controller, "-np", str(np), "-H",
                                f"localhost:{np}", *train], cwd=ROOT, env=env)
    rate = args.rate_mbit or args.start_rate_mbit
    with Cluster(2, rate) as cluster, tempfile.TemporaryDirectory() as handshake:
        how = "fixed (--rate-mbit)" if args.rate_mbit else "calibrating from there"
        print(f"make demo: 2 emulated nodes x {args.ranks_per_node} ranks ({' '.join(cluster.nodes)}), "
              f"{rate:g} Mbit/s between them, {how}, horovodrun {controller}", flush=True)
        control = [] if args.rate_mbit else ["--rate-control", handshake]
        argv = [str(BIN / "horovodrun"), controller, "-np", str(np),
                "-H", cluster.hosts_arg(args.ranks_per_node), "--network-interface", "eth0",
                *train, "--rate-mbit", str(rate), "--link-interface", "eth0", *control]
        stop = threading.Event()
        answering = threading.Thread(target=answer_rate_requests,
                                     args=(Path(handshake), cluster, stop), daemon=True)
        answering.start()
        output = RankOutput()
        proc = cluster.start(argv, env=env, cwd=str(ROOT))
        try:
            for line in proc.stdout:
                output.feed(line)
            code = proc.wait()
        finally:
            stop.set()
            cluster.stop_everything()
            proc.wait()
            answering.join(5)
        if code != 0:
            print(f"make demo: the job failed (exit status {code})" + output.failure_report(),
                  flush=True)
        return code


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
