"""Multi-node launches on the emulated cluster (tools/cluster.py), run by tools/run_tests.py.

Suites: every rank runs pytest over ``tests/multiprocess`` (the averager suites) or
``tests/multinode`` (placement against host names, start-up registration, uneven nodes) on
2 emulated nodes joined by a rate-limited link, under horovodrun (MPI and Gloo, block placement)
and mpirun (round-robin placement, 3 + 1 ranks).

Faults, each its own cluster: the link between the nodes cut mid-training (MPI with sets
registered at start-up, MPI with dynamic sets, Gloo), a whole node lost, and a link too slow for
the timeout (then the same with a timeout sized to the link). Each checks how long the whole
job (launcher and every rank, on every node) took to be over, measured by the processes left
in the nodes' namespaces, and what the user saw.

Last, the fault soak's short version (tools/soak.py: an elastic job through 6 faults drawn at
random in 3.5 minutes, every kind once, links cut for 3x the timeout; ``make soak`` runs the
10-minute, 20-fault one).
"""

from __future__ import annotations

import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from cluster import Cluster
from rank_output import rank_summaries, suite_passed, test_launch_env
from rank_records import fault_problems, ranks_on, read_accounts
from stage_log import StageLog

__all__ = ["run_all"]

ROOT = Path(__file__).resolve().parent.parent
BIN = None  # set by run_all: the environment's bin folder
RATE_MBIT = 200
FAULT_TIMEOUT_S = 10  # HVA_TIMEOUT_SECONDS in the fault runs: the job must be over within 2x


def _python() -> str:
    return str(BIN / "python")


def _horovodrun(cluster: Cluster, controller: str, slots) -> list[str]:
    return [str(BIN / "horovodrun"), f"--{controller}", "-np", str(_count(slots)),
            "-H", cluster.hosts_arg(slots), "--network-interface", "eth0"]


def _mpirun(cluster: Cluster, slots, env: dict, *extra: str) -> list[str]:
    """mpirun across the cluster, exporting PATH, PYTHONPATH, OMP_NUM_THREADS and the HVA_ variables of ``env``
    (the environment it will run with) to every rank, as a real cluster needs."""
    names = [n for n in env if n in ("PATH", "PYTHONPATH", "OMP_NUM_THREADS") or n.startswith("HVA_")]
    exports = [arg for name in names for arg in ("-x", name)]
    return ["mpirun", *cluster.mpirun_args(), "--tag-output", "-np", str(_count(slots)),
            "-H", cluster.hosts_arg(slots), *extra, *exports]


def _count(slots) -> int:
    return slots * 2 if isinstance(slots, int) else sum(slots)


def _pytest(rootdir: str, targets: list[str]) -> list[str]:
    return [_python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no",
            "--rootdir", str(ROOT / rootdir), "-o", "testpaths=", *targets]


@dataclass
class SuiteRun:
    label: str
    launcher: str  # "horovodrun-mpi", "horovodrun-gloo", "mpirun-round-robin", "mpirun"
    slots: object  # ranks per node: an int, or a list per node
    rootdir: str
    targets: list[str]
    env: dict = field(default_factory=dict)


# Files that do not depend on where ranks sit run in the single-host launches only: Horovod's and
# PyTorch's recipes on the wrappers, what a timeout leaves, the settings agreement at init and
# one-shot int8 error feedback (the four together: 43 tests per rank, 85 s on the Gloo 2 x 2
# cluster at 0bae30a).
PLACEMENT_FREE = ["test_recipes.py", "test_timeout_integrity.py", "test_settings_agreement.py",
                  "test_one_shot_error_feedback.py"]
MULTIPROCESS_TARGETS = ["tests/multiprocess", "--ignore=tests/multiprocess/static",
                        "--ignore=tests/multiprocess/registered_at_start"] + [
                        f"--ignore=tests/multiprocess/{name}" for name in PLACEMENT_FREE]
