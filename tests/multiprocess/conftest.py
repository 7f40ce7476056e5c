"""Multi-process suite: every rank of a horovodrun/mpirun job runs these tests in the same order.

Launched by tools/run_tests.py, never by a plain single-process pytest. Each test makes every
rank assert on values that depend on the other ranks.
"""
import os

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from helpers import rank, world  # noqa: F401  (fixtures)


# Set by the group_sizes run: what hva.init(group_sizes=[3]) raised before Horovod started.
EARLY_INIT_ERROR = None


def pytest_configure(config):
    global EARLY_INIT_ERROR
    mode = os.environ.get("HVA_TEST_INIT")
    if mode == "static":
        hvd.init(process_sets=[hvd.ProcessSet([0, 1])])
    elif mode == "group_sizes":
        try:
            hva.init(group_sizes=[3])
        except ValueError as error:
            EARLY_INIT_ERROR = f"ValueError: {error}"
        assert not hvd.is_initialized()
        hva.init(group_sizes=[2])
    else:
        hva.init()
    torch.manual_seed(0)

