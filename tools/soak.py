"""The fault soak: an elastic Horovod job on the emulated cluster that keeps training through
faults drawn at random, and the judgement of every recovery from the workers' own records.

``make soak`` runs it for at least 10 minutes through 20 faults; ``make test`` runs a 3.5-minute,
6-fault version with links cut for 3x the timeout (the stage "fault soak, short"). The job is ``tests/faults/soak_train.py`` under
``horovodrun --gloo`` on 4 emulated nodes of one worker each (``--min-np 2``), with a host
discovery script that lists the nodes this driver keeps in a hosts file, and a blacklist
cooldown of 1-2 s, so that a node whose worker died comes back by itself.

Faults (:data:`FAULT_KINDS`), drawn from a seeded ``random.Random`` (the seed is recorded) as a
shuffled bag, so that every kind comes up once per six draws where it can happen:

- ``rank_killed``: SIGKILL one worker (any node); Horovod blacklists its host for the cooldown,
  then starts a worker there again;
- ``node_lost``: every process on a node (not the launcher's) killed, and the node dropped from
  the discovery list;
- ``link_cut``: a node's link taken down for 1.5x the timeout and the node dropped from the
  discovery list (a health check would), its worker left running behind the cut;
- ``link_slowed``: what a node receives limited to 2 Mbit/s for 10-20 s (the job goes on);
- ``rank_stalled``: one worker stopped (SIGSTOP) for 0.5x or 1.5x the timeout, then continued;
- ``worker_added_back``: a node dropped earlier listed again (Horovod starts a worker there),
  after any process left on it is killed (``leftovers_killed`` in the record).

Removals keep at least ``min_np`` + 1 workers before the fault. After each fault the driver waits
until the job is whole again (a world with one worker per listed node that has committed) and
judges the fault from the records (:func:`judge_fault`): the parameters bit-identical across the
ranks of every world that started (at its start, after Horovod's sync) and at every batch where
all of them averaged; no committed batch lost (each new world resumes from the last batch the
world before it committed); the first commit after the fault within 2x the timeout of the end of
the fault's disruption. ``OUT/faults.json`` holds one record per fault, ``OUT/summary.json`` and
the last line printed the summary: ``soak: faults injected N / survived N / steps lost N /
longest recovery X s``.

Command line::

    python tools/soak.py --minutes 10 --faults 20 --out results/soak [--seed S] [--timeout 15]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["FAULT_KINDS", "REMOVING_KINDS", "FaultDraw", "FaultBag", "feasible_kinds",
           "read_events", "worlds", "world_problems", "judge_fault", "final_problems", "summarize",
           "summary_line", "run_soak"]

ROOT = Path(__file__).resolve().parent.parent
FAULT_KINDS = ("rank_killed", "node_lost", "link_cut", "link_slowed", "rank_stalled",
               "worker_added_back")
REMOVING_KINDS = ("rank_killed", "node_lost", "link_cut")  # the world loses a worker
SLOW_RATE_MBIT = 2
RATE_MBIT = 200
# HVA_TIMEOUT_SECONDS (and Horovod's HOROVOD_GLOO_TIMEOUT_SECONDS) of the job. A cut link's
# recovery is the timeout, the patched driver's 3 s grace before it stops waiting for the worker
# behind the cut, then the new rendezvous (19.8-20.6 s measured at 15 s); a worker added back
# needs 10-17 s to start Python, torch and Horovod on 2 shared cores: the 2x bound needs a
# timeout of about 10 s or more.
SOAK_TIMEOUT_S = 15


# -- drawing faults (pure) ----------------------------------------------------------------------

def feasible_kinds(world_size: int, min_np: int, removable_nodes: int,
                   absent_nodes: int, kinds: Sequence[str] = FAULT_KINDS) -> list[str]:
    """The kinds that can happen now: a removal only while the world keeps more than ``min_np``
    workers after it and (for a node) a node other than the launcher's is in it; adding back
    only while a node is absent."""
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown or not kinds:
        raise ValueError(f"fault kinds must be a non-empty selection of {list(FAULT_KINDS)}, "
                         f"got {list(kinds)}")
    feasible = []
    for kind in kinds:
        if kind in REMOVING_KINDS and world_size - 1 < min_np:
            continue
        if kind in ("node_lost", "link_cut") and removable_nodes < 1:
            continue
        if kind == "worker_added_back" and absent_nodes < 1:
            continue
        feasible.append(kind)
    return feasible


@dataclass
class FaultDraw:
    """One drawn fault: its kind, the node it targets (index) and its length in seconds (0: at
    once)."""

    kind: str
    node: int
    seconds: float


class FaultBag:
    """Fault kinds drawn from a seeded shuffled bag: each refill is a permutation of
    :data:`FAULT_KINDS`; a draw takes the first kind left in the bag that can happen now."""

    def __init__(self, seed: int, kinds: Sequence[str] = FAULT_KINDS):
        self.rng = random.Random(seed)
        self.kinds = tuple(kinds)
        self._bag: list[str] = []

    def draw(self, *, members: Sequence[int], present: Sequence[int], absent: Sequence[int],
             min_np: int, timeout_s: float, launcher_node: int = 0,
             cut_factor: float = 1.5) -> FaultDraw:
        """``members``: nodes with a worker in the current world; ``present``: nodes listed for
        discovery; ``absent``: nodes dropped by earlier faults."""
        if not members:
            raise ValueError(f"no fault can be drawn for a world with no workers (members "
                             f"{list(members)}, absent {list(absent)})")
        removable = [n for n in members if n != launcher_node]
        kinds = feasible_kinds(len(members), min_np, len(removable), len(absent), self.kinds)
        if not any(kind in kinds for kind in self._bag):
            self._bag = list(self.kinds)
            self.rng.shuffle(self._bag)
        kind = next(k for k in self._bag if k in kinds)
        self._bag.remove(kind)
        if kind in ("rank_killed", "rank_stalled"):
            node = self.rng.choice(sorted(members))
        elif kind == "link_slowed":
            node = self.rng.choice(sorted(present))
        elif kind == "worker_added_back":
            node = self.rng.choice(sorted(absent))
        else:
            node = self.rng.choice(sorted(removable))
        seconds = {"link_cut": cut_factor * timeout_s,
                   "link_slowed": self.rng.uniform(10, 20),
                   "rank_stalled": self.rng.choice((0.5, 1.5)) * timeout_s}.get(kind, 0.0)
        return FaultDraw(kind, node, round(seconds, 2))


# -- the records (pure) -------------------------------------------------------------------------

def read_events(folder: Path) -> list[dict]:
    """Every whole line of every worker's record in ``folder``, by time (a line cut short by a
    kill is skipped)."""
    events = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(events, key=lambda e: e["time"])


@dataclass
class World:
    """One Horovod world (between two resets) as the records show it."""

    token: str
    size: int
    started_at: float
    start_batch: Optional[int] = None
    starts: list = field(default_factory=list)  # start events
    commits: dict = field(default_factory=dict)  # batch -> list of commit events

    @property
    def last_batch(self) -> Optional[int]:
        return max(self.commits) if self.commits else None

    def first_commit_after(self, moment: float) -> Optional[float]:
        times = [e["time"] for events in self.commits.values() for e in events
                 if e["time"] >= moment]
        return min(times) if times else None


def worlds(events: Sequence[dict]) -> dict[str, World]:
    """The worlds in ``events``, by token, in the order they started."""
    found: dict[str, World] = {}
    for event in events:
        token = event.get("world")
        if token is None:
            continue
        if event["event"] == "start":
            world = found.setdefault(token, World(token, event["size"], event["time"]))
            world.starts.append(event)
            world.started_at = min(world.started_at, event["time"])
        elif event["event"] == "commit" and token in found:
            found[token].commits.setdefault(event["batch"], []).append(event)
    for world in found.values():
        batches = {e["batch"] for e in world.starts}
        world.start_batch = min(batches)
    return dict(sorted(found.items(), key=lambda item: item[1].started_at))


def world_problems(world: World) -> list[str]:
    """What is wrong in one world: ranks that started from different batches or parameters, a
    rank seen twice, or ranks whose parameters differ at a batch where they all averaged."""
    problems = []
    ranks = [e["rank"] for e in world.starts]
    if len(set(ranks)) != len(ranks):
        problems.append(f"world {world.token}: rank started twice: {sorted(ranks)}")
    if len({e["batch"] for e in world.starts}) > 1:
        problems.append(f"world {world.token}: ranks resumed from different batches "
                        f"{sorted({e['batch'] for e in world.starts})}")
    if len({e["digest"] for e in world.starts}) > 1:
        problems.append(f"world {world.token}: parameters differ across ranks at the start "
                        f"(batch {world.start_batch}), after the sync")
    for batch, commits in sorted(world.commits.items()):
        digests = {e["digest"] for e in commits if e.get("digest") is not None}
        if len(digests) > 1:
            problems.append(f"world {world.token}: parameters differ across ranks after the "
                            f"all-rank average of batch {batch}")
        if len({e["pid"] for e in commits}) != len(commits):
            problems.append(f"world {world.token}: batch {batch} committed twice by one worker")
    return problems


def judge_fault(fault: dict, events: Sequence[dict], window_end: float, bound_s: float) -> dict:
    """The fault's record, completed from the workers' events: ``fault`` holds ``kind``,
    ``injected_at`` and ``disrupted_until`` (when the fault's condition ended). Adds
    ``worlds`` (the worlds started from the injection to ``window_end``), ``steps_lost``,
    ``recovery_s`` (from ``disrupted_until`` to the first commit after it, in a world started
    after the injection when there is one), ``since_injection_s`` (the same commit from the
    injection), ``problems`` and ``survived``."""
    all_worlds = list(worlds(events).values())
    injected, until = fault["injected_at"], fault["disrupted_until"]
    new = [w for w in all_worlds if injected < w.started_at <= window_end]
    before = [w for w in all_worlds if w.started_at <= injected]
    problems: list[str] = []
    steps_lost = 0
    for world in new:
        # the world before it: the last one that committed before it started
        earlier = [w for w in all_worlds if w.started_at < world.started_at and w.commits
                   and min(e["time"] for c in w.commits.values() for e in c) < world.started_at]
        if earlier:
            previous = earlier[-1]
            committed = max(b for b, c in previous.commits.items()
                            if min(e["time"] for e in c) < world.started_at)
            if world.start_batch < committed:
                steps_lost += committed - world.start_batch
                problems.append(f"world {world.token} resumed from batch {world.start_batch}, "
                                f"world {previous.token} had committed batch {committed}")
            elif world.start_batch > committed + 1:
                # one ahead is a commit saved whose record line the fault cut off (Horovod's
                # commit() saves, then checks for host changes, a collective)
                problems.append(f"world {world.token} resumed from batch {world.start_batch}, "
                                f"past world {previous.token}'s last commit ({committed})")
    for world in (before[-1:] if before else []) + new:
        problems += world_problems(world)
    recovered_at = None
    if new:
        commits = [t for t in (w.first_commit_after(max(until, w.started_at)) for w in new)
                   if t is not None]
        recovered_at = min(commits) if commits else None
    elif before:
        recovered_at = before[-1].first_commit_after(until)
    recovery = None if recovered_at is None else round(recovered_at - until, 2)
    over = None if recovered_at is None else round(recovered_at - injected, 2)
    if recovery is None:
        problems.append(f"no commit after the fault (until {window_end - until:.1f} s after it)")
    elif recovery > bound_s:
        problems.append(f"first commit {recovery:.1f} s after the fault, over {bound_s:g} s "
                        "(2x the timeout)")
    return {**fault, "worlds": [{"token": w.token, "size": w.size, "start_batch": w.start_batch,
                                 "ranks_started": len(w.starts),
                                 "started_s": round(w.started_at - injected, 2)} for w in new],
            "steps_lost": steps_lost, "recovery_s": recovery, "since_injection_s": over,
            "problems": problems,
            "survived": not problems}


def final_problems(ends: Sequence[dict], workers: int) -> list[str]:
    """The ``end`` events of the last world: one per listed node, all at the same batch with
    bit-identical parameters (the stop is taken right after an all-rank average)."""
    problems = []
    if len(ends) != workers or len({e["world"] for e in ends}) != 1:
        problems.append(f"{len(ends)} workers ended training ({workers} listed), in worlds "
                        f"{sorted({e['world'] for e in ends})}")
    if len({e["digest"] for e in ends}) > 1 or len({e["batch"] for e in ends}) > 1:
        ended = [(e["host"], e["batch"], e["digest"]) for e in ends]
        problems.append(f"the final world's ranks ended differently: {ended}")
    return problems


def summarize(records: Sequence[dict]) -> dict:
    """Totals over the per-fault records."""
    recoveries = [r["recovery_s"] for r in records if r["recovery_s"] is not None]
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    return {"faults_injected": len(records),
            "faults_survived": sum(1 for r in records if r["survived"]),
            "steps_lost": sum(r["steps_lost"] for r in records),
            "longest_recovery_s": max(recoveries) if recoveries else None,
            "kinds": kinds}


def summary_line(summary: dict) -> str:
    longest = summary["longest_recovery_s"]
    return (f"soak: faults injected {summary['faults_injected']} / survived "
            f"{summary['faults_survived']} / steps lost {summary['steps_lost']} / longest "
            f"recovery {'none' if longest is None else f'{longest:.1f} s'}")


# -- the run ------------------------------------------------------------------------------------

class Soak:
    """The job on the cluster, the hosts file and the faults."""

    def __init__(self, cluster, out: Path, timeout_s: float, min_np: int, bin_dir: Path):
        self.cluster = cluster
        self.out = out
        self.timeout_s = timeout_s
        self.min_np = min_np
        self.bin = bin_dir
        self.records = out / "records"
        self.hosts_file = out / "hosts"
        self.present = list(range(len(cluster.nodes)))
        self.absent: list[int] = []
        self.proc = None
        self.leftovers_killed = 0  # processes the last worker_added_back found on its node
        self.log = None
        self.copier = None

    def write_hosts(self) -> None:
        text = "".join(f"{self.cluster.nodes[n]}:1\n" for n in sorted(self.present))
        aside = self.hosts_file.with_suffix(".partial")
        aside.write_text(text)
        os.replace(aside, self.hosts_file)

    def start(self) -> None:
        from rank_output import test_launch_env
        self.records.mkdir(parents=True, exist_ok=True)
        self.write_hosts()
        env = test_launch_env(HVA_ELASTIC_HOSTS_FILE=str(self.hosts_file),
                              HVA_SOAK_DIR=str(self.out), HVA_TIMEOUT_SECONDS=f"{self.timeout_s:g}",
                              HOROVOD_GLOO_TIMEOUT_SECONDS=f"{self.timeout_s:g}")
        nodes = len(self.cluster.nodes)
        argv = [str(self.bin / "horovodrun"), "--gloo", "-np", str(nodes), "--min-np",
                str(self.min_np), "--max-np", str(nodes), "--network-interface", "eth0",
                "--blacklist-cooldown-range", "1", "2", "--host-discovery-script",
                str(ROOT / "tests/faults/discover_hosts.sh"),
                str(self.bin / "python"), "-u", str(ROOT / "tests/faults/soak_train.py")]
        self.proc = self.cluster.start(argv, env=env, cwd=str(ROOT))
        self.log = open(self.out / "launcher.log", "w")
        self.copier = threading.Thread(target=self._copy_output, daemon=True)
        self.copier.start()

    def _copy_output(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()

    def events(self) -> list[dict]:
        return read_events(self.records)

    def current(self) -> tuple[Optional[World], list[dict]]:
        events = self.events()
        found = list(worlds(events).values())
        return (found[-1] if found else None), events

    def node_of(self, host: str) -> int:
        return self.cluster.nodes.index(host)

    def wait_whole(self, limit_s: float, since: float = 0.0) -> Optional[World]:
        """Wait until the latest world has one live worker per listed node and has committed
        after ``since`` (a wall-clock time); None after ``limit_s`` or when the launcher ended."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            world, _ = self.current()
            if world is not None and world.size == len(self.present) == len(world.starts) \
                    and {self.node_of(e["host"]) for e in world.starts} == set(self.present) \
                    and all(_alive(e["pid"]) for e in world.starts) \
                    and world.first_commit_after(since) is not None:
                return world
            time.sleep(0.5)
        return None

    def inject(self, draw: FaultDraw, world: World) -> tuple[float, float]:
        """Make the fault happen; returns (injected_at, disrupted_until) as wall-clock times."""
        cluster = self.cluster
        worker = next((e for e in world.starts if self.node_of(e["host"]) == draw.node), None)
        self.leftovers_killed = 0
        injected = time.time()
        if draw.kind == "rank_killed":
            os.kill(worker["pid"], signal.SIGKILL)  # alive a moment ago (wait_whole)
        elif draw.kind == "node_lost":
            self.present.remove(draw.node)
            self.absent.append(draw.node)
            cluster.kill_node(draw.node)
            self.write_hosts()
        elif draw.kind == "link_cut":
            cluster.cut_link(draw.node)
            self.present.remove(draw.node)
            self.absent.append(draw.node)
            self.write_hosts()
            time.sleep(draw.seconds)
            cluster.restore_link(draw.node)
        elif draw.kind == "link_slowed":
            cluster.set_rate(draw.node, SLOW_RATE_MBIT)
            time.sleep(draw.seconds)
            cluster.set_rate(draw.node, RATE_MBIT)
        elif draw.kind == "rank_stalled":
            os.kill(worker["pid"], signal.SIGSTOP)
            time.sleep(draw.seconds)
            try:
                os.kill(worker["pid"], signal.SIGCONT)
            except ProcessLookupError:
                pass  # its watchdog ended it while it was stopped
        elif draw.kind == "worker_added_back":
            # a node is clean when it is listed again (as a resource manager leaves it): a worker
            # still running behind an earlier cut would otherwise reach the driver as this host's
            # slot beside the new one, and Horovod cannot tell the two apart
            self.leftovers_killed = cluster.kill_node(draw.node)
            self.absent.remove(draw.node)
            self.present.append(draw.node)
            self.write_hosts()
        # a cut link's node is gone from discovery at once: the survivors' disruption starts and
        # ends with the injection; a stall or a slow link ends when it is lifted
        until = injected if draw.kind == "link_cut" else time.time()
        return injected, until

    def dump_stacks(self) -> list[int]:
        """Ask every live worker for its threads' Python stacks (SIGUSR1: soak_train.py writes
        them to ``records/HOST-PID.stacks``) and, where gdb is installed, write the native stacks
        of every thread (Horovod's background thread included) to ``records/HOST-PID.gdb``: what
        a hang is made of. Returns the pids asked."""
        hosts = {e["pid"]: e["host"] for e in self.events() if e["event"] == "process"}
        pids = sorted(pid for pid in hosts if _alive(pid))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        gdb = shutil.which("gdb")
        for pid in pids if gdb else []:
            target = self.records / f"{hosts[pid]}-{pid}.gdb"
            with open(target, "w") as out:
                try:
                    subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                                   stdout=out, stderr=subprocess.STDOUT, timeout=20, check=False)
                except subprocess.TimeoutExpired:
                    out.write("gdb: no answer within 20 s\n")  # the verdict goes on
        time.sleep(1)
        return pids

    def stop(self, limit_s: float) -> Optional[int]:
        (self.out / "stop").write_text("stop\n")
        try:
            return self.proc.wait(timeout=limit_s)
        except Exception:
            return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_soak(bin_dir: Path, out: Path, minutes: float, faults: int, seed: int,
             timeout_s: float = SOAK_TIMEOUT_S, nodes: int = 4, min_np: int = 2,
             cut_factor: float = 1.5, kinds: Sequence[str] = FAULT_KINDS) -> dict:
    """The soak; returns the summary (also written to ``out``) with the per-fault records."""
    sys.path.insert(0, str(ROOT / "tools"))
    from cluster import Cluster
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("records", "stop", "faults.json", "summary.json"):
        path = out / stale
        if path.is_dir():
            for f in path.iterdir():
                f.unlink()
        elif path.exists():
            path.unlink()
    feasible_kinds(nodes, min_np, nodes - 1, 0, kinds)  # ValueError: a kind that does not exist
    bag = FaultBag(seed, kinds)
    bound = 2 * timeout_s
    records: list[dict] = []
    problems: list[str] = []
    started = time.monotonic()
    print(f"soak: seed {seed}, {faults} faults over {minutes:g} min, timeout {timeout_s:g} s, "
          f"{nodes} nodes x 1 worker (min-np {min_np}), out {out}", flush=True)
    with Cluster(nodes, RATE_MBIT) as cluster:
        soak = Soak(cluster, out, timeout_s, min_np, bin_dir)
        soak.start()
        world = soak.wait_whole(180)
        started = time.monotonic()  # training time counts from the first whole world
        if world is None:
            problems.append("the job never ran whole (every node's worker committing) in 180 s")
        spacing = minutes * 60 / max(faults, 1)
        pending: list[tuple[dict, float]] = []
        for index in range(faults if world is not None else 0):
            slot = started + (index + 0.5) * spacing
            time.sleep(max(0.0, slot - time.monotonic()))
            members = [soak.node_of(e["host"]) for e in world.starts]
            draw = bag.draw(members=members, present=soak.present, absent=soak.absent,
                            min_np=min_np, timeout_s=timeout_s, cut_factor=cut_factor)
            injected, until = soak.inject(draw, world)
            fault = {"index": index, "kind": draw.kind, "node": cluster.nodes[draw.node],
                     "seconds": draw.seconds, "injected_at": injected, "disrupted_until": until,
                     "world_before": world.token, "world_size_before": world.size,
                     "leftovers_killed": soak.leftovers_killed}
            print(f"soak: fault {index + 1}/{faults} at {time.monotonic() - started:.0f} s: "
                  f"{draw.kind} on {fault['node']} ({draw.seconds:g} s)", flush=True)
            world = soak.wait_whole(bound + 60, since=until)
            whole_at = time.time()
            if world is None:
                pending.append((fault, whole_at))
                asked = soak.dump_stacks()
                problems.append(f"fault {index + 1} ({draw.kind}): the job was not whole again "
                                f"within {bound + 60:g} s (stacks of the {len(asked)} live "
                                f"workers in {soak.records})")
                break
            pending.append((fault, whole_at))
            time.sleep(2)  # a few commits of the whole world before the next fault
        while time.monotonic() - started < minutes * 60 and soak.proc.poll() is None:
            time.sleep(1)
        workers_at_end = len(soak.present)
        code = soak.stop(60) if soak.proc.poll() is None else soak.proc.returncode
        if code is None:
            soak.dump_stacks()
            cluster.stop_everything()
        soak.copier.join(10)
        soak.log.close()
        events = soak.events()
    trained_s = time.monotonic() - started
    for position, (fault, whole_at) in enumerate(pending):
        window_end = pending[position + 1][0]["injected_at"] if position + 1 < len(pending) \
            else time.time()
        record = judge_fault(fault, events, window_end, bound)
        record["whole_again_s"] = round(whole_at - fault["injected_at"], 2)
        records.append(record)
    ends = [e for e in events if e["event"] == "end"]
    if code != 0:
        problems.append(f"launcher exit code {code} at the stop (None: still running after 60 s)")
    problems += final_problems(ends, workers_at_end)
    summary = {**summarize(records), "seed": seed, "timeout_s": timeout_s, "nodes": nodes,
               "minutes_trained": round(trained_s / 60, 2),
               "final_batch": ends[0]["batch"] if ends else None,
               "final_world_size": len(ends), "launcher_exit_code": code,
               "problems": problems,
               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (out / "faults.json").write_text(json.dumps(records, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for record in records:
        print(f"  {record['index'] + 1:2d} {record['kind']:<17} {record['node']:<10} "
              f"recovery {record['recovery_s']} s ({record['since_injection_s']} s after the "
              f"injection), whole again {record['whole_again_s']} s, "
              f"steps lost {record['steps_lost']}, worlds {len(record['worlds'])}"
              f"{'' if record['survived'] else ' FAILED: ' + '; '.join(record['problems'])}",
              flush=True)
    for problem in problems:
        print(f"  problem: {problem}", flush=True)
    print(f"soak: trained {trained_s / 60:.1f} min to batch {summary['final_batch']} on "
          f"{len(ends)} ranks, launcher exit code {code}, seed {seed}", flush=True)
    print(summary_line(summary), flush=True)
    return {**summary, "records": records}


def passed(summary: dict, faults: int) -> bool:
    """The soak's goal: every fault injected and survived, no step lost, nothing else wrong."""
    return (summary["faults_injected"] == faults == summary["faults_survived"]
            and summary["steps_lost"] == 0 and not summary["problems"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="default: drawn, and recorded")
    parser.add_argument("--timeout", type=float, default=SOAK_TIMEOUT_S,
                        help="HVA_TIMEOUT_SECONDS of the job")
    parser.add_argument("--cut-factor", type=float, default=1.5,
                        help="how long a cut link stays down, in timeouts (> 1)")
    parser.add_argument("--kinds", default=",".join(FAULT_KINDS),
                        help="the fault kinds to draw from, comma-separated (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "soak")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    summary = run_soak(Path(sys.executable).parent, args.out.resolve(), args.minutes,
                       args.faults, seed, args.timeout, cut_factor=args.cut_factor,
                       kinds=[k for k in args.kinds.split(",") if k])
    return 0 if passed(summary, args.faults) else 1


if __name__ == "__main__":
    sys.exit(main())
