"""The SLURM stage of ``make test`` (``make test-slurm`` alone): a real SLURM (munged, slurmctld,
a slurmd per node) on 3 emulated nodes, node 0 the login and controller node, nodes 1 and 2 the
compute nodes with 2 CPUs each. Jobs are submitted as a user would, from node 0:

- ``sbatch examples/slurm/train.sbatch`` (2 nodes x 2 tasks) must reach COMPLETED, its output
  land where the recipe says, and every rank's node group be the ranks on its SLURM node;
- the same training with ``srun`` directly;
- faults: the link to node 2 cut mid-job, node 2 killed (slurmd and tasks) mid-job: the job
  ends within 2x the library's timeout with a final SLURM state, and checkpoints load;
- ``scancel`` of a running job: every rank gone within 30 s;
- too many tasks per node for the hierarchy: ``ValueError`` naming the placement on every rank.

Each job's final SLURM state is printed. Without root or SLURM's packages the stage fails with
one line saying why, unless ``HVA_SKIP_SLURM=1``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from cluster import Cluster, ClusterUnavailable, check_privileges
from rank_output import test_launch_env
from rank_records import fault_problems, ranks_on, read_accounts
from slurm_cluster import SlurmCluster, SlurmUnavailable, check_slurm
from stage_log import StageLog

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RATE_MBIT = 200
# The library's timeout in the fault jobs. SLURM declares a silent node down after SlurmdTimeout
# (FAULT_TIMEOUT_S + 2 here: the ranks name the cause first) plus up to a third of it between
# pings, then ends the job: 2x the timeout leaves room for that only from about 20 s on (at 10 s
# the job ended 15-24 s after the fault, depending on the machine's load).
FAULT_TIMEOUT_S = 20
RECIPE = ROOT / "examples" / "slurm" / "train.sbatch"
SRUN_MPI = ["--mpi=pmix"]  # how srun starts MPI ranks here (see docs/launch.md)


def _scratch() -> tempfile.TemporaryDirectory:
    """A folder every node sees (each node has a /tmp of its own, as real nodes do)."""
    base = ROOT / "results" / "slurm"
    base.mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(dir=base)


def _env(**extra: str) -> dict[str, str]:
    """The submitting user's environment: the venv first on PATH (sbatch exports it)."""
    env = test_launch_env(**extra)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env["HVD_AVERAGING_VENV"] = str(BIN.parent)
    return env


def _submit(slurm: SlurmCluster, argv: list[str], env: dict) -> int:
    result = slurm.run(["sbatch", "--parsable", *argv], env=env, cwd=str(ROOT), timeout_s=30)
    found = re.match(r"\s*(\d+)", result.output)
    if result.returncode != 0 or not found:
        raise RuntimeError(f"sbatch failed ({result.returncode}): {result.output[-1500:]}")
    return int(found.group(1))


