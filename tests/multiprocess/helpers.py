"""Shared helpers for the multi-process tests."""
import horovod.torch as hvd
import pytest
import torch


@pytest.fixture
def world():
    """Horovod's world size (a fixture; conftests import it)."""
    return hvd.size()


@pytest.fixture
def rank():
    """This process's Horovod rank (a fixture; conftests import it)."""
    return hvd.rank()


def param(value, dtype=torch.float32, shape=(3,)):
    """A parameter filled with ``value`` that has a gradient (so it is averaged)."""
    p = torch.nn.Parameter(torch.full(shape, float(value), dtype=dtype))
    p.grad = torch.zeros_like(p)
    return p


def gathered(value):
    """Every rank's float ``value``, gathered over Horovod (list indexed by rank)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
    return hvd.allgather_object(float(value))


def expect_error_on_every_rank(func, exc_types):
    """Run func; return the exception (one of exc_types), and check that every rank raised."""
    try:
        func()
        raised = None
    except exc_types as error:  # noqa: PERF203
        raised = error
    everyone = hvd.allgather_object(raised is not None)
    assert all(everyone), f"not every rank raised: {everyone}"
    return raised
