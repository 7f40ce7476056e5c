"""The elastic reset barrier of the Horovod this project builds (tools/patch_horovod_rendezvous.py,
item 5): Horovod's own ``WorkerStateRegistry``, with a driver and a host manager that only
record what the registry asks of them. A worker the driver stopped waiting for (its host was
dropped) counts once at the barrier: its late report is refused, its exit ignored, and a release
for a reset that is over changes nothing. Unpatched, the late report waited at the barrier as a
second party and completed it one worker short."""
import threading
import time

import pytest
from horovod.runner.elastic.registration import FAILURE, READY, WorkerStateRegistry


class Driver:
    def __init__(self):
        self.resumed = threading.Event()

    def finished(self):
        return False

    def resume(self):
        self.resumed.set()

    def stop(self, error_message=None):
        raise AssertionError(f"the job was stopped: {error_message}")


class Hosts:
    def __init__(self):
        self.blacklisted = []

    def is_blacklisted(self, host):
        return host in self.blacklisted

    def blacklist(self, host):
        self.blacklisted.append(host)


def registry_of(size):
    driver, hosts = Driver(), Hosts()
    registry = WorkerStateRegistry(driver, hosts)
    registry.reset(size)
    return registry, driver, hosts


def in_thread(call, *args):
    thread = threading.Thread(target=call, args=args, daemon=True)
    thread.start()
    return thread


def test_a_released_worker_counts_once_and_its_late_report_is_refused():
    registry, driver, hosts = registry_of(3)
    round_id, _ = registry.recorded()
    in_thread(registry.record_ready, "a", 0)
    in_thread(registry.record_released, "cut", 0, round_id)
    time.sleep(0.2)
    with pytest.raises(RuntimeError, match=r"cut\[0\] was recorded as failed"):
        registry.record_ready("cut", 0)  # the link came back: it must not count twice
    assert registry.record_failure("cut", 0) == round_id  # its exit: ignored, no wait
    time.sleep(0.2)
    assert not driver.resumed.is_set()  # "b" has not reported: the barrier still waits
    in_thread(registry.record_ready, "b", 0)
    assert driver.resumed.wait(5)
    assert hosts.blacklisted == ["cut"]
    assert registry.count(FAILURE) == 1 and registry.count(READY) == 2


def test_a_release_for_a_reset_that_is_over_changes_nothing():
    registry, driver, _ = registry_of(1)
    round_id, _ = registry.recorded()
    in_thread(registry.record_ready, "a", 0)
    assert driver.resumed.wait(5)
    registry.reset(1)  # the next reset
    done = in_thread(registry.record_released, "cut", 0, round_id)
    done.join(5)
    assert not done.is_alive()  # returned at once, waited at no barrier
    assert registry.recorded() == (round_id + 1, set())


def test_a_slot_that_reported_is_not_released():
    registry, driver, _ = registry_of(2)
    round_id, _ = registry.recorded()
    in_thread(registry.record_ready, "a", 0)
    time.sleep(0.1)
    done = in_thread(registry.record_released, "a", 0, round_id)
    done.join(5)
    assert not done.is_alive() and registry.count(FAILURE) == 0
    assert not driver.resumed.is_set()


def test_released_horovod_counted_a_failed_slots_late_report_twice():
    """The same barrier in Horovod 0.28.1 as released (its sdist, cached by make install): a
    slot recorded as failed that reports late completes the barrier one worker short."""
    import importlib.util
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from security_tests import released_runner_sources
    source = released_runner_sources(Path(sys.executable).parent) / "horovod" / "runner" \
        / "elastic" / "registration.py"
    spec = importlib.util.spec_from_file_location("released_registration", source)
    released = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(released)
    driver = Driver()
    registry = released.WorkerStateRegistry(driver, Hosts())
    registry.reset(3)
    in_thread(registry.record_ready, "a", 0)
    in_thread(registry.record_failure, "cut", 0)
    time.sleep(0.2)
    in_thread(registry.record_ready, "cut", 0)  # "ignoring", and waits all the same
    assert driver.resumed.wait(5)  # "b" never reported
