"""The watchdog process ends a process blocked past its deadline, and only then (real processes)."""
import subprocess
import sys
import time

import pytest

import hvd_averaging as hva

CHILD = """
import sys, time
from hvd_averaging.watchdog import Watchdog
dog = Watchdog()
token = dog.arm(float(sys.argv[1]), "blocked: test round at step 7")
if sys.argv[2] == "disarm":
    dog.disarm(token)
print("armed", flush=True)
time.sleep(float(sys.argv[3]))
print("woke up", flush=True)
"""


def run_child(arm_s, action, sleep_s, env=None):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(arm_s), action, str(sleep_s)],
                          capture_output=True, text=True, timeout=60, env=env)
    return proc, time.monotonic() - start


def test_armed_deadline_ends_a_blocked_process_with_its_message():
    proc, seconds = run_child(1.0, "keep", 30)
    assert proc.returncode == -15, (proc.returncode, proc.stderr)
    assert "blocked: test round at step 7" in proc.stderr
    assert "woke up" not in proc.stdout
    assert seconds < 15, seconds


def test_the_watchdog_leaves_a_record_of_the_process_it_ended(tmp_path):
    import json
    import os
    env = dict(os.environ, HVA_WATCHDOG_RECORD_DIR=str(tmp_path))
    proc, _ = run_child(1.0, "keep", 30, env)
    assert proc.returncode == -15, (proc.returncode, proc.stderr)
    (record_path,) = tmp_path.glob("watchdog-*.json")
    record = json.loads(record_path.read_text())
    assert record_path.name == f"watchdog-{record['pid']}.json"
    assert record["message"] == "blocked: test round at step 7" and record["time"] > 0
    proc, _ = run_child(0.5, "disarm", 2, env)  # a disarmed deadline leaves none
    assert proc.returncode == 0 and len(list(tmp_path.glob("watchdog-*.json"))) == 1


def test_disarmed_deadline_leaves_the_process_alone():
    proc, _ = run_child(0.5, "disarm", 2)
    assert proc.returncode == 0, proc.stderr
    assert "woke up" in proc.stdout
    assert "blocked" not in proc.stderr


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True])
def test_exit_after_is_validated(bad):
    with pytest.raises(ValueError, match="exit_after must be a positive number of seconds"):
        hva.set_timeout(10, exit_after=bad)
    hva.set_timeout(None)


def test_exit_after_defaults_to_half_the_timeout_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("HVA_EXIT_AFTER_TIMEOUT_SECONDS", raising=False)
    hva.set_timeout(12)
    assert hva.deadlines.exit_after_timeout() == 6
    hva.set_timeout(12, exit_after=None)
    assert hva.deadlines.exit_after_timeout() is None
    hva.set_timeout(None)
    monkeypatch.setenv("HVA_EXIT_AFTER_TIMEOUT_SECONDS", "never")
    assert hva.deadlines.exit_after_timeout() is None
    monkeypatch.setenv("HVA_EXIT_AFTER_TIMEOUT_SECONDS", "-3")
    with pytest.raises(ValueError, match="HVA_EXIT_AFTER_TIMEOUT_SECONDS='-3' must be a positive"):
        hva.deadlines.exit_after_timeout()


def test_a_watchdog_that_cannot_start_warns_once_naming_why(monkeypatch):
    """At the commit before this test the library went on without its watchdog and said
    nothing; now it warns once with the reason."""
    from hvd_averaging.watchdog import Watchdog

    monkeypatch.setattr(sys, "executable", "/nonexistent/python-for-the-watchdog")
    dog = Watchdog()
    with pytest.warns(RuntimeWarning, match="watchdog process could not start.*No such file"):
        dog.arm(5.0, "a round")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dog.disarm(dog.arm(5.0, "another round"))  # said once: no second warning


@pytest.mark.parametrize("variable,value", [("HVA_EXIT_AFTER_TIMEOUT_SECONDS", "soon"),
                                            ("HVA_EXIT_AFTER_TIMEOUT_SECONDS", "-3"),
                                            ("HVA_TIMEOUT_SECONDS", "inf"),
                                            ("HVA_WATCHDOG_RECORD_DIR", "/no/such/folder"),
                                            ("HVA_ROUTE", "fastest")])
