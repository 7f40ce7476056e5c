"""Run the whole suite: the single-process tests first (a failure ends the run in seconds), then
multi-process runs under horovodrun (MPI and Gloo, 2 and 4 ranks), fault and recipe launches,
the emulated cluster, security, SLURM and the image; a stage that is skipped has a row saying
why.

Each multi-process run is one pytest session per rank over ``tests/multiprocess``; a failure on
any rank fails the run (horovodrun exits non-zero) and that rank's output is shown. A run that
exceeds its time limit (a hung collective) is killed and reported as a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cluster_tests
import security_tests
import slurm_tests
from rank_output import EVERY_TEST_RUNS_FROM_RANKS, rank_summaries, suite_passed, test_launch_env
from rank_records import TIMEOUT_ERRORS, read_accounts
from stage_log import StageLog

from hvd_averaging.examples.methods import DEFAULT_METHODS

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def multiprocess_runs() -> list[tuple[str, list[str], dict[str, str]]]:
    # Gloo at 4 ranks runs on the emulated cluster (2 nodes x 2), where the node-aware stages
    # are real; on one host it repeated MPI's 4-rank coverage (61 s of make test).
    runs = [(f"{controller} np={np}",
             [f"--{controller}", "-np", str(np), "-H", f"localhost:{np}"], {})
            for controller, np in (("mpi", 2), ("mpi", 4), ("gloo", 2))]
    # Horovod initialized by the user without dynamic process sets
    runs.append(("mpi np=4 static process sets", ["--mpi", "-np", "4", "-H", "localhost:4"],
                 {"HVA_TEST_INIT": "static", "HVA_TEST_FILES": "tests/multiprocess/static"}))
    # hva.init(group_sizes=[2]): the pairs registered at start-up, no dynamic process sets
    for controller in ("mpi", "gloo"):
        runs.append((f"{controller} np=4 groups registered at start-up",
                     [f"--{controller}", "-np", "4", "-H", "localhost:4"],
                     {"HVA_TEST_INIT": "group_sizes",
                      "HVA_TEST_FILES": "tests/multiprocess/registered_at_start"}))
    return runs


def launch(cmd: list[str], env: dict[str, str], timeout_s: int):
    """Run a launch in its own process group, output merged; past ``timeout_s`` SIGKILL that
    group (Horovod's per-rank middlemen, in sessions of their own, stop their ranks when the
    launcher dies). Returns (output, exit code or None when killed)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return output, proc.returncode
    except BaseException as error:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output, _ = proc.communicate()
        if not isinstance(error, subprocess.TimeoutExpired):
            raise  # Ctrl-C or SIGTERM: the launch is stopped, and so is the run
        return output, None


def run_multiprocess(label: str, launcher_args: list[str], extra_env: dict[str, str],
                     timeout_s: int) -> bool:
    expected_ranks = int(launcher_args[launcher_args.index("-np") + 1])
    env = test_launch_env(**extra_env)
    env["PYTHONPATH"] = str(ROOT / "tests" / "multiprocess")
    files = extra_env.get("HVA_TEST_FILES")
    targets = [files] if files else ["tests/multiprocess", "--ignore=tests/multiprocess/static",
                                     "--ignore=tests/multiprocess/registered_at_start"]
    cmd = [str(BIN / "horovodrun"), *launcher_args, str(BIN / "python"), "-m", "pytest", "-q",
           "-p", "no:cacheprovider", "--color=no", "--rootdir", str(ROOT / "tests" / "multiprocess"),
           "-o", "testpaths=", *targets]
    print(f"\n=== multi-process: {label}: {' '.join(cmd[1:])}", flush=True)
    start = time.monotonic()
    output, rc = launch(cmd, env, timeout_s)
    elapsed = time.monotonic() - start
    summaries = rank_summaries(output)
    ok = suite_passed(output, rc, expected_ranks)
    if not ok:
        print(output, flush=True)  # every rank's output, prefixed by horovodrun with [rank]
        reported = "; ".join(f"rank {rank}: {line}" for rank, line in summaries) or "none"
        reason = (f"killed after {timeout_s} s (hung collective?)" if rc is None
                  else f"exit code {rc}, pytest summaries ({expected_ranks} expected; a skip "
                       f"fails from {EVERY_TEST_RUNS_FROM_RANKS} ranks on): {reported}")
        print(f"=== FAILED: {label}: {reason}", flush=True)
    else:
        for rank, line in summaries:
            print(f"rank {rank}: {line}", flush=True)
        print(f"=== ok: {label} ({elapsed:.0f} s)", flush=True)
    return ok


