"""Shared helpers for the multi-process tests."""
import shutil
import tempfile
import time
from pathlib import Path

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


class OutOfBand:
    """Signals between ranks that do not travel through Horovod (whose queue a stalled round
    blocks): marker files in a folder every rank sees (one host, or the emulated nodes, which
    share the file system). Making one is collective."""

    def __init__(self, name: str):
        made = tempfile.mkdtemp(prefix=f"hva-test-{name}-") if hvd.rank() == 0 else None
        self.path = Path(hvd.broadcast_object(made, root_rank=0, name=f"test.oob.{name}"))

    def tell(self, what: str) -> None:
        """Say ``what`` happened on this rank."""
        (self.path / f"{what}.{hvd.rank()}").touch()

    def wait_for(self, what: str, ranks, limit_s: float = 120.0) -> None:
        """Wait until every rank of ``ranks`` said ``what`` (fails the test after ``limit_s``)."""
        deadline = time.monotonic() + limit_s
        while not all((self.path / f"{what}.{r}").exists() for r in ranks):
            assert time.monotonic() < deadline, f"ranks {list(ranks)} did not say {what!r} in {limit_s} s"
            time.sleep(0.05)

    def close(self) -> None:
        """Collective: remove the folder once every rank is done with it."""
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(self.path, ignore_errors=True)
