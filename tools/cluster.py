"""An emulated cluster on one machine: network namespaces as nodes, a rate-limited link between them.

Each node is a network namespace with its own ``eth0`` (one end of a veth pair whose other end
sits on a bridge in the root namespace), its own address, its own host name (every process on
it is started under ``unshare --uts`` with ``hostname NODE``) and an ``/etc/hosts`` that names
every node (``ip netns exec`` binds ``/etc/netns/NODE/hosts`` over ``/etc/hosts``). A ``tbf``
qdisc on the bridge side of each veth limits what that node receives, so traffic between nodes
crosses a link of the chosen rate while traffic inside a node (loopback, shared memory) does not.

Launchers reach the nodes through a stand-in for ``ssh`` (``shim_dir()/ssh``, first on PATH for
``horovodrun``; ``mpirun --mca plm_rsh_agent`` for OpenMPI) that runs the command inside the
named node. The launcher itself runs inside the first node, as on a real cluster's head node.

Everything a cluster creates carries a unique prefix and is recorded under ``STATE_ROOT``; the
context manager tears it down (processes by namespace, then namespaces, links, qdiscs, files),
also on SIGINT/SIGTERM/SIGHUP, and a new cluster first removes what a killed run left behind.

Example::

    with Cluster(nodes=2, rate_mbit=200) as cluster:
        result = cluster.run(["horovodrun", "-np", "4", "-H", cluster.hosts_arg(2), ...],
                             timeout_s=300)

Command line (for trying things by hand)::

    python tools/cluster.py --nodes 2 --rate-mbit 200 -- horovodrun --gloo -np 4 -H {hosts:2} ...
    python tools/cluster.py --cleanup      # remove what killed runs left behind
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["Cluster", "StartedOrClosed", "ClusterUnavailable", "RunResult", "check_privileges", "clean_stale",
           "STATE_ROOT"]

STATE_ROOT = Path("/run/hvd_averaging-cluster")
NETNS_DIR = Path("/etc/netns")
SUBNET_PREFIX = "10.213.0"  # only inside the namespaces a cluster creates

SSH_SHIM = r"""#!/bin/bash
# Stand-in for ssh on an emulated cluster: runs the command inside the node's namespace with the
# node's host name. Accepts ssh's options before and after the host, as horovodrun and mpirun use.
host=
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-i|-l|-F|-b|-c|-E|-J|-L|-R|-D|-W|-w) shift 2 ;;
    -*) shift ;;
    *) if [ -z "$host" ]; then host=$1; shift; else break; fi ;;
  esac
done
host=${host#*@}
[ -f "/etc/netns/$host/hosts" ] || { echo "ssh shim: no emulated node named '$host'" >&2; exit 255; }
exec ip netns exec "$host" unshare --uts /bin/bash -c 'hostname "$0" && eval "$*"' "$host" "$@"
"""


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster (not root, no network namespaces, ...)."""


@dataclass
class RunResult:
    """What a command run on the cluster left: merged output, exit code (None: stopped after its
    time limit) and wall time."""

    output: str
    returncode: Optional[int]
    seconds: float


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          check=check)


