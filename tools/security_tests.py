"""Security on the emulated cluster (tools/cluster.py), run by tools/run_tests.py.

For each documented launch (mpirun with the recommended Open MPI settings, ``horovodrun --gloo``
and elastic ``horovodrun --gloo``, each with the job's interface named), a small job holds still
(tests/security/listening_job.py) while every TCP socket that listens in every node's namespace
is listed with ``ss -ltnp``: each must be bound to that node's address on the job's interface
(``eth0``), none to every interface or to loopback, except Open MPI's own under mpirun, which
no setting pins (see ``MPI_BTL_PORTS``). In the elastic launch, a process on a node
outside the job then PUTs a crafted pickle to the rendezvous server and tries to read a worker's
registration (tests/security/rendezvous_attacker.py): the PUT must be answered 400 and run
nothing (its marker file stays absent), the read must find nothing, and the job must finish.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

from cluster import Cluster
from cluster_tests import recommended_mca
from rank_output import test_launch_env
from slurm_cluster import SlurmCluster, SlurmUnavailable, check_slurm
from stage_log import StageLog

__all__ = ["listening_sockets", "exposed", "open_mpi_own", "run_all"]

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "security" / "listening_job.py"
ATTACKER = ROOT / "tests" / "security" / "rendezvous_attacker.py"
# Open MPI 4.1 binds its TCP listeners to every address whatever *_if_include says (that
# chooses what is advertised, not where they listen: open-mpi/ompi#12668), and no setting pins
# them. docs/security.md therefore puts its per-rank listener in a known port range (a firewall
# can allow exactly it), and this check accepts, besides what is bound to the job's address,
# only Open MPI's own: its daemons (mpirun, orted) and a rank's listener inside that range.
MPI_BTL_PORTS = (47000, 47099)
MPI_SECURITY_MCA = ["--mca", "btl_tcp_port_min_v4", str(MPI_BTL_PORTS[0]),
                    "--mca", "btl_tcp_port_min_v6", str(MPI_BTL_PORTS[0]),
                    "--mca", "btl_tcp_port_range_v4", str(MPI_BTL_PORTS[1] - MPI_BTL_PORTS[0] + 1),
                    "--mca", "btl_tcp_port_range_v6", str(MPI_BTL_PORTS[1] - MPI_BTL_PORTS[0] + 1)]
OPEN_MPI_DAEMONS = ("mpirun", "orted")


def open_mpi_own(socket: tuple[str, int, str]) -> bool:
    """Open MPI's daemons, or a rank's TCP listener in the port range given to it."""
    _, port, process = socket
    return process in OPEN_MPI_DAEMONS or MPI_BTL_PORTS[0] <= port <= MPI_BTL_PORTS[1]


def slurm_own(socket: tuple[str, int, str]) -> bool:
    """With ``CommunicationParameters=NoInAddrAny`` (tools/slurm_cluster.py) slurmd, srun and a
    step's PMIx listener bind the node's address; what stays is slurmctld on every address of
    the controller, a step daemon's loopback listener, and a rank's Open MPI listener in its
    port range."""
    address, port, processes = socket
    names = set(processes.split(","))
    return "slurmctld" in names or (address == "127.0.0.1" and "slurmstepd" in names) or \
        MPI_BTL_PORTS[0] <= port <= MPI_BTL_PORTS[1]


_SS_LINE = re.compile(r"^LISTEN\s+\d+\s+\d+\s+(\S+):(\d+)\s+\S+\s*(.*)$")


def listening_sockets(ss_output: str) -> list[tuple[str, int, str]]:
    """``(address, port, processes)`` of each line of ``ss -ltnpH``."""
    found = []
    for line in ss_output.splitlines():
        match = _SS_LINE.match(line.strip())
        if match:
            address, port, process = match.groups()
            names = re.findall(r'\("([^"]+)"', process)
            found.append((address.strip("[]"), int(port), ",".join(sorted(set(names))) or "?"))
    return found


def exposed(sockets: list[tuple[str, int, str]], job_address: str,
            accepted=lambda socket: False) -> list[tuple[str, int, str]]:
    """The sockets bound anywhere but ``job_address`` (every interface, loopback, others) that
    ``accepted`` does not accept."""
    return [s for s in sockets if s[0] != job_address and not accepted(s)]


def _ss(cluster: Cluster, node: int) -> str:
    return subprocess.run(["ip", "netns", "exec", cluster.nodes[node], "ss", "-ltnpH"],
                          capture_output=True, text=True, check=True).stdout


def _wait_for(path: Path, limit_s: float, proc: subprocess.Popen) -> bool:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            return False
        time.sleep(0.2)
    return True


def _launch(kind: str, cluster: Cluster, bin_dir: Path, tmp: Path) -> tuple[list[str], dict]:
    """The launch line docs/security.md gives for ``kind``, ranks on nodes 0 and 1 (SLURM:
    srun on the login node 0, a rank on each of nodes 1 and 2)."""
    python = str(bin_dir / "python")
    env = test_launch_env(HVA_PROBE_DIR=str(tmp))
    if kind == "slurm":
        env.update({f"OMPI_MCA_{MPI_SECURITY_MCA[i + 1]}": MPI_SECURITY_MCA[i + 2]
                    for i in range(0, len(MPI_SECURITY_MCA), 3)})
        argv = ["srun", "--mpi=pmix", "--nodes=2", "--ntasks-per-node=1", python, "-u", str(JOB)]
    elif kind == "mpirun":
        argv = ["mpirun", *cluster.mpirun_args(), *recommended_mca(), *MPI_SECURITY_MCA, "-np", "2",
                "-H", cluster.hosts_arg([1, 1, 0]), "-x", "PATH", "-x", "PYTHONPATH", "-x",
                "HVA_PROBE_DIR", "-x", "OMP_NUM_THREADS", python, "-u", str(JOB)]
    elif kind == "horovodrun --gloo":
        argv = [str(bin_dir / "horovodrun"), "--gloo", "-np", "2", "-H", cluster.hosts_arg([1, 1, 0]),
                "--network-interface", "eth0", python, "-u", str(JOB)]
    else:
        hosts = tmp / "hosts"
        hosts.write_text(f"{cluster.nodes[0]}:1\n{cluster.nodes[1]}:1\n")
        env["HVA_ELASTIC_HOSTS_FILE"] = str(hosts)
        argv = [str(bin_dir / "horovodrun"), "--gloo", "-np", "2", "--min-np", "2", "--max-np", "2",
                "--network-interface", "eth0", "--host-discovery-script",
                str(ROOT / "tests/faults/discover_hosts.sh"), python, "-u", str(JOB)]
    return argv, env


ACCEPTED = {"mpirun": open_mpi_own, "slurm": slurm_own}


def run_launch(kind: str, bin_dir: Path, timeout_s: int) -> bool:
    """One launch on 3 nodes (ranks on nodes 0 and 1, node 2 outside the job)."""
    label = f"security: what listens under {kind}" + (
        ", and a crafted pickle sent to the rendezvous" if kind == "elastic" else "")
    print(f"\n=== {label}", flush=True)
    problems: list[str] = []
    attack: Optional[dict] = None
    with tempfile.TemporaryDirectory() as name, Cluster(3) as cluster, ExitStack() as stack:
        tmp = Path(name)
        argv, env = _launch(kind, cluster, bin_dir, tmp)
        if kind == "slurm":
            slurm = stack.enter_context(SlurmCluster(cluster))
            proc = slurm.start(argv, env=env, cwd=str(ROOT))
        else:
            proc = cluster.start(argv, env=env, cwd=str(ROOT))
        try:
            if not _wait_for(tmp / "job.json", 120, proc):
                problems.append("the job never reached its probe point")
            else:
                time.sleep(1.0)  # every rank has its listeners by then (rank 0 wrote last)
                for node in range(3 if kind == "slurm" else 2):
                    sockets = listening_sockets(_ss(cluster, node))
                    print(f"    {cluster.nodes[node]} ({cluster.addresses[node]}) listens on: "
                          + "; ".join(f"{a}:{p} {n}" for a, p, n in sockets), flush=True)
                    accepted = ACCEPTED.get(kind, lambda socket: False)
                    problems += [f"{cluster.nodes[node]}: {n} listens on {a}:{p}, not only on "
                                 f"the job's interface" for a, p, n in
                                 exposed(sockets, cluster.addresses[node], accepted)]
                if kind == "elastic":
                    marker = tmp / "attacker-ran-code"
                    result = cluster.run([str(bin_dir / "python"), str(ATTACKER),
                                          str(tmp / "job.json"), str(marker)], node=2,
                                         cwd=str(ROOT), timeout_s=60)
                    attack = json.loads(result.output.strip().splitlines()[-1]) \
                        if result.returncode == 0 else {"error": result.output[-500:]}
                    time.sleep(1.0)
                    if marker.exists():
                        problems.append("the crafted pickle ran code in the driver (marker file made)")
                    if attack.get("put_status") != 400:
                        problems.append(f"the crafted PUT was answered {attack.get('put_status')!r}, not 400")
                    if attack.get("get_status") != 404:
                        problems.append(f"reading a worker's registration gave "
                                        f"{attack.get('get_status')!r}, not 404")
            (tmp / "probed").write_text("")
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            cluster.stop_everything()
            output, _ = proc.communicate()
            problems.append(f"the job was still running after {timeout_s} s")
    if proc.returncode != 0 or output.count("listening job ok") != 2:
        problems.append(f"the job ended with exit code {proc.returncode}, "
                        f"{output.count('listening job ok')} of 2 ranks ok")
    if attack is not None:
        print(f"    crafted pickle from {cluster.nodes[2]}: {attack}", flush=True)
    for problem in problems:
        print(f"    {problem}", flush=True)
    if problems:
        print(output[-6000:], flush=True)
    print(f"=== {'ok' if not problems else 'FAILED'}: {label}", flush=True)
    return not problems


def run_all(bin_dir: Path, timeout_s: int, log: StageLog) -> None:
    """Every security launch, recorded in ``log`` (the SLURM one as the SLURM stage is: skipped
    with HVA_SKIP_SLURM=1 where SLURM cannot run, failed with the reason otherwise)."""
    kinds = ["mpirun", "horovodrun --gloo", "elastic", "slurm"]
    try:
        check_slurm()
    except SlurmUnavailable as why:
        if os.environ.get("HVA_SKIP_SLURM") == "1":
            log.skip("security: listening sockets, slurm", f"HVA_SKIP_SLURM=1 and {why}")
            kinds.remove("slurm")
    for kind in kinds:
        log.run(f"security: listening sockets, {kind}", lambda: run_launch(kind, bin_dir, timeout_s))
