"""Horovod initialized by the user with static process sets only (hvd.init(process_sets=[...]))."""
import horovod.torch as hvd
import pytest

import hvd_averaging as hva
from helpers import expect_error_on_every_rank, gathered, param


def test_registered_set_is_reused(rank):
    pair = hva.process_set([0, 1])
    assert pair.process_set_id is not None and pair.ranks == [0, 1]
    p = param(rank)
    hva.average_parameters([p], pair)
    assert gathered(p[0]) == [0.5, 0.5, 2.0, 3.0]


def test_missing_set_names_both_fixes():
    error = expect_error_on_every_rank(
        lambda: hva.HierarchicalModelAverager({2: 2, 4: 4}), RuntimeError)
    message = str(error)
    assert "[2, 3] is not registered" in message
    assert "hva.init()" in message and "hvd.init(process_sets=" in message
