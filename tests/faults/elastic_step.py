"""The training step the elastic fault scripts share (elastic_shrink.py, elastic_nodes.py)."""
import horovod.torch as hvd
import torch

__all__ = ["train_step", "train_step_diloco"]


def train_step(model, optimizer, averager, batch: int) -> None:
    """This rank's data for ``batch``, one inner step, then the averager's call."""
    torch.manual_seed(1000 * hvd.rank() + batch)
    optimizer.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    averager.average_parameters(model.parameters())


def train_step_diloco(model, diloco, batch: int) -> None:
    """This rank's data for ``batch`` and one wrapper step (DiLoCo: inner step, the outer step
    when due; PostLocalSGDOptimizer, PostLocalSGD: inner step, averaging when due)."""
    torch.manual_seed(1000 * hvd.rank() + batch)
    diloco.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    diloco.step()
