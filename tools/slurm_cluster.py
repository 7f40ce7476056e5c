"""A SLURM cluster on the emulated nodes: ``munged``, ``slurmctld`` and one ``slurmd`` per node.

Node 0 is the login and controller node (``munged``, ``slurmctld``; users run ``sbatch``,
``srun``, ``scontrol`` there); nodes 1.. are the compute nodes, each with its ``slurmd`` under its
own host name in its own namespace, so job steps run where the node's network is. Everything
lives under the cluster's state folder (a munge key generated for this run, ``slurm.conf``,
state, spool, logs, the job completion log) and goes with the cluster: every daemon runs inside
a node's namespace, so the cluster's teardown (every process of every namespace) stops them.

Example::

    with Cluster(3, rate_mbit=200) as nodes, SlurmCluster(nodes) as slurm:
        out = slurm.run(["sbatch", "--parsable", "job.sbatch"])
        state = slurm.wait_for_job(int(out.output.strip()), timeout_s=300)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from cluster import Cluster, ClusterUnavailable, RunResult, StartedOrClosed

__all__ = ["SlurmCluster", "SlurmUnavailable", "check_slurm", "FINAL_STATES"]

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "scancel")
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED")
MUNGE_PATHS = ("/usr/sbin", "/usr/bin")
# PMIx's per-step client folders (named by user, job and step, not node) go under a folder each
# node mounts for itself (the same path, a tmpfs per node): in one shared /tmp, the second
# node's slurmstepd found the first one's and the step failed
PRIVATE_TMP = "mount -t tmpfs -o size=1g,mode=1777 node_tmp {folder}/node-tmp"
CGROUP_MOUNTS = ("mountpoint -q /sys/fs/cgroup || { mount -t tmpfs cgroup_root /sys/fs/cgroup && "
                 "for c in cpuset memory freezer devices; do mkdir -p /sys/fs/cgroup/$c && "
                 "mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c; done; }")


class SlurmUnavailable(ClusterUnavailable):
    """SLURM or munge is not installed (``make system-packages`` installs them)."""


def _which(program: str) -> Optional[str]:
    found = shutil.which(program)
    if found:
        return found
    for folder in MUNGE_PATHS:
        if os.access(f"{folder}/{program}", os.X_OK):
            return f"{folder}/{program}"
    return None


def check_slurm() -> None:
    """Raise :class:`SlurmUnavailable` naming what is missing."""
    missing = [p for p in DAEMONS + CLIENTS if _which(p) is None]
    if missing:
        raise SlurmUnavailable(f"SLURM or munge missing ({', '.join(missing)}): install "
                               "Debian's slurmctld, slurmd, slurm-client and munge "
                               "(make system-packages)")


def slurm_conf(cluster: Cluster, folder: Path, cpus: int, slurmd_timeout_s: int) -> str:
    """``slurm.conf`` for ``cluster``: node 0 the controller, the others compute nodes."""
    compute = list(zip(cluster.nodes[1:], cluster.addresses[1:]))
    lines = [
        "ClusterName=hva",
        f"SlurmctldHost={cluster.nodes[0]}({cluster.addresses[0]})",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={folder}/munge/munge.socket",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={folder}/ctld",
        f"SlurmdSpoolDir={folder}/spool/%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd-%n.log",
        # no cgroup hierarchy to delegate on a test machine: processes tracked by parent pid
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "MpiDefault=none", "SwitchType=switch/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill", "ReturnToService=2",
        f"SlurmdTimeout={slurmd_timeout_s}", "SlurmctldTimeout=30", "MessageTimeout=5",
        "InactiveLimit=0", "KillWait=2", "MinJobAge=3600", "TreeWidth=50",
        # a job on a failed node ends (NODE_FAIL) rather than going back to the queue
        "JobRequeue=0",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/filetxt", f"JobCompLoc={folder}/jobcomp.txt",
        "SlurmdParameters=config_overrides", f"TmpFS={folder}/node-tmp",
        # daemons and srun bind the node's own address, not every interface (docs/security.md)
        "CommunicationParameters=NoInAddrAny",
        *(f"NodeName={node} NodeAddr={addr} CPUs={cpus} State=UNKNOWN" for node, addr in compute),
        f"PartitionName=hva Nodes={','.join(n for n, _ in compute)} Default=YES "
        "MaxTime=INFINITE State=UP OverSubscribe=YES",
    ]
    return "\n".join(lines) + "\n"


class SlurmCluster(StartedOrClosed):
    """SLURM's daemons on an emulated :class:`~cluster.Cluster` of 2 or more nodes (node 0:
    controller and login node; nodes 1..: compute). Context manager."""

    def __init__(self, cluster: Cluster, *, cpus_per_node: int = 4, slurmd_timeout_s: int = 12):
        if len(cluster.nodes) < 2:
            raise ValueError(f"a SLURM cluster needs a controller and a compute node, got "
                             f"{len(cluster.nodes)} node(s)")
        self.cluster = cluster
        self.folder = cluster.state_dir / "slurm"
        self.conf = self.folder / "slurm.conf"
        self.cpus_per_node = cpus_per_node
        self.slurmd_timeout_s = slurmd_timeout_s
        self._daemons: list[subprocess.Popen] = []

    @property
    def compute_nodes(self) -> list[str]:
        return self.cluster.nodes[1:]

    def env(self, base: Optional[dict] = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _prepare(self) -> None:
        check_slurm()

    def _daemon(self, node: int, argv: Sequence[str], log: str) -> None:
        out = open(self.folder / log, "ab")
        proc = subprocess.Popen(self.cluster.command_on(node, argv), env=self.env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self._daemons.append(proc)

    def _start(self) -> None:
        for sub in ("ctld", "spool"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        # this run's key, never stored anywhere else: made 0400 in a 0700 folder, with O_EXCL
        # (no one else's file is reused), so munged accepts it without --force
        # (the socket's folder must stay reachable by every user: munged checks both)
        key_folder = self.folder / "munge-key"
        key_folder.mkdir(mode=0o700)
        key_folder.chmod(0o700)
        munge = self.folder / "munge"
        munge.mkdir(mode=0o755)
        key = key_folder / "munge.key"
        descriptor = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(descriptor, "wb") as out:
            out.write(os.urandom(1024))
        self.conf.write_text(slurm_conf(self.cluster, self.folder, self.cpus_per_node,
                                        self.slurmd_timeout_s))
        (self.folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        (self.folder / "mpi.conf").write_text(f"PMIxCliTmpDirBase={self.folder}/node-tmp\n")
        (self.folder / "node-tmp").mkdir(exist_ok=True)
        socket = munge / "munge.socket"
        self._daemon(0, [_which("munged"), "--foreground", f"--key-file={key}",
                         f"--socket={socket}", f"--pid-file={munge}/munged.pid",
                         f"--log-file={munge}/munged.log",
                         f"--seed-file={munge}/munged.seed"], "munged.out")
        self._wait(lambda: socket.exists(), 20, "munged's socket")
        self._daemon(0, [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for index in range(1, len(self.cluster.nodes)):
            name = self.cluster.nodes[index]
            (self.folder / "spool" / name).mkdir(exist_ok=True)
            # `ip netns exec` mounts a fresh /sys without the cgroup hierarchies slurmd's
            # cgroup plugin looks for: mount them again in the node's mount namespace
            # and a folder of the node's own for PMIx (below)
            self._daemon(index, ["/bin/bash", "-c", CGROUP_MOUNTS + " && " +
                                 PRIVATE_TMP.format(folder=self.folder) +
                                 ' && exec "$@"', "slurmd",
                                 _which("slurmd"), "-D", "-N", name, "-f", str(self.conf)],
                         f"slurmd-{name}.out")
        self._wait(self._all_idle, 60, "every compute node idle in sinfo")

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}"
                                 for p in sorted(self.folder.glob("*.out")) + sorted(self.folder.glob("*.log")))
                raise RuntimeError(f"SLURM cluster: no {what} after {timeout_s} s "
                                   f"({len(dead)} daemon(s) exited)\n{logs}")
            time.sleep(0.3)

    def _all_idle(self) -> bool:
        result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout_s=15)
        states = dict(line.split() for line in result.output.splitlines() if len(line.split()) == 2)
        return all(states.get(node, "").startswith("idle") for node in self.compute_nodes)

    def run(self, argv: Sequence[str], *, env: Optional[dict] = None, cwd: Optional[str] = None,
            timeout_s: float = 300) -> RunResult:
        """``argv`` on the login node (node 0) with this cluster's ``SLURM_CONF``."""
        return self.cluster.run(list(argv), node=0, env=self.env(env), cwd=cwd, timeout_s=timeout_s)

    def start(self, argv: Sequence[str], *, env: Optional[dict] = None,
              cwd: Optional[str] = None) -> subprocess.Popen:
        return self.cluster.start(list(argv), node=0, env=self.env(env), cwd=cwd)

    def job_state(self, job_id: int) -> str:
        """The job's state as ``scontrol show job`` reports it (e.g. ``COMPLETED``)."""
        out = self.run(["scontrol", "show", "job", str(job_id)], timeout_s=15).output
        found = re.search(r"JobState=(\S+)", out)
        return found.group(1) if found else f"unknown ({out.strip()[:200]})"

    def wait_for_job(self, job_id: int, timeout_s: float) -> str:
        """Poll until the job reaches a final state; returns it (or the last state seen)."""
        deadline = time.monotonic() + timeout_s
        state = self.job_state(job_id)
        while state not in FINAL_STATES and time.monotonic() < deadline:
            time.sleep(0.5)
            state = self.job_state(job_id)
        return state

    def close(self) -> None:
        """Stop the daemons (the cluster's teardown would too; this leaves no gap between)."""
        for proc in self._daemons:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
            proc.wait()
        self._daemons.clear()
