"""Multi-process suite: every rank of a horovodrun/mpirun job runs these tests in the same order.

Launched by tools/run_tests.py, never by a plain single-process pytest. Each test makes every
rank assert on values that depend on the other ranks.
"""
import os

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva


def pytest_configure(config):
    if os.environ.get("HVA_TEST_INIT") == "static":
        hvd.init(process_sets=[hvd.ProcessSet([0, 1])])
    else:
        hva.init()
    torch.manual_seed(0)


@pytest.fixture
def world():
    return hvd.size()


@pytest.fixture
def rank():
    return hvd.rank()