def test_malformed_settings_fail_at_init_naming_variable_and_value(variable, value):
    """hva.init() (a real one-rank Horovod in a child process) raises ValueError naming the
    variable, its value and the rule; at the commit before this test a malformed
    HVA_EXIT_AFTER_TIMEOUT_SECONDS passed init and surfaced only inside a later timeout."""
    import os
    env = dict(os.environ, **{variable: value})
    proc = subprocess.run([sys.executable, "-c", "import hvd_averaging as hva; hva.init()"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert f"ValueError: {variable}={value!r}" in proc.stderr
    rule = {"HVA_WATCHDOG_RECORD_DIR": "existing folder",
            "HVA_ROUTE": "must be one of 'measure'"}.get(variable, "number of seconds")
    assert rule in proc.stderr


SEPARATE_DEADLINES_CHILD = """
import time
import hvd_averaging as hva
from hvd_averaging.deadlines import AveragingTimeoutError, bounded_collective, guarded_enqueue
hva.set_timeout(30, exit_after=1.5)
try:
    with bounded_collective("test round at step 3"):
        raise AveragingTimeoutError("test round at step 3: not finished")
except AveragingTimeoutError:
    pass
with guarded_enqueue("the next round's enqueue"):  # its disarm must leave the exit armed
    pass
print("went on", flush=True)
time.sleep(30)
print("woke up", flush=True)
"""


def test_a_later_disarm_leaves_the_exit_after_a_timeout_armed():
    """After an AveragingTimeoutError the process has exit_after seconds; a collective that
    arms and disarms its own deadline meanwhile must not cancel that exit. At the commit before
    this test the watchdog had one deadline slot: the enqueue's disarm cancelled the exit and
    the process woke up 30 s later."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SEPARATE_DEADLINES_CHILD], capture_output=True,
                          text=True, timeout=60)
    assert "went on" in proc.stdout and "woke up" not in proc.stdout, (proc.stdout, proc.stderr)
    assert proc.returncode == -15, (proc.returncode, proc.stderr)
    assert "still running 1.5 s after AveragingTimeoutError in test round at step 3" in proc.stderr
    assert time.monotonic() - start < 20


RECOVERED_CHILD = """
import time
import hvd_averaging as hva
from hvd_averaging.deadlines import AveragingTimeoutError, bounded_collective
from hvd_averaging.elastic import AveragerStateHandler
hva.init()
hva.set_timeout(30, exit_after=1.0)
handler = AveragerStateHandler(hva.PeriodicModelAverager(2))
try:
    with bounded_collective("test round at step 3"):
        raise AveragingTimeoutError("test round at step 3: not finished")
except AveragingTimeoutError:
    pass
if RECOVER:
    handler.restore()  # what hvd.elastic.run does after the error, before its reset
time.sleep(3)
print("went on", flush=True)
"""


@pytest.mark.parametrize("recover", [True, False])
def test_an_elastic_restore_cancels_the_exit_after_a_timeout(recover):
    """The fault soak saw the last survivor of an elastic job ended by its watchdog while it
    waited in Horovod's rendezvous, ``exit_after`` seconds after the timeout. An elastic state
    handler's restore() now cancels that exit (and the skip of Horovod's shutdown at exit: the
    process ends with its own exit code); without a restore the exit stays armed."""
    proc = subprocess.run([sys.executable, "-c", f"RECOVER = {recover}\n" + RECOVERED_CHILD],
                          capture_output=True, text=True, timeout=60)
    if recover:
        assert proc.returncode == 0 and "went on" in proc.stdout, (proc.returncode, proc.stderr)
    else:
        assert proc.returncode == -15 and "went on" not in proc.stdout, (proc.returncode, proc.stderr)
        assert "still running 1 s after AveragingTimeoutError" in proc.stderr


def test_deadlines_are_kept_apart_and_the_earliest_ends_the_process():
    child = """
import time
from hvd_averaging.watchdog import Watchdog
dog = Watchdog()
dog.arm(1.0, "the first deadline")
later = dog.arm(30.0, "a later deadline")
dog.disarm(later)
dog.disarm(dog.arm(0.2, "a third, disarmed at once"))
time.sleep(30)
print("woke up", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -15 and "woke up" not in proc.stdout, (proc.returncode, proc.stderr)
    assert "the first deadline" in proc.stderr
    assert "a later deadline" not in proc.stderr and "a third" not in proc.stderr


PLANTED_CHILD = """
import sys, time
from hvd_averaging.watchdog import Watchdog
import os
print(os.getpid(), flush=True)
sys.stdin.readline()  # the symlinks are planted meanwhile
Watchdog().arm(0.5, "blocked: the round the record is for")
time.sleep(30)
"""


def test_a_planted_symlink_cannot_redirect_the_watchdog_record(tmp_path):
    """HVA_WATCHDOG_RECORD_DIR may be a folder others can write to. Symlinks planted there under
    the record's name and under the name its partial file had must not make the watchdog write
    through them: the victim files keep their contents (or stay absent) and the record is a
    file of its own. At the commit before this test the partial file was opened following
    symlinks: the victim was overwritten with the record."""
    import json
    import os
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    victim = elsewhere / "victim.txt"
    victim.write_text("precious")
    proc = subprocess.Popen([sys.executable, "-c", PLANTED_CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HVA_WATCHDOG_RECORD_DIR=str(shared)))
    try:
        pid = int(proc.stdout.readline())
        record_path = shared / f"watchdog-{pid}.json"
        (shared / f"watchdog-{pid}.json.partial").symlink_to(victim)
        record_path.symlink_to(elsewhere / "created-through-a-link.json")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -15, (proc.returncode, stderr)
    assert victim.read_text() == "precious"
    assert not (elsewhere / "created-through-a-link.json").exists()
    assert record_path.is_file() and not record_path.is_symlink()
    record = json.loads(record_path.read_text())
    assert record["pid"] == pid and record["message"] == "blocked: the round the record is for"
    # nothing else left behind: no partial file of the watchdog's own
    assert sorted(os.listdir(shared)) == sorted([record_path.name, f"watchdog-{pid}.json.partial"])
    assert os.listdir(elsewhere) == ["victim.txt"]


OVERFLOW_CHILD = """
import sys, time
from hvd_averaging.watchdog import Watchdog
from hvd_averaging.watchdog_process import SLOT_COUNT, SLOT_MESSAGE_BYTES
dog = Watchdog()
for i in range(SLOT_COUNT):  # every shared slot taken by a later deadline
    dog.arm(60.0, f"slot deadline {i}")
if sys.argv[1] == "overflow":
    dog.arm(1.0, "the deadline past the last slot")
else:
    for i in range(SLOT_COUNT):
        dog.disarm(i + 1)
    dog.arm(1.0, "a long message " + "x" * SLOT_MESSAGE_BYTES + " its end")
time.sleep(30)
print("woke up", flush=True)
"""


@pytest.mark.parametrize("case", ["overflow", "long message"])
def test_a_deadline_that_does_not_fit_a_shared_slot_still_ends_the_process(case):
    """Deadlines go through slots of shared memory; one that finds no free slot, or whose
    message is longer than a slot, goes through the pipe and still ends the process, with its
    whole message."""
    proc = subprocess.run([sys.executable, "-c", OVERFLOW_CHILD, case.split()[0]],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -15 and "woke up" not in proc.stdout, (proc.returncode, proc.stderr)
    if case == "overflow":
        assert "the deadline past the last slot" in proc.stderr and "slot deadline" not in proc.stderr
    else:
        assert "its end" in proc.stderr


HELPER_PID_CHILD = """
import time
from hvd_averaging.watchdog import Watchdog
dog = Watchdog()
for _ in range(1000):  # rounds that finish: armed and disarmed
    dog.disarm(dog.arm(0.3, "a round"))
print(dog._process.pid, flush=True)
"""


def test_the_helper_ends_with_its_process_after_rounds_that_finished():
    """A process that exits right after its last disarm leaves no helper behind and no deadline
    acted on (the helper reads the slots again once the parent is gone)."""
    import os
    proc = subprocess.run([sys.executable, "-c", HELPER_PID_CHILD], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "a round" not in proc.stderr, proc.stderr
    helper = int(proc.stdout.split()[-1])
    for _ in range(100):
        if not os.path.exists(f"/proc/{helper}") or \
                open(f"/proc/{helper}/stat").read().split(") ")[1][0] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the watchdog helper {helper} still runs 5 s after its parent ended")


RESTART_CHILD = """
import os, signal, time
from hvd_averaging.watchdog import Watchdog
dog = Watchdog()
dog.arm(3.0, "armed before the helper died")
os.kill(dog._process.pid, signal.SIGKILL)
dog._process.wait()
time.sleep(1.1)  # past the second for which the helper is taken as running
dog.disarm(dog.arm(30.0, "a round after"))  # notices the death and starts a new helper
time.sleep(30)
print("woke up", flush=True)
"""


def test_a_helper_started_again_keeps_what_was_armed():
    """A helper that died is started again at the next arm, on the same shared slots: the
    deadline armed before it died still ends the process. At a8b8e3a the new helper got new
    slots, the deadline was lost and the process woke up 30 s later."""
    proc = subprocess.run([sys.executable, "-c", RESTART_CHILD], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -15 and "woke up" not in proc.stdout, (proc.returncode, proc.stderr)
    assert "armed before the helper died" in proc.stderr


NO_SHARED_MEMORY_CHILD = """
import os, time
def refuse(*args, **kwargs):
    raise PermissionError(1, "refused by the sandbox")
os.memfd_create = refuse
from hvd_averaging.watchdog import Watchdog
Watchdog().arm(1.0, "a deadline that went by pipe")
time.sleep(30)
print("woke up", flush=True)
"""


def test_without_shared_memory_deadlines_go_by_pipe():
    """Where shared memory is refused (a seccomp profile, a sandbox), every deadline goes by
    pipe and still ends the process. At a8b8e3a the refusal came out of arm(), failing the
    round."""
    proc = subprocess.run([sys.executable, "-c", NO_SHARED_MEMORY_CHILD], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -15 and "woke up" not in proc.stdout, (proc.returncode, proc.stderr)
    assert "a deadline that went by pipe" in proc.stderr
