"""HVA_* settings are compared across ranks: a value that differs on some ranks raises ValueError
on every rank, naming the setting and which ranks hold which value (hva.init() runs this check
right after Horovod starts; tests/unit/test_settings.py launches that)."""
import horovod.torch as hvd
import pytest

import hvd_averaging as hva
from helpers import expect_error_on_every_rank
from hvd_averaging.startup import agree_on_settings


@pytest.fixture
def restored_timeout():
    yield
    hva.set_timeout(None)


def test_equal_settings_pass(world, rank, monkeypatch):
    monkeypatch.setenv("HVA_ROUTE", "flat")
    monkeypatch.delenv("HVA_WATCHDOG_RECORD_DIR", raising=False)
    agree_on_settings()


def test_a_setting_that_differs_is_named_with_its_ranks_on_every_rank(world, rank, monkeypatch,
                                                                    restored_timeout):
    monkeypatch.setenv("HVA_ROUTE", "flat" if rank == 0 else "node-aware")
    if rank == 1:
        hva.set_timeout(44)  # hva.set_timeout on one rank only differs too
    error = expect_error_on_every_rank(agree_on_settings, ValueError)
    message = str(error)
    others = list(range(1, world))
    assert f"HVA_ROUTE differs across ranks: 'flat' on rank(s) [0]; 'node-aware' on rank(s) {others}" \
        in message
    timeouts = [r for r in range(world) if r != 1]
    first = f"'{hva.deadlines.DEFAULT_TIMEOUT_SECONDS:g}' on rank(s) {timeouts}; '44' on rank(s) [1]"
    assert f"HVA_TIMEOUT_SECONDS differs across ranks: {first}" in message
    # the exit after a timeout follows the timeout (half of it) where it is not set
    assert "HVA_EXIT_AFTER_TIMEOUT_SECONDS differs" in message
    assert "HVA_WATCHDOG_RECORD_DIR" not in message
    # every rank raised the same message
    said = hvd.allgather_object(message)
    assert all(text == message for text in said)
