"""Multi-node suite: every rank of a job launched across emulated nodes (tools/cluster.py) runs
these tests in the same order. Launched by tools/run_tests.py, never by a plain pytest.

The truth about placement here is each rank's host name, which the cluster sets per node
(``unshare --uts``); the library learns placement its own way (MPI's shared-memory split, or
Horovod's host information under Gloo), so the tests compare the two.
"""
import os
import warnings

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from helpers import rank, world  # noqa: F401  (fixtures)

# What hva.init() said before Horovod started, for the tests to check on every rank.
INIT_WARNINGS: list = []
INIT_ERROR = None


def pytest_configure(config):
    global INIT_ERROR
    mode = os.environ.get("HVA_TEST_INIT", "dynamic")
    if mode == "group_sizes":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hva.init(group_sizes=[int(os.environ["HVA_TEST_GROUP_SIZE"])])
        INIT_WARNINGS.extend(str(w.message) for w in caught)
    elif mode == "uneven":
        # 3 + 1 ranks: a level of 2 cannot be node-local, so start-up registration must refuse.
        try:
            hva.init(group_sizes=[2])
        except ValueError as error:
            INIT_ERROR = error
        assert not hvd.is_initialized()
        hva.init()
    else:
        hva.init()
    torch.manual_seed(0)

