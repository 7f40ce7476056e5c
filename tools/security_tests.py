"""Security on the emulated cluster (tools/cluster.py), run by tools/run_tests.py.

For each documented launch (mpirun with the recommended Open MPI settings, ``horovodrun --gloo``
and elastic ``horovodrun --gloo``, each with the job's interface named), a small job holds still
(tests/security/listening_job.py) while every TCP socket that listens in every node's namespace
is listed with ``ss -ltnp``: each must be bound to that node's address on the job's interface
(``eth0``), none to every interface or to loopback, except Open MPI's own under mpirun, which
no setting pins (see ``MPI_BTL_PORTS``). In the elastic launch, a process on a node
outside the job then PUTs a crafted pickle to the rendezvous server and tries to read a worker's
registration (tests/security/rendezvous_attacker.py): the PUT must be answered 403 and run
nothing (its marker file stays absent), the read must find nothing, and the job must finish.

Before the launches, ``run_attacks`` sends the rendezvous attacks (a registration naming the
attacker's listener and key, one with 10^5 addresses, an oversized body, a PUT replacing the
function of function mode, a crafted pickle) to Horovod's elastic driver and key-value store on
loopback (tests/security/elastic_driver_harness.py), once with Horovod 0.28.1's released runner,
where each must run code or hurt, and once with the installed patched one, where each must be
refused and change nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import pickle
import re
import shlex
import signal
import socket
import struct
import subprocess
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

from cluster import Cluster
from cluster_tests import recommended_mca
from rank_output import test_launch_env
from slurm_cluster import SlurmCluster, SlurmUnavailable, check_slurm
from stage_log import StageLog

__all__ = ["listening_sockets", "exposed", "open_mpi_own", "released_runner_sources", "run_attacks",
           "run_key_off_command_lines", "task_keys_on_command_lines", "function_mode_problems",
           "run_function_mode", "run_all"]

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

def _release_and_wait(proc: subprocess.Popen, cluster: Cluster, tmp: Path, timeout_s: int,
                      problems: list[str]) -> str:
    """Let the held job go on (its ranks wait for ``tmp/probed``) and return its output; past
    ``timeout_s`` stop everything on the cluster and say so in ``problems``."""
    (tmp / "probed").write_text("")
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        cluster.stop_everything()
        output, _ = proc.communicate()
        problems.append(f"the job was still running after {timeout_s} s")
    return output

def _verdict(label: str, proc: subprocess.Popen, output: str, problems: list[str]) -> bool:
    """The held job must have ended well on both ranks; print every problem (and the job's
    output when there is one) and the stage's last line. True when nothing is wrong."""
    if proc.returncode != 0 or output.count("listening job ok") != 2:
        problems.append(f"the job ended with exit code {proc.returncode}, "
                        f"{output.count('listening job ok')} of 2 ranks ok")
    for problem in problems:
        print(f"    {problem}", flush=True)
    if problems:
        print(output[-6000:], flush=True)
    print(f"=== {'ok' if not problems else 'FAILED'}: {label}", flush=True)
    return not problems




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
                    if attack.get("put_status") != 403:  # no slot of the job's, no signature
                        problems.append(f"the crafted PUT was answered {attack.get('put_status')!r}, not 403")
                    if attack.get("get_status") != 404:
                        problems.append(f"reading a worker's registration gave "
                                        f"{attack.get('get_status')!r}, not 404")
        finally:
            output = _release_and_wait(proc, cluster, tmp, timeout_s, problems)
    if attack is not None:
        print(f"    crafted pickle from {cluster.nodes[2]}: {attack}", flush=True)
    return _verdict(label, proc, output, problems)


# --- The rendezvous attacks, at Horovod 0.28.1 as released and at the patched build ----------
#
# tests/security/elastic_driver_harness.py starts Horovod's elastic driver and function-mode
# key-value store on loopback, as horovodrun does; each attack below is sent to it twice: with
# the released 0.28.1 runner sources first on PYTHONPATH (the runner is pure Python; the sdist is
# downloaded once and cached beside the wheels), where it must run code or hurt, and with the
# installed patched runner, where it must be refused and change nothing.

HARNESS = ROOT / "tests" / "security" / "elastic_driver_harness.py"
HOROVOD_VERSION = "0.28.1"
MANY_ADDRESSES = 10 ** 5
OVERSIZED_BODY = 8 << 20  # bytes; the patched rendezvous takes at most 1 MiB
HURT_CONNECTIONS = 1000  # probe connections from one PUT within PROBE_WINDOW_S that count as harm
PROBE_WINDOW_S = 5.0