def run_entrypoint_check(timeout_s: int) -> bool:
    """The Docker image's ``--check`` path, run outside Docker on this machine."""
    env = test_launch_env(PYTHON=str(BIN / "python"), PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    print("\n=== docker/entrypoint.sh --check (outside Docker)", flush=True)
    try:
        proc = subprocess.run(["bash", "docker/entrypoint.sh", "--check"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"=== FAILED: entrypoint --check killed after {timeout_s} s", flush=True)
        return False
    ok = proc.returncode == 0 and "smoke test on 2 ranks over MPI: ok" in proc.stdout
    print(proc.stdout if not ok else proc.stdout.strip().splitlines()[-1], flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: entrypoint --check", flush=True)
    return ok


def report_accounts(label: str, out: str, rc, elapsed: float, accounts: dict,
                    problems: list[str]) -> bool:
    """Print every rank's account and the problems (the launch's output too when there are
    any); True when there are none."""
    ok = not problems
    if not ok:
        print(out, flush=True)
    print(f"    job ended with exit code {rc} after {elapsed:.1f} s", flush=True)
    for line in [*map(str, accounts.values()), *problems]:
        print(f"    {line[:400]}", flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {label} ({elapsed:.0f} s)", flush=True)
    return ok


FAULT_RUNS = [("mpi", 3, 8), ("mpi", 4, 9), ("gloo", 3, 9), ("gloo", 4, 8)]  # die-at 8 fires
FAULT_BOUND_S = 60


def run_rank_death(controller: str, np: int, die_at: int) -> bool:
    """A rank exits mid-training: the job must stop, non-zero, within FAULT_BOUND_S seconds;
    rank 1's record says it died at ``die_at`` and every other rank accounts for itself (a named
    error, the watchdog, or the launcher's SIGTERM with the place it was ended), none completed."""
    import tempfile
    label = f"rank death: {controller} np={np}, rank 1 exits at step {die_at} " \
            f"({'firing' if die_at % 4 == 0 else 'non-firing'})"
    with tempfile.TemporaryDirectory() as records:
        cmd = [str(BIN / "horovodrun"), f"--{controller}", "-np", str(np), "-H", f"localhost:{np}",
               str(BIN / "python"), "tests/faults/rank_dies.py", "--die-at", str(die_at),
               "--record-dir", records]
        print(f"\n=== {label}: {' '.join(cmd[1:])}", flush=True)
        start = time.monotonic()
        out, rc = launch(cmd, test_launch_env(HVA_TIMEOUT_SECONDS="20",
                                              HVA_WATCHDOG_RECORD_DIR=records), FAULT_BOUND_S)
        elapsed = time.monotonic() - start
        accounts = read_accounts(Path(records), np)
    problems = [] if rc is not None else [f"still running after {FAULT_BOUND_S} s (a hang)"]
    if rc == 0:
        problems.append("the launcher exited 0")
    dead = accounts[1]
    if dead.how != "exits on purpose" or dead.step != die_at:
        problems.append(f"rank 1 should have exited on purpose at step {die_at}: {dead}")
    for rank, account in accounts.items():
        if rank == 1:
            continue
        if account.how == "raised" and account.record["error_type"] not in TIMEOUT_ERRORS:
            problems.append(f"{account}: not a timeout or Horovod's error: "
                            f"{account.record['error_message']}")
        elif account.how not in ("raised", "watchdog", "signal"):
            problems.append(f"does not account for itself: {account}")
    return report_accounts(label, out, rc, elapsed, accounts, problems)


SETUP_STALL_BOUND_S = 30  # timeout 3 s + the watchdog's grace 2 s + the launcher's reaction


def run_setup_stall() -> bool:
    """A process-set registration only rank 0 makes: the job ends within SETUP_STALL_BOUND_S,
    non-zero; rank 0's watchdog record names the registration and the timeout (at 390992b it
    waited forever), rank 1 was ended by the launcher where it waited."""
    import tempfile
    label = "set-up stall: mpi np=2, rank 0 registers a process set alone"
    timeout_s = 3
    print(f"\n=== {label}", flush=True)
    with tempfile.TemporaryDirectory() as records:
        cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", str(BIN / "python"),
               "tests/faults/setup_stall.py", "--record-dir", records]
        start = time.monotonic()
        out, rc = launch(cmd, test_launch_env(HVA_TIMEOUT_SECONDS=str(timeout_s),
                                              HVA_WATCHDOG_RECORD_DIR=records),
                         SETUP_STALL_BOUND_S + 30)
        elapsed = time.monotonic() - start
        accounts = read_accounts(Path(records), 2)
    problems = [] if rc not in (0, None) and elapsed <= SETUP_STALL_BOUND_S else \
        [f"exit code {rc} after {elapsed:.1f} s (bound {SETUP_STALL_BOUND_S} s)"]
    stalled, waiting = accounts[0], accounts[1]
    # by meaning: the watchdog names the call it ended and the timeout it allowed
    if stalled.how != "watchdog" or "registering process set [0]" not in stalled.detail \
            or f"HVA_TIMEOUT_SECONDS={timeout_s}" not in stalled.detail:
        problems.append(f"rank 0 should be ended by the watchdog naming the registration: {stalled}")
    if waiting.how not in ("signal", "watchdog"):
        problems.append(f"rank 1 does not account for itself: {waiting}")
    return report_accounts(label, out, rc, elapsed, accounts, problems)


ELASTIC_BATCHES = 41  # tests/faults/elastic_shrink.py's


def elastic_shrink_problems(records: Path) -> list[str]:
    """The final world's records (tests/faults/elastic_shrink.py): 3 ranks, each with the
    averagers' and wrappers' steps equal to the batch count and the hierarchy refit to 3 ranks,
    and the parameters, DiLoCo's parameters and global copies and the wrappers' parameters
    bit-identical across the ranks (the last step, 40, averages at every averager)."""
    found = {int(p.stem.rsplit("rank", 1)[1]): json.loads(p.read_text())
             for p in records.glob("final-rank*.json")}
    if sorted(found) != [0, 1, 2]:
        return [f"records from final ranks {sorted(found)}, expected [0, 1, 2]"]
    problems = []
    for rank, r in sorted(found.items()):
        if (r["size"], r["averager_step"], r["diloco_step"]) != (3, ELASTIC_BATCHES, ELASTIC_BATCHES):
            problems.append(f"rank {rank}: size {r['size']}, steps {r['averager_step']}/"
                            f"{r['diloco_step']} (expected 3, {ELASTIC_BATCHES})")
        if r["levels"] != {"2": 1, "4": 3} or r["resets"] < 1:
            problems.append(f"rank {rank}: levels {r['levels']}, resets {r['resets']}")
        if r.get("wrapper_steps") != [ELASTIC_BATCHES, ELASTIC_BATCHES]:
            problems.append(f"rank {rank}: PostLocalSGDOptimizer/PostLocalSGD steps "
                            f"{r.get('wrapper_steps')} (expected {ELASTIC_BATCHES} each)")
    for digest in ("parameters_digest", "outer_parameters_digest", "global_copy_digest",
                   "wrapper_parameters_digest"):
        if len({r[digest] for r in found.values()}) != 1:
            problems.append(f"{digest} differs across ranks")
    return problems


def run_elastic_shrink(timeout_s: int) -> bool:
    """4-rank elastic Gloo run that loses a worker at batch 10 (tests/faults/elastic_shrink.py)."""
    import tempfile
    label = "elastic gloo 4 -> 3 ranks"
    with tempfile.NamedTemporaryFile("w", suffix=".hosts", delete=False) as hosts:
        hosts.write("localhost:4\n")
    # --network-interface lo: without it the elastic driver's interface probe did not finish here
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", "4", "--min-np", "2", "--max-np", "4",
           "--network-interface", "lo", "--host-discovery-script",
           str(ROOT / "tests/faults/discover_hosts.sh"), str(BIN / "python"), "-u",
           "tests/faults/elastic_shrink.py"]
    print(f"\n=== {label}: {' '.join(cmd[1:])}", flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as records:
        try:
            out, rc = launch(cmd, test_launch_env(HVA_ELASTIC_HOSTS_FILE=hosts.name,
                                                  HVA_RECORD_DIR=records), timeout_s)
        finally:
            os.unlink(hosts.name)
        problems = elastic_shrink_problems(Path(records))
    if rc != 0:
        problems.insert(0, f"exit code {rc}")
    ok = not problems
    lines = [l for l in out.splitlines() if "averager step" in l and "resets" in l]
    print(out if not ok else "\n".join(lines), flush=True)
    for problem in problems:
        print(f"    {problem}", flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {label} ({time.monotonic() - start:.0f} s)", flush=True)
    return ok


RECIPE_WRAPPERS = ("PostLocalSGDOptimizer", "PostLocalSGD", "DiLoCo")


def recipe_problems(out: Path, ranks: int) -> list[str]:
    """What the per-rank verdicts of tests/recipes/horovod_mnist_recipe.py must show, phase by
    phase: the averager counted exactly the training steps (across the resume too), the LR
    scheduler on the wrapper drove the inner optimizer's lr, and every rank ended bit-identical."""
    problems = []
    for kind in RECIPE_WRAPPERS:
        for phase in ("first", "resume"):
            for rank in range(ranks):
                path = out / f"{kind}.{phase}.rank{rank}.json"
                if not path.exists():
                    problems.append(f"{path.name} missing")
                    continue
                v = json.loads(path.read_text())
                expected_steps = v["steps_per_epoch"] * v["epochs_done"]
                if not v["averager_step"] == v["state_dict_step"] == expected_steps:
                    problems.append(f"{path.name}: averager step {v['averager_step']} (state_dict "
                                    f"{v['state_dict_step']}), {expected_steps} training steps")
                if not math.isclose(v["inner_lr"], v["expected_lr"], rel_tol=1e-9):
                    problems.append(f"{path.name}: inner lr {v['inner_lr']}, the scheduler's "
                                    f"{v['expected_lr']}")
                if v["ranks_equal"] is not True:
                    problems.append(f"{path.name}: ranks differ after the last all-rank average")
    return problems


def run_horovod_recipe(timeout_s: int) -> bool:
    """Horovod's pytorch_mnist recipe on each wrapper, then its resume in a second launch."""
    import tempfile
    label = "Horovod's recipe on the wrappers: mpi np=4, train, then resume"
    print(f"\n=== {label}", flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as out:
        outputs, codes = [], []
        for phase in ("first", "resume"):
            cmd = [str(BIN / "horovodrun"), "-np", "4", "-H", "localhost:4", str(BIN / "python"),
                   "tests/recipes/horovod_mnist_recipe.py", "--phase", phase, "--out", out]
            output, rc = launch(cmd, test_launch_env(), timeout_s)
            outputs.append(output)
            codes.append(rc)
            if rc != 0:
                break
        problems = [f"launch exit codes {codes}"] if any(c != 0 for c in codes) else \
            recipe_problems(Path(out), 4)
    ok = not problems
    for problem in problems:
        print(f"    {problem}", flush=True)
    if not ok:
        print("\n".join(outputs)[-20000:], flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {label} ({time.monotonic() - start:.0f} s)", flush=True)
    return ok


def check_race_results(summary: dict, written: list[str]) -> list[str]:
    """What the race's fast mode must show; returns the problems found."""
    problems = []
    top = ("target_loss", "budget_s", "regime", "speedup_ceiling", "methods")
    fields = ("method", "label", "final_loss", "steps", "wall_s", "time_to_target_s",
              "speedup_vs_baseline", "fraction_of_ceiling", "run_ceiling",
              "fraction_of_run_ceiling", "compute_utilization",
              "compute_step_s", "cross_node_mb_per_rank", "speedup_at_60s", "seeds")
    problems += [f"results.json lacks {k!r}" for k in top if k not in summary]
    methods = summary.get("methods", [])
    problems += [f"{m.get('method')} lacks {k!r}" for m in methods for k in fields if k not in m]
    if problems:
        return problems
    if [m["method"] for m in methods] != list(DEFAULT_METHODS):
        problems.append(f"methods {[m['method'] for m in methods]}, expected {DEFAULT_METHODS}")
    for m in methods:
        for seed in m["seeds"]:
            curve = seed["curve"]
            if not curve[-1][-1] < curve[0][-1]:
                problems.append(f"{m['method']}: held-out loss did not go down "
                                f"({curve[0][-1]:.4f} -> {curve[-1][-1]:.4f})")
            # one host: no set spans nodes, so no way across a link was chosen
            if seed.get("routes_chosen") != {}:
                problems.append(f"{m['method']}: routes chosen {seed.get('routes_chosen')!r} on "
                                "one host (expected none)")
            if seed["steps"] < 2:
                problems.append(f"{m['method']}: {seed['steps']} steps")
            # compute per step: positive, and no more of it than the wall time holds
            if not 0 < seed["compute_step_s"] * seed["steps"] <= seed["wall_s"]:
                problems.append(f"{m['method']}: {seed['compute_step_s']} s of compute per step "
                                f"over {seed['steps']} steps in {seed['wall_s']:.1f} s")
            # a race shorter than two minutes has no "speed-up after the first minute"
            if seed["budget_s"] < 120 and seed["speedup_at_60s"] is not None:
                problems.append(f"{m['method']}: speedup_at_60s {seed['speedup_at_60s']} in a "
                                f"{seed['budget_s']:.0f} s race")
    baseline = methods[0]["seeds"][0]
    # the ceiling: the baseline's step in the race over the calibration's step of pure compute
    ceiling = baseline["wall_s"] / baseline["steps"] / summary["regime"]["compute_step_s"]
    if not math.isclose(summary["speedup_ceiling"], ceiling, rel_tol=1e-9) or not ceiling > 1:
        problems.append(f"speed-up ceiling {summary['speedup_ceiling']}, the baseline's step over "
                        f"the compute step gives {ceiling}")
    # per seed, both ceilings: the calibration's, and its own at the host's speed as it ran (its
    # baseline seed's step over the method's compute per step in that run)
    for m in methods:
        for seed, own_baseline in zip(m["seeds"], methods[0]["seeds"]):
            speedup = seed["speedup_vs_baseline"]
            expected = None if speedup is None else speedup / summary["speedup_ceiling"]
            if seed["fraction_of_ceiling"] != expected:
                problems.append(f"{m['method']}: fraction of the ceiling "
                                f"{seed['fraction_of_ceiling']}, its speed-up says {expected}")
            own = own_baseline["wall_s"] / own_baseline["steps"] / seed["compute_step_s"]
            fraction = None if speedup is None else speedup / own
            got = seed["fraction_of_run_ceiling"]
            agrees = got is None and fraction is None or None not in (got, fraction) and \
                math.isclose(got, fraction, rel_tol=1e-9)
            if not math.isclose(seed["run_ceiling"], own, rel_tol=1e-9) or not agrees:
                problems.append(f"{m['method']}: run ceiling {seed['run_ceiling']} and fraction "
                                f"{seed['fraction_of_run_ceiling']}, the baseline's step over the "
                                f"compute per step gives {own} and {fraction}")
    # the target is the baseline's own final held-out loss, read off its own curve
    if baseline["curve"][-1][-1] != summary["target_loss"]:
        problems.append(f"target {summary['target_loss']} is not the baseline's final "
                        f"{baseline['curve'][-1][-1]}")
    # its time to target: where its curve first crosses the target, between two points
    target, curve = summary["target_loss"], baseline["curve"]
    at = next(i for i, p in enumerate(curve) if p[-1] <= target)
    crossed = curve[at][0] if at == 0 else curve[at - 1][0] + (
        curve[at][0] - curve[at - 1][0]) * (curve[at - 1][-1] - target) / (
        curve[at - 1][-1] - curve[at][-1])
    if not math.isclose(baseline["time_to_target_s"], crossed, rel_tol=1e-9) \
            or not curve[max(at - 1, 0)][0] <= crossed <= curve[at][0]:
        problems.append(f"baseline's time to target {baseline['time_to_target_s']}, its curve "
                        f"says {crossed}")
    if sum(name.endswith(".png") for name in written) != 2 or "results.md" not in written:
        problems.append(f"written: {written}")
    return problems


def run_demo_fast(timeout_s: int) -> bool:
    """The main job's fast mode (the race, every default method) under horovodrun, one host."""
    import tempfile
    label = "demo fast mode: horovodrun -np 4 ... train --fast"
    print(f"\n=== {label}", flush=True)
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(BIN / "horovodrun"), "-np", "4", "-H", "localhost:4", str(BIN / "python"), "-m",
               "hvd_averaging.examples.train", "--fast", "--quiet", "--out", out]
        start = time.monotonic()
        output, rc = launch(cmd, test_launch_env(), timeout_s)
        written = sorted(p.name for p in Path(out).iterdir())
        summary = json.loads((Path(out) / "results.json").read_text()) \
            if "results.json" in written else {}
    problems = check_race_results(summary, written) if rc == 0 else [f"exit status {rc}"]
    table = [line.split("<stdout>:", 1)[-1] for line in output.splitlines() if "| " in line]
    ok = not problems
    for problem in problems:
        print(f"    {problem}", flush=True)
    print(output if not ok else "\n".join(table) + f"\nwrote {', '.join(written)}", flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {label} ({time.monotonic() - start:.0f} s)", flush=True)
    return ok


def run_docker_image(timeout_s: int) -> bool:
    """tools/docker_image.py: the CPU image built (podman or docker, offline from the
    wheelhouse; the layer cache makes it quick after the first time), then --check and the
    demo's fast mode inside a container."""
    label = "docker image: build, --check and demo --fast inside a container"
    print(f"\n=== {label}", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run([str(BIN / "python"), "tools/docker_image.py"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s, start_new_session=True)
        output, ok = proc.stdout, proc.returncode == 0
    except subprocess.TimeoutExpired as exc:
        output, ok = str(exc.stdout or ""), False
    if ok:
        output = "\n".join(line for line in output.splitlines()
                           if line.startswith(("=== ", "docker image timings", "| ")))
    print(output[-20000:], flush=True)
    print(f"=== {'ok' if ok else 'FAILED'}: {label} ({time.monotonic() - start:.0f} s)", flush=True)
    return ok


def run_unit_tests() -> bool:
    """The single-process tests (tests/unit): schedules, topology, validation, the tools."""
    print("\n=== unit tests: pytest -q tests/unit", flush=True)
    done = subprocess.run([str(BIN / "python"), "-m", "pytest", "-q", "tests/unit"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(done.stdout, flush=True)  # through the stage log, which keeps a failure's tail
    return done.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--multiprocess-only", action="store_true",
                        help="only the multi-process launches on this host (no cluster, no image, "
                        "no single-process tests)")
    parser.add_argument("--cluster-only", action="store_true",
                        help="only the multi-node launches on the emulated cluster")
    parser.add_argument("--slurm-only", action="store_true",
                        help="only the SLURM stage (make test-slurm)")
    parser.add_argument("--no-docker", action="store_true", help="skip building the image")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per multi-process run")
    args = parser.parse_args()
    log = StageLog()
    if not (args.multiprocess_only or args.cluster_only or args.slurm_only):
        # the pure-logic tests first: a failure there is known in seconds, not after the launches
        if not log.run("unit tests", run_unit_tests):
            print(f"\n{log.table()}\n{log.failure_report()}", flush=True)
            return 1
    if args.slurm_only:
        slurm_tests.run_all(BIN, args.timeout, log)
        print(f"\n{log.table()}\n{log.failure_report()}", flush=True)
        return 1 if log.failed() else 0
    if not args.cluster_only:
        for label, launcher_args, env in multiprocess_runs():
            log.run(label, lambda: run_multiprocess(label, launcher_args, env, args.timeout))
        for controller, np, die_at in FAULT_RUNS:
            log.run(f"rank death {controller} np={np} step {die_at}",
                    lambda: run_rank_death(controller, np, die_at))
        log.run("elastic gloo 4 -> 3", lambda: run_elastic_shrink(args.timeout))
        log.run("set-up stall", run_setup_stall)
        log.run("Horovod recipe, resume", lambda: run_horovod_recipe(args.timeout))
        log.run("entrypoint --check", lambda: run_entrypoint_check(args.timeout))
        log.run("demo fast mode", lambda: run_demo_fast(args.timeout))
    if not args.multiprocess_only:
        cluster_tests.run_all(BIN, args.timeout, log)
        security_tests.run_all(BIN, args.timeout, log)
    if not (args.cluster_only or args.multiprocess_only):
        slurm_tests.run_all(BIN, args.timeout, log)
    if not (args.cluster_only or args.multiprocess_only):
        if args.no_docker:
            log.skip("docker image", "--no-docker")
        else:
            log.run("docker image", lambda: run_docker_image(1800))
    failed = log.failed()
    print(f"\n{log.table()}\n", flush=True)
    print(f"stages: {len(log.stages) - len(failed)} passed, {len(failed)} failed, "
          f"{len(log.skipped)} skipped", flush=True)
    if failed:
        print(log.failure_report(), flush=True)
        print(f"failed stages: {failed}", flush=True)
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
