"""``make demo``: the main job, a time-to-quality race on 2 emulated nodes x 2 ranks.

Starts the emulated cluster (tools/cluster.py) and runs ``hvd_averaging.examples.train`` across
it with horovodrun over MPI. The link rate is calibrated on this machine: the job measures one
step's compute and the baseline's gradient allreduce, and asks for another rate (a line
``HVA-DEMO-SET-RATE rate attempt`` from rank 0; this script sets it with ``tc`` and answers with
a file) until the allreduce costs 4-5x a step. ``--rate-mbit`` fixes the rate instead. Where
this machine cannot emulate nodes (not root, no network namespaces) it runs the same job on this
one host and says why in one line. Output goes to ``--out`` (default results/demo); other
arguments go to the training script (e.g. ``--full`` for 3 seeds).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from cluster import Cluster, ClusterUnavailable, check_privileges
from rank_output import launch_env

ROOT = Path(__file__).resolve().parent.parent
RANK_PREFIX = re.compile(r"\[1,\d+\]<std(?:out|err)>:")
BIN = Path(sys.executable).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="link rate between the 2 emulated nodes (default: calibrated)")
    parser.add_argument("--start-rate-mbit", type=float, default=16.0,
                        help="where the calibration starts")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--out", default="results/demo")
    args, train_args = parser.parse_known_args()
    train = [str(BIN / "python"), "-u", "-m", "hvd_averaging.examples.train",
             "--out", str((ROOT / args.out).resolve()), *train_args]
    np = 2 * args.ranks_per_node
    env = launch_env()
    try:
        check_privileges()
    except ClusterUnavailable as why:
        print(f"make demo: on this one host, not on emulated nodes: {why}", flush=True)
        return subprocess.call([str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}",
                                *train], cwd=ROOT, env=env)
    rate = args.rate_mbit or args.start_rate_mbit
    with Cluster(2, rate) as cluster, tempfile.TemporaryDirectory() as handshake:
        how = "fixed (--rate-mbit)" if args.rate_mbit else "calibrating from there"
        print(f"make demo: 2 emulated nodes x {args.ranks_per_node} ranks ({' '.join(cluster.nodes)}), "
              f"{rate:g} Mbit/s between them, {how}", flush=True)
        control = [] if args.rate_mbit else ["--rate-control", handshake]
        argv = [str(BIN / "horovodrun"), "--mpi", "-np", str(np),
                "-H", cluster.hosts_arg(args.ranks_per_node), "--network-interface", "eth0",
                *train, "--rate-mbit", str(rate), "--link-interface", "eth0", *control]
        proc = cluster.start(argv, env=env, cwd=str(ROOT))
        try:
            for line in proc.stdout:  # rank 0's lines, and the launcher's own
                if not (line.startswith("[1,0]<stdout>:") or not line.startswith("[1,")):
                    continue
                text = RANK_PREFIX.sub("", line)
                if text.startswith("HVA-DEMO-SET-RATE "):
                    _, new_rate, attempt = text.split()
                    for node in range(len(cluster.nodes)):
                        cluster.set_rate(node, float(new_rate))
                    Path(handshake, f"rate-set-{attempt}").touch()
                    print(f"make demo: link rate set to {float(new_rate):.2f} Mbit/s", flush=True)
                    continue
                print(text, end="", flush=True)
            return proc.wait()
        finally:
            cluster.stop_everything()
            proc.wait()

if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