def released_runner_sources(python: Path) -> Path:
    """The folder holding Horovod 0.28.1's released ``horovod`` package (sdist), downloaded once
    with pip and cached under the wheel cache (tools/build_horovod.sh's ``HVD_CACHE``)."""
    cache = Path(os.environ.get("HVD_CACHE") or Path(os.environ.get(
        "XDG_CACHE_HOME", Path.home() / ".cache")) / "hvd_averaging") / "sdist"
    folder = cache / f"horovod-{HOROVOD_VERSION}"
    if not (folder / "horovod" / "runner" / "elastic" / "rendezvous.py").exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as work:
            subprocess.run([str(python), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"horovod=={HOROVOD_VERSION}", "-d", work], check=True,
                           capture_output=True, text=True)
            with tarfile.open(Path(work) / f"horovod-{HOROVOD_VERSION}.tar.gz") as archive:
                archive.extractall(work, filter="data")
            os.replace(Path(work) / f"horovod-{HOROVOD_VERSION}", folder)
    return folder


class _Harness:
    """The harness in its own process group, with its JSON line read."""

    def __init__(self, python: Path, pythonpath: Optional[Path]):
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath)
        self.proc = subprocess.Popen([str(python), "-u", str(HARNESS)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"harness did not start: {self.proc.stderr.read()[-2000:]}")
        self.info = json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def threads(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


class RunsCode:
    """A pickle whose loading creates ``marker`` (what an attacker's would do instead)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def http_put(port: int, path: str, body: bytes, headers_first: bool = False) -> object:
    """Status of a PUT to loopback ``port``, or the error's name. With ``headers_first`` the
    body is sent only when no answer came to the headers within 1 s (a server that caps bodies
    answers before reading one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        answer = b""
        if headers_first:
            sock.settimeout(1.0)
            try:
                answer = sock.recv(4096)
            except socket.timeout:
                pass
            sock.settimeout(30)
        if not answer:
            try:
                sock.sendall(body)
                answer = sock.recv(4096)
            except OSError as error:
                return type(error).__name__
        match = re.match(rb"HTTP/1\.[01] (\d+)", answer)
        return int(match.group(1)) if match else "connection dropped"


def http_get_length(port: int, path: str) -> object:
    """The length of what a GET returns, or its status."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as answer:
            return len(answer.read())
    except urllib.error.HTTPError as error:
        return error.code


class _Listener:
    """The attacker's listener: answers each connection as a Horovod service would (an HMAC'd
    Wire message), with ``answer`` signed by the attacker's key, and counts connections."""

    def __init__(self, key: bytes, answer: Optional[bytes]):
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=4096)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.key, self.answer = key, answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                if self.answer is not None:
                    digest = hmac.new(self.key, self.answer, hashlib.sha256).digest()
                    try:
                        conn.sendall(digest + struct.pack("i", len(self.answer)) + self.answer)
                    except OSError:
                        pass

    def close(self) -> None:
        self.sock.close()


def _wait(predicate, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _registration(addresses: dict, key: bytes) -> bytes:
    """A worker's registration body as Horovod 0.28.1's workers send it."""
    return base64.b64encode(pickle.dumps((addresses, key)))


def attack_key_put(harness: _Harness, tmp: Path) -> dict:
    """A PUT for the assigned slot naming the attacker's listener and key: 0.28.1's driver
    probes the listener with that key and unpickles its answer."""
    marker = tmp / "key-put-ran-code"
    key = os.urandom(32)
    listener = _Listener(key, pickle.dumps(RunsCode(marker)))
    try:
        status = http_put(harness.info["rendezvous_port"], "/worker_addresses/localhost:0",
                          _registration({"lo": [("127.0.0.1", listener.port)]}, key))
        _wait(marker.exists, 5.0)
        return {"status": status, "code_ran": marker.exists(), "probes": listener.connections}
    finally:
        listener.close()


def attack_many_addresses(harness: _Harness, tmp: Path) -> dict:
    """One PUT with 10^5 address pairs: 0.28.1's driver starts a probe thread for each."""
    key = os.urandom(32)
    listener = _Listener(key, None)
    try:
        body = _registration({"lo": [("127.0.0.1", listener.port)] * MANY_ADDRESSES}, key)
        before = harness.threads()
        result = {}
        putter = threading.Thread(target=lambda: result.update(status=http_put(
            harness.info["rendezvous_port"], "/worker_addresses/localhost:0", body, True)),
            daemon=True)
        putter.start()
        peak, deadline = before, time.monotonic() + PROBE_WINDOW_S
        while time.monotonic() < deadline:
            peak = max(peak, harness.threads())
            time.sleep(0.05)
        return {"status": result.get("status", "no answer within the window"),
                "body_bytes": len(body), "probe_connections": listener.connections,
                "threads_before": before, "threads_peak": peak}
    finally:
        listener.close()


def attack_oversized_body(harness: _Harness, tmp: Path) -> dict:
    """An 8 MiB body to a scope of the attacker's: 0.28.1 reads and keeps any size, forever."""
    port = harness.info["rendezvous_port"]
    status = http_put(port, "/attacker/blob", b"x" * OVERSIZED_BODY, headers_first=True)
    return {"status": status, "kept_bytes": http_get_length(port, "/attacker/blob")}


def attack_runfunc(harness: _Harness, tmp: Path) -> dict:
    """A PUT replacing the function of function mode (``horovod.run()``); then the read each
    worker does (``horovod.runner.run_task``)."""
    marker = tmp / "runfunc-ran-code"
    status = http_put(harness.info["kvstore_port"], "/runfunc/func",
                      base64.b64encode(pickle.dumps(RunsCode(marker))))
    read = harness.ask("read_func")
    return {"status": status, "worker_read": read, "code_ran": marker.exists()}


def attack_direct_pickle(harness: _Harness, tmp: Path) -> dict:
    """The original CVE-2024-10190: a registration body that is itself a crafted pickle."""
    marker = tmp / "direct-pickle-ran-code"
    status = http_put(harness.info["rendezvous_port"], "/worker_addresses/localhost:0",
                      base64.b64encode(pickle.dumps(RunsCode(marker))))
    _wait(marker.exists, 2.0)
    return {"status": status, "code_ran": marker.exists()}


def _harmed(name: str, result: dict) -> bool:
    """Whether ``result`` shows the attack ran code or hurt (what 0.28.1 must show)."""
    if name == "many addresses":
        return result["probe_connections"] >= HURT_CONNECTIONS or \
            result["threads_peak"] - result["threads_before"] >= HURT_CONNECTIONS
    if name == "oversized body":
        return result["status"] == 200 and result["kept_bytes"] == OVERSIZED_BODY
    return result["code_ran"]


def _refused(name: str, result: dict) -> bool:
    """Whether the patched build refused it and nothing happened."""
    quiet = {"key-carrying PUT": lambda: not result["code_ran"] and result["probes"] == 0,
             "many addresses": lambda: result["probe_connections"] == 0
             and result["threads_peak"] - result["threads_before"] < 10,
             "oversized body": lambda: result["kept_bytes"] == 404,
             "PUT to runfunc": lambda: not result["code_ran"]
             and result["worker_read"] == {"read": "function"},
             "direct pickle": lambda: not result["code_ran"]}[name]
    return result["status"] in (400, 403, 413) and quiet()


ATTACKS = [("key-carrying PUT", attack_key_put), ("many addresses", attack_many_addresses),
           ("oversized body", attack_oversized_body), ("PUT to runfunc", attack_runfunc),
           ("direct pickle", attack_direct_pickle)]


def legitimate_registrations(harness: _Harness) -> dict:
    """On the patched build: a registration signed with the job secret, naming a real worker
    notification service keyed as the patched worker keys it, is accepted (the driver's probe of
    it succeeds); one with 65 addresses or for a slot never assigned is not (the refusals are not
    blanket)."""
    from horovod.runner.common.util import secret
    from horovod.runner.elastic.worker import WorkerNotificationService

    key = bytes.fromhex(harness.info["secret"])
    port = harness.info["rendezvous_port"]
    service = WorkerNotificationService(secret.derive_key(key, "notification:localhost:0"), "lo",
                                        manager=None)

    def signed(slot: str, pairs: list) -> bytes:
        payload = pickle.dumps({"lo": pairs})
        label = f"worker_addresses/{slot}".encode()
        return base64.b64encode(hmac.new(key, label + b"\0" + payload, hashlib.sha256).digest()
                                + payload)
    try:
        return {"signed": http_put(port, "/worker_addresses/localhost:0",
                                   signed("localhost:0", service.addresses()["lo"])),
                "signed, 65 addresses": http_put(port, "/worker_addresses/localhost:0",
                                                 signed("localhost:0", [("127.0.0.1", 1)] * 65)),
                "signed, unassigned slot": http_put(port, "/worker_addresses/localhost:1",
                                                    signed("localhost:1", [("127.0.0.1", 1)]))}
    finally:
        service.shutdown()


def run_attacks(bin_dir: Path) -> bool:
    """Every attack against 0.28.1 as released (must harm) and the patched build (refused)."""
    label = "security: rendezvous attacks, Horovod 0.28.1 as released and patched"
    print(f"\n=== {label}", flush=True)
    python = bin_dir / "python"
    problems: list[str] = []
    builds = [("0.28.1 as released", released_runner_sources(python)), ("patched", None)]
    for build, pythonpath in builds:
        for name, attack in ATTACKS:
            with tempfile.TemporaryDirectory() as name_tmp:
                harness = _Harness(python, pythonpath)
                try:
                    if harness.info["patched"] != (pythonpath is None):
                        problems.append(f"{build}: the harness ran the wrong runner "
                                        f"(patched: {harness.info['patched']})")
                        continue
                    result = attack(harness, Path(name_tmp))
                finally:
                    harness.close()
            judged = _harmed(name, result) if pythonpath is not None else _refused(name, result)
            verdict = ("ran code or hurt" if pythonpath is not None else "refused") if judged else \
                ("DID NOT HARM (the test proves nothing)" if pythonpath is not None else "NOT REFUSED")
            print(f"    {build}: {name}: {verdict}: {result}", flush=True)
            if not judged:
                problems.append(f"{build}: {name}: {verdict}")
    harness = _Harness(python, None)
    try:
        legit = legitimate_registrations(harness)
    finally:
        harness.close()
    print(f"    patched: registrations with the job secret: {legit}", flush=True)
    if legit != {"signed": 200, "signed, 65 addresses": 400, "signed, unassigned slot": 403}:
        problems.append(f"patched: registrations with the job secret answered {legit}, not "
                        "200 / 400 / 403")
    for problem in problems:
        print(f"    {problem}", flush=True)
    print(f"=== {'ok' if not problems else 'FAILED'}: {label}", flush=True)
    return not problems


# --- No key on a command line ----------------------------------------------------------------

def task_keys_on_command_lines(cmdlines: list[list[str]]) -> list[Optional[bytes]]:
    """``settings.key`` as carried on each ``horovod.runner.task_fn`` command line (Horovod's
    interface probe passes its settings, base64 pickled, as the last argument)."""
    import cloudpickle  # Horovod's own dependency; these are our job's own command lines

    keys = []
    for argv in cmdlines:
        if "horovod.runner.task_fn" in argv and len(argv) >= 4:
            settings = cloudpickle.loads(base64.b64decode(argv[-1]))
            keys.append(getattr(settings, "key", None))
    return keys


def _all_cmdlines() -> list[list[str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if raw:
                found.append([part.decode(errors="replace") for part in raw.rstrip(b"\0").split(b"\0")])
    return found


def run_key_off_command_lines(bin_dir: Path, timeout_s: int) -> bool:
    """``horovodrun --gloo`` on 2 nodes without ``--network-interface``, so that Horovod probes
    the hosts' interfaces with its HMAC-authenticated task services: every process's command line
    on the machine is read every 20 ms during the launch; the probe's tasks must carry no key
    (``settings.key`` is None on their command line), no command line may hold
    ``HOROVOD_WORKER_SECRET=``, and the job must finish."""
    label = "security: no key on a command line (horovodrun --gloo, interfaces probed)"
    print(f"\n=== {label}", flush=True)
    problems: list[str] = []
    seen_tasks: dict[str, list[str]] = {}
    secret_words: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for argv in _all_cmdlines():
                if "horovod.runner.task_fn" in argv:
                    seen_tasks[" ".join(argv)] = argv
                secret_words.extend(word for word in argv if "HOROVOD_WORKER_SECRET=" in word)
            time.sleep(0.02)

    with tempfile.TemporaryDirectory() as name, Cluster(2) as cluster:
        tmp = Path(name)
        env = test_launch_env(HVA_PROBE_DIR=str(tmp))
        argv = [str(bin_dir / "horovodrun"), "--gloo", "-np", "2", "-H", cluster.hosts_arg([1, 1]),
                str(bin_dir / "python"), "-u", str(JOB)]
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        proc = cluster.start(argv, env=env, cwd=str(ROOT))
        try:
            if not _wait_for(tmp / "job.json", 120, proc):
                problems.append("the job never reached its probe point")
        finally:
            output = _release_and_wait(proc, cluster, tmp, timeout_s, problems)
            stop.set()
            watcher.join()
    keys = task_keys_on_command_lines(list(seen_tasks.values()))
    print(f"    interface-probe tasks seen: {len(keys)}; keys on their command lines: "
          f"{sum(key is not None for key in keys)}; command-line words holding "
          f"HOROVOD_WORKER_SECRET=: {len(secret_words)}", flush=True)
    if not keys:
        problems.append("no interface-probe task was seen (the probe did not run: nothing checked)")
    if any(key is not None for key in keys):
        problems.append("a probe task's command line carries the HMAC key")
    if secret_words:
        problems.append("a command line holds HOROVOD_WORKER_SECRET=")
    return _verdict(label, proc, output, problems)


FUNCTION_MODE_JOB = ROOT / "tests" / "security" / "function_mode_job.py"


def function_mode_problems(mode: str, answer: Optional[dict]) -> list[str]:
    """What is wrong in the answer of tests/security/function_mode_job.py (``None``: it printed
    no JSON line)."""
    if answer is None:
        return [f"function mode under {mode}: the job printed no result"]
    problems = []
    if answer.get("results") != [[0, 2, 1.0], [1, 2, 1.0]]:
        problems.append(f"function mode under {mode}: results {answer.get('results')}, not "
                        "[[0, 2, 1.0], [1, 2, 1.0]] (rank, size, allreduced sum of the ranks)")
    if not answer.get("secret_seen_in_a_worker"):
        problems.append(f"function mode under {mode}: no worker held HOROVOD_WORKER_SECRET, so "
                        "the command lines could not be checked for it")
    if answer.get("command_lines_with_secret"):
        problems.append(f"function mode under {mode}: the job secret is on command lines: "
                        f"{answer['command_lines_with_secret']}")
    return problems


def run_function_mode(bin_dir: Path, timeout_s: int) -> bool:
    """``horovod.run(fn)`` under mpirun and under Gloo on one host with the patched build: the
    results come back through the signed key-value store, and the job secret (by name under
    mpirun, on stdin under Gloo) is on no command line."""
    label = "security: function mode (horovod.run) under mpirun and Gloo"
    print(f"\n=== {label}", flush=True)
    problems: list[str] = []
    for mode in ("mpi", "gloo"):
        try:
            done = subprocess.run([str(bin_dir / "python"), str(FUNCTION_MODE_JOB), mode],
                                  cwd=ROOT, env=test_launch_env(), capture_output=True, text=True,
                                  timeout=timeout_s, start_new_session=True)
        except subprocess.TimeoutExpired:
            problems.append(f"function mode under {mode}: still running after {timeout_s} s")
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        answer = json.loads(lines[-1]) if lines and done.returncode == 0 else None
        print(f"    {mode}: exit code {done.returncode}, {answer}", flush=True)
        found = function_mode_problems(mode, answer)
        if found:
            print((done.stdout + done.stderr)[-4000:], flush=True)
        problems += found
    for problem in problems:
        print(f"    {problem}", flush=True)
    print(f"=== {'ok' if not problems else 'FAILED'}: {label}", flush=True)
    return not problems


def run_all(bin_dir: Path, timeout_s: int, log: StageLog) -> None:
    """Every security launch, recorded in ``log`` (the SLURM one as the SLURM stage is: skipped
    with HVA_SKIP_SLURM=1 where SLURM cannot run, failed with the reason otherwise)."""
    log.run("security: rendezvous attacks, 0.28.1 and patched", lambda: run_attacks(bin_dir))
    kinds = ["mpirun", "horovodrun --gloo", "elastic", "slurm"]
    try:
        check_slurm()
    except SlurmUnavailable as why:
        if os.environ.get("HVA_SKIP_SLURM") == "1":
            log.skip("security: listening sockets, slurm", f"HVA_SKIP_SLURM=1 and {why}")
            kinds.remove("slurm")
    for kind in kinds:
        log.run(f"security: listening sockets, {kind}", lambda: run_launch(kind, bin_dir, timeout_s))
    log.run("security: no key on a command line", lambda: run_key_off_command_lines(bin_dir, timeout_s))
    log.run("security: function mode under mpirun and Gloo",
            lambda: run_function_mode(bin_dir, timeout_s))