def _say(label: str, ok: bool, notes: list[str], output: str = "") -> bool:
    if not ok and output:
        print(output[-6000:], flush=True)
    for note in notes:
        print(f"    {note}", flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {label}", flush=True)
    return ok


def _placement_ok(out_dir: Path) -> tuple[bool, str]:
    import json
    path = out_dir / "placement.json"
    if not path.exists():
        return False, f"no {path}"
    ranks = json.loads(path.read_text())["ranks"]
    groups = {r["rank"]: (r["slurmd_nodename"], r["node_group"]) for r in ranks}
    # judged here from every rank's facts: the library's node group of each rank is exactly the
    # ranks SLURM put on its node, and every rank ended with the same parameters
    on_node: dict = {}
    for r in ranks:
        on_node.setdefault(r["slurm_nodeid"], []).append(r["rank"])
    follow = all(sorted(r["node_group"]) == sorted(on_node[r["slurm_nodeid"]]) for r in ranks)
    equal = len({r["checksum"] for r in ranks}) == 1
    ok = follow and equal and sorted(groups) == [0, 1, 2, 3] and len(on_node) == 2
    return ok, (f"rank -> (SLURM node, the library's node group): {groups}; groups follow "
                f"SLURM's nodes: {follow}; parameters equal: {equal}")


def run_sbatch_recipe(slurm: SlurmCluster) -> bool:
    label = "SLURM: sbatch examples/slurm/train.sbatch, 2 nodes x 2 tasks"
    print(f"\n=== {label}", flush=True)
    with _scratch() as tmp:
        out = Path(tmp)
        start = time.monotonic()
        job = _submit(slurm, ["--nodes=2", "--ntasks-per-node=2", f"--chdir={out}", str(RECIPE)],
                      _env(HVA_OUT=str(out)))
        state = slurm.wait_for_job(job, 300)
        seconds = time.monotonic() - start
        logs = sorted(out.glob("slurm-*.out"))
        output = "\n".join(p.read_text() for p in logs)
        placed, groups = _placement_ok(out / f"results-{job}")
    ok = state == "COMPLETED" and placed and bool(logs)
    return _say(label, ok, [f"job {job}: final state {state} after {seconds:.1f} s",
                            f"output: {[p.name for p in logs]}", groups], output)


def run_srun_direct(slurm: SlurmCluster) -> bool:
    label = "SLURM: srun directly (no batch script), 2 nodes x 2 tasks"
    print(f"\n=== {label}", flush=True)
    with _scratch() as tmp:
        out = Path(tmp)
        result = slurm.run(["srun", *SRUN_MPI, "--nodes=2",
                            "--ntasks-per-node=2", str(BIN / "python"), "-u",
                            str(ROOT / "examples/slurm/train.py"), "--out", str(out)],
                           env=_env(), cwd=str(ROOT), timeout_s=300)
        placed, groups = _placement_ok(out)
    ok = result.returncode == 0 and placed
    return _say(label, ok, [f"srun exit status {result.returncode} after {result.seconds:.1f} s",
                            groups], result.output)


def run_too_many_tasks(slurm: SlurmCluster) -> bool:
    """3 tasks per node, node level fixed at 2: groups of 2 cannot be made of whole nodes."""
    label = "SLURM: 3 tasks per node for a node level of 2 (bad input)"
    print(f"\n=== {label}", flush=True)
    with _scratch() as tmp:
        result = slurm.run(["srun", *SRUN_MPI, "--nodes=2", "--ntasks-per-node=3", "--overcommit",
                            str(BIN / "python"), "-u", str(ROOT / "examples/slurm/train.py"),
                            "--node-group-size", "2", "--out", tmp],
                           env=_env(), cwd=str(ROOT), timeout_s=120)
        records = [json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json")]
    raised = {r["rank"] for r in records if r.get("error_type") == "ValueError"}
    # by meaning: the error names the group size asked for, the placement, and the node sizes
    unclear = [r["rank"] for r in records
               if not re.search(r"group size 2 .*placement.*node sizes: \{.*: 3, .*: 3\}",
                                r.get("error_message", ""))]
    ok = result.returncode not in (0, None) and raised == set(range(6)) and not unclear
    message = records[0].get("error_message", "") if records else ""
    return _say(label, ok, [f"srun exit status {result.returncode}; ranks whose record says "
                            f"ValueError: {sorted(raised)}; messages not naming the placement: "
                            f"{unclear}", f"the message: {message.strip()[:300]}"],
                result.output)


def _fault_job(slurm: SlurmCluster, out: Path, steps: int) -> int:
    env = _env(HVA_TIMEOUT_SECONDS=str(FAULT_TIMEOUT_S), HVA_WATCHDOG_RECORD_DIR=str(out))
    # no --kill-on-bad-exit: the surviving ranks must get to name the cause and checkpoint
    command = " ".join(["srun", *SRUN_MPI, str(BIN / "python"), "-u",
                        str(ROOT / "tests/faults/cluster_train.py"), "--checkpoint-dir", str(out),
                        "--steps", str(steps)])
    return _submit(slurm, ["--nodes=2", "--ntasks-per-node=2", f"--chdir={out}",
                           f"--output={out}/job.out", "--wrap", command], env)


def _wait_for_line(path: Path, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def _task_pids(slurm: SlurmCluster) -> list[int]:
    """Processes of the job's tasks left on the compute nodes (the daemons excluded)."""
    pids = []
    for node in range(1, len(slurm.cluster.nodes)):
        for pid in slurm.cluster.pids(node):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "cluster_train.py" in command:
                pids.append(pid)
    return pids


def _wait_over(slurm: SlurmCluster, job: int, since: float, limit_s: float) -> tuple[str, float]:
    """Until the job has a final state and no task is left; (state, seconds after ``since``)."""
    from slurm_cluster import FINAL_STATES
    state = slurm.job_state(job)
    while time.monotonic() - since < limit_s:
        state = slurm.job_state(job)
        if state in FINAL_STATES and not _task_pids(slurm):
            break
        time.sleep(0.3)
    return state, time.monotonic() - since


def run_fault(slurm: SlurmCluster, fault: str) -> bool:
    label = {"cut": "SLURM: the link to node 2 cut mid-job",
             "kill": "SLURM: node 2 killed mid-job (slurmd and tasks)"}[fault]
    print(f"\n=== {label} (HVA_TIMEOUT_SECONDS={FAULT_TIMEOUT_S})", flush=True)
    bound = 2 * FAULT_TIMEOUT_S
    with _scratch() as tmp:
        out = Path(tmp)
        job = _fault_job(slurm, out, 400)
        started = _wait_for_line(out / "job.out", "rank 0 step 10 ", 120)
        if not started:
            return _say(label, False, [f"job {job} never reached step 10: {slurm.job_state(job)}"],
                        (out / "job.out").read_text() if (out / "job.out").exists() else "")
        fault_at = time.monotonic()
        if fault == "cut":
            slurm.cluster.cut_link(2)
        else:
            slurm.cluster.kill_node(2)
        state, over = _wait_over(slurm, job, fault_at, bound + 60)
        output = (out / "job.out").read_text(errors="replace")
        accounts = read_accounts(out, 4)
        # judged while the checkpoints are still there
        lost = ranks_on(accounts, slurm.cluster.nodes[2]) if fault == "kill" else set()
        problems = fault_problems(accounts, lost)
    # Every rank off a killed node accounts for itself in its record (tools/rank_records.py):
    # it raised and checkpointed, the watchdog ended it (a rank blocked inside Horovod when MPI's
    # peer is gone mid-transfer), or a SIGTERM did (Open MPI aborting a peer of a rank that
    # exited, or SLURM ending the job), the traceback saying where. When slurmd dies with its
    # node, slurmctld learns it within seconds; when the link is cut, within SlurmdTimeout of
    # its last answered ping, which can come before the library's timeout (seen in a
    # fresh-clone make test: NODE_FAIL 18-22 s after the cut). Then SLURM, not a rank, names the
    # cause, in the job's state (NODE_FAIL), and every surviving rank was stopped by a signal.
    if state not in ("FAILED", "NODE_FAIL", "TIMEOUT") or over > bound:
        problems.append(f"final state {state} {over:.1f} s after the fault (bound {bound} s)")
    return _say(label, not problems,
                [f"job {job}: final state {state}; every task gone {over:.1f} s after the fault "
                 f"(bound {bound} s)", *(str(a)[:300] for a in accounts.values()),
                 f"ranks on the killed node: {sorted(lost)}", *problems], output)


def run_scancel(slurm: SlurmCluster) -> bool:
    label = "SLURM: scancel of a running job"
    print(f"\n=== {label}", flush=True)
    with _scratch() as tmp:
        out = Path(tmp)
        job = _fault_job(slurm, out, 100_000)
        if not _wait_for_line(out / "job.out", "rank 0 step 10 ", 120):
            return _say(label, False, [f"job {job} never reached step 10: {slurm.job_state(job)}"])
        cancelled_at = time.monotonic()
        slurm.run(["scancel", str(job)], timeout_s=30)
        state, over = _wait_over(slurm, job, cancelled_at, 60)
    ok = state == "CANCELLED" and over <= 30
    return _say(label, ok, [f"job {job}: final state {state}; every task gone {over:.1f} s after "
                            "scancel (bound 30 s)"])


def run_all(bin_dir: Path, timeout_s: int, log: StageLog) -> None:
    """The SLURM stage: every check above, on one SLURM cluster per check group."""
    global BIN
    BIN = bin_dir
    try:
        check_privileges()
        check_slurm()
    except (ClusterUnavailable, SlurmUnavailable) as why:
        if os.environ.get("HVA_SKIP_SLURM") == "1":
            log.skip("SLURM", f"HVA_SKIP_SLURM=1 and {why}")
            return
        print(f"\n=== SLURM stage cannot run here: {why} (HVA_SKIP_SLURM=1 to skip it)", flush=True)
        log.run("SLURM (cannot run here)", lambda: False)
        return
    with Cluster(3, RATE_MBIT) as nodes, SlurmCluster(nodes) as slurm:
        log.run("SLURM sbatch recipe", lambda: run_sbatch_recipe(slurm))
        log.run("SLURM srun", lambda: run_srun_direct(slurm))
        log.run("SLURM bad input", lambda: run_too_many_tasks(slurm))
        log.run("SLURM scancel", lambda: run_scancel(slurm))
    # faults break the cluster they happen on: a fresh one for each
    for fault in ("cut", "kill"):
        # SLURM declares a silent node down after SlurmdTimeout: above the library's timeout,
        # so that the ranks name the cause before SLURM ends the job
        with Cluster(3, RATE_MBIT) as nodes, \
                SlurmCluster(nodes, slurmd_timeout_s=FAULT_TIMEOUT_S + 2) as slurm:
            log.run(f"SLURM fault: {fault}", lambda: run_fault(slurm, fault))
