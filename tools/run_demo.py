"""``make demo``: the main job on 2 emulated nodes x 2 ranks joined by a slow link.

Starts the emulated cluster (tools/cluster.py) with ``--rate-mbit`` (default 16) between the
nodes and runs ``hvd_averaging.examples.train`` across it with horovodrun over MPI; where this
machine cannot emulate nodes (not root, no network namespaces) it runs the same job on this one
host and says why in one line. Output goes to ``--out`` (default results/demo); other arguments
go to the training script (e.g. ``--task digits --fast``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from cluster import Cluster, ClusterUnavailable, check_privileges
from rank_output import launch_env

ROOT = Path(__file__).resolve().parent.parent
RANK_PREFIX = re.compile(r"\[1,\d+\]<std(?:out|err)>:")
BIN = Path(sys.executable).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=16.0,
                        help="link rate between the 2 emulated nodes (what each node receives)")
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
    with Cluster(2, args.rate_mbit) as cluster:
        print(f"make demo: 2 emulated nodes x {args.ranks_per_node} ranks ({' '.join(cluster.nodes)}), "
              f"{args.rate_mbit:g} Mbit/s between them (--rate-mbit to change)", flush=True)
        argv = [str(BIN / "horovodrun"), "--mpi", "-np", str(np),
                "-H", cluster.hosts_arg(args.ranks_per_node), "--network-interface", "eth0", *train]
        proc = cluster.start(argv, env=env, cwd=str(ROOT))
        try:
            for line in proc.stdout:  # rank 0's lines, and the launcher's own
                if line.startswith("[1,0]<stdout>:") or not line.startswith("[1,"):
                    print(RANK_PREFIX.sub("", line), end="", flush=True)
            return proc.wait()
        finally:
            cluster.stop_everything()
            proc.wait()


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
