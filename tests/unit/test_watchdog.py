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
dog.arm(float(sys.argv[1]), "blocked: test round at step 7")
if sys.argv[2] == "disarm":
    dog.disarm()
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
        dog.arm(5.0, "another round")  # said once: no second warning
        dog.disarm()


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