def check_privileges() -> None:
    """Raise ``ClusterUnavailable`` with one line saying why this machine cannot emulate nodes."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("emulated cluster needs root (network namespaces, veth, tc): "
                                 f"running as uid {os.geteuid()}")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"emulated cluster needs '{tool}' (iproute2 / util-linux), "
                                     "which is not on PATH")
    probe = f"hvaprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise ClusterUnavailable(f"emulated cluster: 'ip netns add' failed: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespace_pids(netns: str) -> list[int]:
    listed = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in listed.stdout.split() if p.strip().isdigit()]


def _kill_namespace(netns: str) -> int:
    """SIGKILL every process in the namespace, until none is left. Returns how many were seen."""
    seen: set[int] = set()
    for _ in range(50):
        pids = [p for p in _namespace_pids(netns) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            seen.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return len(seen)


def _teardown(prefix: str, nodes: Sequence[str], bridge: str, host_links: Sequence[str]) -> None:
    for netns in nodes:
        _kill_namespace(netns)
    for link in host_links:
        _ip("link", "del", link, check=False)  # takes its qdisc and its peer with it
    _ip("link", "del", bridge, check=False)
    for netns in nodes:
        _ip("netns", "del", netns, check=False)
        shutil.rmtree(NETNS_DIR / netns, ignore_errors=True)
    shutil.rmtree(STATE_ROOT / prefix, ignore_errors=True)


def _recorded(state: Path) -> tuple[list[str], str, list[str]]:
    nodes = (state / "nodes").read_text().split() if (state / "nodes").exists() else []
    bridge = f"{state.name}br"
    links = [f"{state.name}v{i}" for i in range(len(nodes))]
    return nodes, bridge, links


def clean_stale() -> list[str]:
    """Tear down clusters whose owning process is gone (a run killed with SIGKILL). Returns their
    prefixes."""
    cleaned = []
    if not STATE_ROOT.exists():
        return cleaned
    for state in sorted(STATE_ROOT.iterdir()):
        try:
            owner = int((state / "owner").read_text())
        except (OSError, ValueError):
            owner = -1
        if owner > 0 and _pid_alive(owner):
            continue
        nodes, bridge, links = _recorded(state)
        _teardown(state.name, nodes, bridge, links)
        cleaned.append(state.name)
    return cleaned


class StartedOrClosed:
    """A context manager for something started in parts (namespaces, daemons): ``__enter__``
    runs :meth:`_prepare` (checks, before anything exists), then :meth:`_start`; if starting
    fails half-way, :meth:`close` removes what was made before the error goes on. ``__exit__``
    closes."""

    def _prepare(self) -> None:
        """Checks made before anything is started (raise to refuse)."""

    def _start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._prepare()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Cluster(StartedOrClosed):
    """``nodes`` emulated nodes on one bridge; ``rate_mbit`` limits what each node receives
    (None: no limit). Use as a context manager; see the module docstring."""

    def __init__(self, nodes: int = 2, rate_mbit: Optional[float] = None, *,
                 burst_kbit: int = 2048):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
        if nodes > 200:
            raise ValueError(f"nodes must be <= 200 (one /24 subnet), got {nodes}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit!r}")
        self.prefix = f"hva{secrets.token_hex(3)}"  # 9 chars: interface names stay <= 15
        self.nodes = [f"{self.prefix}n{i}" for i in range(nodes)]
        self.addresses = [f"{SUBNET_PREFIX}.{i + 1}" for i in range(nodes)]
        self.subnet = f"{SUBNET_PREFIX}.0/24"
        self.bridge = f"{self.prefix}br"
        self.host_links = [f"{self.prefix}v{i}" for i in range(nodes)]
        self.rate_mbit = rate_mbit
        self.burst_kbit = burst_kbit
        self._state = STATE_ROOT / self.prefix
        self._shims: Optional[Path] = None
        self._previous_handlers: dict[int, object] = {}
        self._up = False

    @property
    def state_dir(self) -> Path:
        """This cluster's folder (removed at teardown): for what runs on it to keep state in."""
        return self._state

    # -- life cycle ------------------------------------------------------------------------

    def _prepare(self) -> None:
        check_privileges()
        clean_stale()
        self._install_signal_handlers()

    def _install_signal_handlers(self) -> None:
        def stop(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}: tearing the emulated cluster down")

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._previous_handlers[signum] = signal.signal(signum, stop)
            except ValueError:  # not the main thread: the caller's handlers stay
                pass

    def _start(self) -> None:
        self._state.mkdir(parents=True, exist_ok=True)
        (self._state / "owner").write_text(str(os.getpid()))
        (self._state / "nodes").write_text(" ".join(self.nodes))
        self._up = True
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {node}\n" for addr, node in zip(self.addresses, self.nodes))
        for index, (node, addr, link) in enumerate(zip(self.nodes, self.addresses, self.host_links)):
            _ip("netns", "add", node)
            (NETNS_DIR / node).mkdir(parents=True, exist_ok=True)
            (NETNS_DIR / node / "hosts").write_text(hosts)
            peer = f"{self.prefix}q{index}"  # renamed eth0 inside the node
            _ip("link", "add", link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", node)
            _ip("-n", node, "link", "set", peer, "name", "eth0")
            _ip("-n", node, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", node, "link", "set", "eth0", "up")
            _ip("-n", node, "link", "set", "lo", "up")
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
        if self.rate_mbit is not None:
            for index in range(len(self.nodes)):
                self.set_rate(index, self.rate_mbit)

    def close(self) -> None:
        """Stop every process on every node and remove everything this cluster created. A Ctrl-C
        or SIGTERM that arrives meanwhile (timeout(1) and a user both signal) waits until the
        teardown is done, then raises ``KeyboardInterrupt``: cut short, it left namespaces."""
        arrived: list[int] = []
        deferred = bool(self._previous_handlers) and \
            threading.current_thread() is threading.main_thread()
        if deferred:
            for signum in self._previous_handlers:
                signal.signal(signum, lambda signum, _frame: arrived.append(signum))
        try:
            if self._up:
                _teardown(self.prefix, self.nodes, self.bridge, self.host_links)
                self._up = False
            if self._shims is not None:
                shutil.rmtree(self._shims, ignore_errors=True)
                self._shims = None
        finally:
            if deferred:
                for signum, handler in self._previous_handlers.items():
                    signal.signal(signum, handler)
                self._previous_handlers.clear()
        if arrived:
            raise KeyboardInterrupt(f"signal {arrived[0]} during the emulated cluster's teardown")

    # -- the link ---------------------------------------------------------------------------

    def set_rate(self, node: int, rate_mbit: Optional[float]) -> None:
        """Limit what ``node`` receives to ``rate_mbit`` (None: remove the limit)."""
        link = self.host_links[node]
        if rate_mbit is None:
            subprocess.run(["tc", "qdisc", "del", "dev", link, "root"], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return
        subprocess.run(["tc", "qdisc", "replace", "dev", link, "root", "tbf",
                        "rate", f"{rate_mbit}mbit", "burst", f"{self.burst_kbit}kbit",
                        "latency", "50ms"], check=True)

    def cut_link(self, node: int) -> None:
        """Take ``node``'s link down: nothing reaches it or leaves it until :meth:`restore_link`."""
        _ip("link", "set", self.host_links[node], "down")

    def restore_link(self, node: int) -> None:
        _ip("link", "set", self.host_links[node], "up")

    def kill_node(self, node: int) -> int:
        """SIGKILL every process on ``node`` (a node lost). Returns how many processes it had."""
        return _kill_namespace(self.nodes[node])

    def pids(self, node: int) -> list[int]:
        return _namespace_pids(self.nodes[node])

    # -- running things -------------------------------------------------------------------

    def hosts_arg(self, slots_per_node: int | Sequence[int]) -> str:
        """``-H`` value for horovodrun/mpirun: ``n0:2,n1:2`` (or per-node slot counts)."""
        slots = ([slots_per_node] * len(self.nodes) if isinstance(slots_per_node, int)
                 else list(slots_per_node))
        return ",".join(f"{node}:{s}" for node, s in zip(self.nodes, slots) if s > 0)

    def shim_dir(self) -> Path:
        """A folder holding the ``ssh`` stand-in; put it first on PATH for horovodrun, or pass
        ``shim_dir()/'ssh'`` to ``mpirun --mca plm_rsh_agent``."""
        if self._shims is None:
            self._shims = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-shim-"))
            shim = self._shims / "ssh"
            shim.write_text(SSH_SHIM)
            shim.chmod(0o755)
        return self._shims

    def mpirun_args(self) -> list[str]:
        """OpenMPI options that start remote daemons through the shim and keep MPI traffic on
        the nodes' ``eth0`` subnet."""
        return ["--mca", "plm_rsh_agent", str(self.shim_dir() / "ssh"),
                "--mca", "btl_tcp_if_include", self.subnet,
                "--mca", "oob_tcp_if_include", self.subnet]

    def command_on(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``node``: in its namespace, with its host name."""
        name = self.nodes[node]
        return ["ip", "netns", "exec", name, "unshare", "--uts", "/bin/bash", "-c",
                'hostname "$0" && exec "$@"', name, *argv]

    def env(self, base: Optional[dict] = None, **extra: str) -> dict[str, str]:
        """``base`` (default: this environment) with the shim first on PATH."""
        env = dict(os.environ if base is None else base, **extra)
        env["PATH"] = f"{self.shim_dir()}:{env.get('PATH', '')}"
        return env

    def start(self, argv: Sequence[str], *, node: int = 0, env: Optional[dict] = None,
              cwd: Optional[str] = None) -> subprocess.Popen:
        """Start ``argv`` on ``node`` (its own session), output merged into a pipe."""
        return subprocess.Popen(self.command_on(node, argv), env=self.env(env), cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    def stop_everything(self) -> None:
        """SIGKILL every process on every node (the way a hung launch is stopped)."""
        for netns in self.nodes:
            _kill_namespace(netns)

    def run(self, argv: Sequence[str], *, node: int = 0, env: Optional[dict] = None,
            cwd: Optional[str] = None, timeout_s: float = 300) -> RunResult:
        """Run ``argv`` on ``node`` to the end; past ``timeout_s`` stop every process of the
        cluster (by namespace) and return ``returncode=None``."""
        start = time.monotonic()
        proc = self.start(argv, node=node, env=env, cwd=cwd)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            return RunResult(output, proc.returncode, time.monotonic() - start)
        except subprocess.TimeoutExpired:
            self.stop_everything()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            output, _ = proc.communicate()
            return RunResult(output, None, time.monotonic() - start)
        except BaseException:
            self.stop_everything()
            proc.kill()
            proc.communicate()
            raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=None)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--cleanup", action="store_true", help="only remove stale clusters")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="run on node 0; {hosts:N} becomes -H's value with N slots per node, "
                             "{mpi} the mpirun options, {subnet} the nodes' subnet")
    args = parser.parse_args()
    if args.cleanup:
        try:
            check_privileges()
        except ClusterUnavailable as error:
            print(error)
            return 1
        print("removed:", " ".join(clean_stale()) or "nothing")
        return 0
    command = [c for c in args.command if c != "--"]
    if not command:
        parser.error("give a command to run on node 0")
    try:
        with Cluster(args.nodes, args.rate_mbit) as cluster:
            expanded = []
            for word in command:
                if word.startswith("{hosts:") and word.endswith("}"):
                    expanded.append(cluster.hosts_arg(int(word[7:-1])))
                elif word == "{mpi}":
                    expanded.extend(cluster.mpirun_args())
                else:
                    expanded.append(word.replace("{subnet}", cluster.subnet))
            print(f"cluster {cluster.prefix}: nodes {' '.join(cluster.nodes)}", flush=True)
            result = cluster.run(expanded, timeout_s=args.timeout)
            print(result.output, end="")
            print(f"exit code {result.returncode} after {result.seconds:.1f} s")
            return result.returncode if result.returncode is not None else 124
    except ClusterUnavailable as error:
        print(error)
        return 1


if __name__ == "__main__":
    sys.exit(main())
