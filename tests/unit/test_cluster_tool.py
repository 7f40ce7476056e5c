"""tools/cluster.py's arguments and the names it gives, and its teardown when signalled twice
(that one test creates real namespaces; the multi-node launches of tools/run_tests.py use the
tool for real)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from cluster import Cluster  # noqa: E402


@pytest.mark.parametrize("nodes", [0, -1, 1.5, True, 201])
def test_node_count_is_validated(nodes):
    with pytest.raises(ValueError, match="nodes must be"):
        Cluster(nodes)


@pytest.mark.parametrize("rate", [0, -5])
def test_rate_is_validated(rate):
    with pytest.raises(ValueError, match="rate_mbit must be > 0"):
        Cluster(2, rate)


def test_names_are_unique_short_and_hosts_arg_lists_slots():
    a, b = Cluster(3), Cluster(3)
    assert a.prefix != b.prefix
    assert all(len(name) <= 15 for name in [a.bridge, *a.host_links, *a.nodes])
    assert a.hosts_arg(2) == ",".join(f"{n}:2" for n in a.nodes)
    assert a.hosts_arg([3, 1, 0]) == f"{a.nodes[0]}:3,{a.nodes[1]}:1"


def test_slurm_conf_puts_the_controller_on_node_0_and_computes_on_the_others(tmp_path):
    from slurm_cluster import SlurmCluster, slurm_conf

    cluster = Cluster(3)
    conf = slurm_conf(cluster, tmp_path, cpus=4, slurmd_timeout_s=12)
    assert f"SlurmctldHost={cluster.nodes[0]}({cluster.addresses[0]})" in conf
    nodes = [line for line in conf.splitlines() if line.startswith("NodeName=")]
    assert [line.split()[0] for line in nodes] == [f"NodeName={n}" for n in cluster.nodes[1:]]
    assert all("CPUs=4" in line for line in nodes)
    assert f"PartitionName=hva Nodes={cluster.nodes[1]},{cluster.nodes[2]} " in conf
    # state under the run's folder, a failed node's job not requeued, the timeout passed on
    assert f"StateSaveLocation={tmp_path}/ctld" in conf and "JobRequeue=0" in conf
    assert "SlurmdTimeout=12" in conf
    with pytest.raises(ValueError, match="a controller and a compute node"):
        SlurmCluster(Cluster(1))


SECOND_SIGNAL = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import cluster
teardown = cluster._teardown
def teardown_signalled_again(*args):
    os.kill(os.getpid(), signal.SIGTERM)  # timeout(1) and a user both signal, say
    time.sleep(0.3)
    teardown(*args)
cluster._teardown = teardown_signalled_again
try:
    with cluster.Cluster(2) as c:
        print(c.prefix, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
except KeyboardInterrupt:
    pass
"""


def test_a_second_signal_during_the_teardown_leaves_no_namespace():
    """Real namespaces (this suite runs as root): SIGTERM, then SIGTERM again while the
    namespaces are being removed; none may be left (before the fix the second one cut the
    teardown short)."""
    import subprocess
    done = subprocess.run([sys.executable, "-c", SECOND_SIGNAL, str(ROOT / "tools")],
                          capture_output=True, text=True, timeout=60)
    prefix = done.stdout.strip()
    assert prefix.startswith("hva"), done.stdout + done.stderr
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in left, f"namespaces left behind: {left}"