# A suite's limit is a hang detector: the Gloo suite on 2 nodes x 2 ran past 300 s at 0bae30a
# (75% done, before PLACEMENT_FREE left the cluster suites), none of its tests hung.
SUITE_LIMIT_S = 600
PLACEMENT = ["tests/multinode/test_placement.py"]
START_UP = PLACEMENT + ["tests/multinode/test_start_up_registration.py"]

SUITES = [
    SuiteRun("averager suite, MPI, 2 nodes x 2 ranks, block", "horovodrun-mpi", 2,
             "tests/multiprocess", MULTIPROCESS_TARGETS),
    SuiteRun("averager suite, Gloo, 2 nodes x 2 ranks, block", "horovodrun-gloo", 2,
             "tests/multiprocess", MULTIPROCESS_TARGETS),
    SuiteRun("placement, MPI, block, hva.init(group_sizes=[2])", "horovodrun-mpi", 2,
             "tests/multinode", START_UP,
             {"HVA_TEST_INIT": "group_sizes", "HVA_TEST_GROUP_SIZE": "2",
              "HVA_TEST_PLACEMENT": "block"}),
    SuiteRun("placement, MPI, round-robin (mpirun --map-by node)", "mpirun-round-robin", 2,
             "tests/multinode", PLACEMENT, {"HVA_TEST_PLACEMENT": "round-robin"}),
    SuiteRun("placement, Gloo, block, hva.init(group_sizes=[2])", "horovodrun-gloo", 2,
             "tests/multinode", START_UP,
             {"HVA_TEST_INIT": "group_sizes", "HVA_TEST_GROUP_SIZE": "2",
              "HVA_TEST_PLACEMENT": "block"}),
    SuiteRun("uneven nodes 3 + 1, MPI", "mpirun", [3, 1], "tests/multinode",
             ["tests/multinode/test_uneven.py"], {"HVA_TEST_INIT": "uneven"}),
]


def run_suite(run: SuiteRun, timeout_s: int) -> bool:
    # helpers (fixtures, shared helpers) live in tests/multiprocess for both suites
    env = test_launch_env(PYTHONPATH=f"{ROOT / run.rootdir}:{ROOT / 'tests/multiprocess'}",
                     HVA_TEST_NODES="2", **run.env)
    with Cluster(2, RATE_MBIT) as cluster:
        if run.launcher.startswith("horovodrun"):
            argv = _horovodrun(cluster, run.launcher.split("-")[1], run.slots)
        else:
            extra = ("--map-by", "node") if run.launcher == "mpirun-round-robin" else ()
            argv = _mpirun(cluster, run.slots, env, *extra)
        argv += _pytest(run.rootdir, run.targets)
        print(f"\n=== multi-node: {run.label} ({RATE_MBIT} Mbit/s between nodes): "
              f"{' '.join(argv[1:6])} ...", flush=True)
        result = cluster.run(argv, env=env, cwd=str(ROOT), timeout_s=timeout_s)
    ok = suite_passed(result.output, result.returncode, _count(run.slots))
    if ok:
        for rank, line in rank_summaries(result.output):
            print(f"rank {rank}: {line}", flush=True)
    else:
        print(result.output, flush=True)
        print("killed after its time limit (a hang)" if result.returncode is None
              else f"exit code {result.returncode}", flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {run.label} ({result.seconds:.0f} s)", flush=True)
    return ok


# -- faults ----------------------------------------------------------------------------------

@dataclass
class FaultOutcome:
    output: str
    returncode: Optional[int]
    fault_at: Optional[float]  # seconds after start
    over_after_fault: Optional[float]  # until no process was left on any node
    checkpoint_dir: Path


def _run_with_fault(cluster: Cluster, argv: list[str], env: dict, trigger: str,
                    fault: Callable[[], None], limit_s: float,
                    checkpoint_dir: Path) -> FaultOutcome:
    """Start ``argv`` on node 0; when a line containing ``trigger`` appears, call ``fault``; then
    wait until no process is left on any node (or ``limit_s`` after the fault)."""
    start = time.monotonic()
    proc = cluster.start(argv, env=env, cwd=str(ROOT))
    lines: list[str] = []
    fault_at: list[float] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if not fault_at and trigger in line:
                fault()
                fault_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    over = None
    try:
        while True:
            now = time.monotonic()
            if fault_at and not any(cluster.pids(i) for i in range(len(cluster.nodes))):
                over = now - fault_at[0]
                break
            if (fault_at and now - fault_at[0] > limit_s) or now - start > limit_s + 120:
                cluster.stop_everything()
                break
            time.sleep(0.2)
    finally:
        cluster.stop_everything()
        proc.wait()
        reader.join(5)
    return FaultOutcome("".join(lines), proc.returncode,
                        fault_at[0] - start if fault_at else None, over, checkpoint_dir)


def _train_argv(checkpoint_dir: Path, *extra: str) -> list[str]:
    return [_python(), "-u", str(ROOT / "tests/faults/cluster_train.py"),
            "--checkpoint-dir", str(checkpoint_dir), *extra]


def _fault_env(records: Path) -> dict:
    """The fault timeout, and the watchdog's records beside the ranks' own."""
    return test_launch_env(HVA_TIMEOUT_SECONDS=str(FAULT_TIMEOUT_S),
                           HVA_WATCHDOG_RECORD_DIR=str(records))


def _fault_launch(cluster: Cluster, controller: str, checkpoints: Path, *extra: str):
    """argv and environment of cluster_train.py on 2 nodes x 2 ranks with the fault timeout."""
    env = _fault_env(checkpoints)
    argv = _mpirun(cluster, 2, env) if controller == "mpi" \
        else _horovodrun(cluster, "gloo", 2)
    return argv + _train_argv(checkpoints, *extra), env


def _report(label: str, ok: bool, outcome: FaultOutcome, notes: list[str]) -> bool:
    if not ok:
        print(outcome.output, flush=True)
    over = "never (stopped by the runner)" if outcome.over_after_fault is None \
        else f"{outcome.over_after_fault:.1f} s"
    print(f"    fault at {outcome.fault_at or 0:.1f} s; whole job over {over} after it; "
          f"launcher exit code {outcome.returncode}", flush=True)
    for note in notes:
        print(f"    {note}", flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {label}", flush=True)
    return ok


def _judge_fault(label: str, outcome: FaultOutcome, ranks: int, lost_node: Optional[str],
                 bound: float, every_rank_raises: bool = False) -> bool:
    """The job is over within ``bound`` seconds of the fault, non-zero, and the records show
    every rank off ``lost_node`` accounting for itself (:func:`fault_problems`)."""
    accounts = read_accounts(outcome.checkpoint_dir, ranks)
    lost = ranks_on(accounts, lost_node) if lost_node else set()
    problems = fault_problems(accounts, lost)
    if outcome.over_after_fault is None or outcome.over_after_fault > bound:
        problems.append(f"not over within {bound} s of the fault (2x the timeout)")
    if outcome.returncode in (0, None):
        problems.append(f"launcher exit code {outcome.returncode}")
    if every_rank_raises:
        # no dynamic-set coordination holds Horovod's table lock: every rank raises
        problems += [f"did not raise: {a}" for a in accounts.values() if a.how != "raised"]
    notes = [str(a)[:300] for a in accounts.values()]
    notes += [f"ranks on the lost node: {sorted(lost)}"] if lost_node else []
    return _report(label, not problems, outcome, notes + problems)


def run_cut_link(controller: str, start_up_sets: bool) -> bool:
    """The link to node 1 goes down at step 10 and stays down."""
    sets = "sets registered at start-up" if start_up_sets else "dynamic process sets"
    label = f"link between nodes cut mid-training, {controller.upper()}, {sets}"
    print(f"\n=== fault: {label} (HVA_TIMEOUT_SECONDS={FAULT_TIMEOUT_S})", flush=True)
    bound = 2 * FAULT_TIMEOUT_S
    with tempfile.TemporaryDirectory() as tmp, Cluster(2, RATE_MBIT) as cluster:
        checkpoints = Path(tmp)
        argv, env = _fault_launch(cluster, controller, checkpoints,
                                  *(["--group-sizes"] if start_up_sets else []))
        outcome = _run_with_fault(cluster, argv, env,
                                  "rank 0 step 10 ", lambda: cluster.cut_link(1), bound + 30,
                                  checkpoints)
        return _judge_fault(label, outcome, 4, None, bound, every_rank_raises=start_up_sets)


def run_node_lost(controller: str) -> bool:
    """Every process on node 1 is killed at step 10."""
    label = f"node 1 lost mid-training (every process on it killed), {controller.upper()}"
    print(f"\n=== fault: {label} (HVA_TIMEOUT_SECONDS={FAULT_TIMEOUT_S})", flush=True)
    bound = 2 * FAULT_TIMEOUT_S
    with tempfile.TemporaryDirectory() as tmp, Cluster(2, RATE_MBIT) as cluster:
        checkpoints = Path(tmp)
        argv, env = _fault_launch(cluster, controller, checkpoints)
        outcome = _run_with_fault(cluster, argv, env,
                                  "rank 0 step 10 ", lambda: cluster.kill_node(1), bound + 30,
                                  checkpoints)
        return _judge_fault(label, outcome, 4, cluster.nodes[1], bound)


def advice_problems(message: str, timeout_s: float, link_mbit: float) -> list[str]:
    """An ``AveragingTimeoutError`` on a link too slow for the timeout must say what to change,
    by meaning: the timeout it allowed, how to set another, and a link rate that would have done
    (faster than the link it had)."""
    problems = []
    if f"{timeout_s:g} s" not in message:
        problems.append(f"does not name the timeout ({timeout_s:g} s)")
    if "HVA_TIMEOUT_SECONDS" not in message or "set_timeout" not in message:
        problems.append("does not say how to set the timeout")
    rates = [float(r) for r in re.findall(r"(\d+(?:\.\d+)?) Mbit/s", message)]
    if not rates or max(rates) <= link_mbit:
        problems.append(f"names no link rate above the link's {link_mbit:g} Mbit/s: {rates}")
    return problems


def _slow_link_problems(accounts: dict, result, expect_pass: bool, steps: int, timeout_s: float,
                        rate: float) -> list[str]:
    """Passing: every rank completed every step. Failing: the job ended non-zero, the ranks that
    raised raised AveragingTimeoutError saying what to change, and every rank accounts for
    itself (read while the checkpoints are still there)."""
    problems = []
    if expect_pass:
        if result.returncode != 0:
            problems.append(f"exit code {result.returncode}")
        problems += [f"did not complete all {steps} steps: {a}" for a in accounts.values()
                     if a.how != "completed" or a.step != steps - 1]
    else:
        raised = [a for a in accounts.values() if a.how == "raised"]
        if result.returncode in (0, None) or not raised:
            problems.append(f"exit code {result.returncode}; ranks that raised: {len(raised)}")
        for account in raised:
            if account.record["error_type"] != "AveragingTimeoutError":
                problems.append(f"{account}: {account.record['error_message'][:200]}")
            else:
                problems += [f"rank {account.rank}'s error {p}" for p in advice_problems(
                    account.record["error_message"], timeout_s, rate)]
        problems += fault_problems(accounts, set())
    return problems


def run_slow_link() -> bool:
    """10 Mbit/s between nodes; averaging 4 MB takes longer than a 2 s timeout. The error must
    say what to change; with a timeout sized to the link the same run passes."""
    rate, numel, steps = 10, 1_000_000, 3
    ok_all = True
    for timeout_s, expect_pass in ((2, False), (60, True)):
        label = (f"slow link ({rate} Mbit/s), 4 MB model, HVA_TIMEOUT_SECONDS={timeout_s}: "
                 + ("passes" if expect_pass else "fails, saying what to change"))
        print(f"\n=== fault: {label}", flush=True)
        with tempfile.TemporaryDirectory() as tmp, Cluster(2, rate) as cluster:
            env = test_launch_env(HVA_TIMEOUT_SECONDS=str(timeout_s),
                                  HVA_WATCHDOG_RECORD_DIR=tmp)
            argv = _horovodrun(cluster, "mpi", 2) + _train_argv(
                Path(tmp), "--steps", str(steps), "--numel", str(numel), "--step-seconds", "0")
            result = cluster.run(argv, env=env, cwd=str(ROOT), timeout_s=4 * timeout_s + 120)
            accounts = read_accounts(Path(tmp), 4)
            problems = _slow_link_problems(accounts, result, expect_pass, steps, timeout_s, rate)
        ok = not problems
        if not ok:
            print(result.output, flush=True)
        said = next((a.record["error_message"] for a in accounts.values() if a.how == "raised"), "")
        print(f"    exit code {result.returncode} after {result.seconds:.1f} s", flush=True)
        for line in [*map(str, accounts.values()), *problems]:
            print(f"    {line[:300]}", flush=True)
        if said:
            print(f"    the error says: ...{said[said.find('Moving its'):][:230]}", flush=True)
        print(f"=== {'ok' if ok else 'FAILED'}: {label}", flush=True)
        ok_all = ok_all and ok
    return ok_all


def _run_elastic(label: str, nodes: int, first_hosts: list[str], script: str, np_range: str,
                 marker: str, timeout_s: int) -> bool:
    """An elastic Gloo job on ``nodes`` nodes whose hosts file starts as ``first_hosts``
    (``NODE_INDEX:SLOTS``); the script changes it and asserts on every rank (exit code 0)."""
    print(f"\n=== {label}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, Cluster(nodes, RATE_MBIT) as cluster:
        hosts = Path(tmp) / "hosts"
        hosts.write_text("".join(f"{cluster.nodes[int(i)]}:{slots}\n"
                                 for i, slots in (h.split(":") for h in first_hosts)))
        env = test_launch_env(HVA_ELASTIC_HOSTS_FILE=str(hosts), HVA_ELASTIC_NODES=",".join(cluster.nodes))
        min_np, max_np = np_range.split("-")
        argv = [str(BIN / "horovodrun"), "--gloo", "-np", max_np, "--min-np", min_np, "--max-np",
                max_np, "--network-interface", "eth0", "--host-discovery-script",
                str(ROOT / "tests/faults/discover_hosts.sh"), _python(), "-u", str(ROOT / script)]
        result = cluster.run(argv, env=env, cwd=str(ROOT), timeout_s=timeout_s)
    ok = result.returncode == 0 and marker in result.output
    lines = [line for line in result.output.splitlines() if marker in line or ": size " in line]
    print(result.output if not ok else "\n".join(lines), flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {label} ({result.seconds:.0f} s)", flush=True)
    return ok


def run_elastic_nodes(timeout_s: int) -> bool:
    """Gloo elastic on 3 nodes: node 1 leaves at batch 10, node 2 joins at batch 30."""
    return _run_elastic("elastic Gloo across nodes: a node leaves (4 -> 2 ranks), a node joins "
                        "(2 -> 4)", 3, ["0:2", "1:2"], "tests/faults/elastic_nodes.py", "2-4",
                        "elastic nodes ok", timeout_s)


def run_elastic_replace(timeout_s: int) -> bool:
    """Gloo elastic on 5 nodes of one rank: node 3's worker is replaced by one on node 4."""
    return _run_elastic("elastic Gloo: one worker replaced by another, 4 ranks before and after",
                        5, ["0:1", "1:1", "2:1", "3:1"], "tests/faults/elastic_replace.py", "4-4",
                        "elastic replace ok", timeout_s)


MCA_PARAMS_FILE = ROOT / "docker" / "openmpi-mca-params.conf"


def recommended_mca() -> list[str]:
    """``--mca NAME VALUE`` for every setting of docker/openmpi-mca-params.conf: the file the
    image installs and docs/launch.md recommends, used here as users would pass it."""
    args = []
    for line in MCA_PARAMS_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, value = (part.strip() for part in line.split("=", 1))
            args += ["--mca", name, value]
    return args


def run_head_node(fault: str) -> bool:
    """mpirun on a head node that runs no rank (node 0), 2 ranks on each of nodes 1 and 2, the
    recommended Open MPI settings; at step 10 node 2's link is cut or node 2 dies."""
    label = f"mpirun on a head node, node 2 {'cut off' if fault == 'cut' else 'lost'} mid-training"
    print(f"\n=== fault: {label} (HVA_TIMEOUT_SECONDS={FAULT_TIMEOUT_S})", flush=True)
    bound = 2 * FAULT_TIMEOUT_S
    with tempfile.TemporaryDirectory() as tmp, Cluster(3, RATE_MBIT) as cluster:
        checkpoints = Path(tmp)
        env = _fault_env(checkpoints)
        argv = _mpirun(cluster, [0, 2, 2], env, *recommended_mca()) + _train_argv(checkpoints)
        trigger = (lambda: cluster.cut_link(2)) if fault == "cut" else (lambda: cluster.kill_node(2))
        outcome = _run_with_fault(cluster, argv, env, "rank 0 step 10 ", trigger, bound + 60,
                                  checkpoints)
        return _judge_fault(label, outcome, 4, cluster.nodes[2] if fault == "lost" else None,
                            bound)


def run_soak_short() -> bool:
    """The fault soak (tools/soak.py, ``make soak``) in 3.5 minutes through 6 faults, a new seed
    each time (printed, with the per-fault records): the shuffled bag draws each kind once where
    it can happen. A link stays cut for 3x the timeout, so that recovery within 2x the timeout
    shows the job does not wait for the link to return."""
    import secrets
    from soak import passed, run_soak
    label = ("fault soak, short: 6 faults in 3.5 minutes (links cut for 3x the timeout), "
             "elastic Gloo on 4 nodes")
    print(f"\n=== {label}", flush=True)
    with tempfile.TemporaryDirectory() as out:
        summary = run_soak(BIN, Path(out), minutes=3.5, faults=6, seed=secrets.randbelow(2**31),
                           cut_factor=3)
        ok = passed(summary, 6)
        if not ok:
            print((Path(out) / "launcher.log").read_text()[-20000:], flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {label}", flush=True)
    return ok


def run_all(bin_dir: Path, timeout_s: int, log: StageLog) -> None:
    """Every multi-node launch, recorded in ``log``; a machine that cannot emulate nodes fails
    them with its reason."""
    global BIN
    BIN = bin_dir
    from cluster import ClusterUnavailable, check_privileges
    try:
        check_privileges()
    except ClusterUnavailable as error:
        print(f"\n=== multi-node: cannot run here: {error}", flush=True)
        log.run("multi-node (emulated cluster)", lambda: False)
        return
    for run in SUITES:
        log.run(run.label, lambda: run_suite(run, max(timeout_s, SUITE_LIMIT_S)))
    log.run("cut link, MPI, start-up sets", lambda: run_cut_link("mpi", start_up_sets=True))
    log.run("cut link, MPI, dynamic sets", lambda: run_cut_link("mpi", start_up_sets=False))
    log.run("cut link, Gloo", lambda: run_cut_link("gloo", start_up_sets=False))
    log.run("node lost, MPI", lambda: run_node_lost("mpi"))
    log.run("node lost, Gloo", lambda: run_node_lost("gloo"))
    log.run("head-node mpirun, link cut", lambda: run_head_node("cut"))
    log.run("head-node mpirun, node lost", lambda: run_head_node("lost"))
    log.run("slow link", run_slow_link)
    log.run("elastic across nodes", lambda: run_elastic_nodes(timeout_s))
    log.run("elastic same-size replacement", lambda: run_elastic_replace(timeout_s))
    log.run("fault soak, short", run_soak_short)
