"""Horovod's pytorch_mnist recipe with an hvd_averaging wrapper in place of
hvd.DistributedOptimizer, changed in nothing else: DistributedSampler, a model with BatchNorm,
hvd.broadcast_parameters and hvd.broadcast_optimizer_state, an LR scheduler on the wrapper, the
user's own hvd.allreduce of metrics between steps, rank 0's torch.save of state_dict(), and a
resume in a second launch where every rank loads that file.

    horovodrun -np 4 python tests/recipes/horovod_mnist_recipe.py --phase first --out DIR
    horovodrun -np 4 python tests/recipes/horovod_mnist_recipe.py --phase resume --out DIR

Each rank writes DIR/<wrapper>.<phase>.rank<N>.json (its averager's step, the training steps
made, the inner optimizer's lr and whether every rank's parameters and BatchNorm statistics are
bit-identical after the last averaging); tools/run_tests.py judges those fields.
"""
import argparse
import json
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvd_averaging as hva

WRAPPERS = ("PostLocalSGDOptimizer", "PostLocalSGD", "DiLoCo")
EPOCHS = {"first": 2, "resume": 1}
GAMMA = 0.7
BASE_LR = 0.01


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        return F.log_softmax(self.fc(F.relu(self.bn(self.conv(x))).flatten(1)), dim=1)


def dataset() -> TensorDataset:
    """Digits-like data: 8x8 images, labels from a fixed random teacher (same on every rank)."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(512, 1, 8, 8, generator=g)
    labels = (images.flatten(1) @ torch.randn(64, 10, generator=g)).argmax(1)
    return TensorDataset(images, labels)


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()  # the recipe's own collective


def wrapper(kind, model, steps_per_epoch):
    inner = torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size(), momentum=0.5)
    period = steps_per_epoch  # the last step of every epoch averages across all ranks
    averager = hva.PeriodicModelAverager(period=period, warmup_steps=period - 1)
    if kind == "PostLocalSGDOptimizer":
        return hva.PostLocalSGDOptimizer(inner, averager, buffers=model.buffers())
    if kind == "PostLocalSGD":
        return hva.PostLocalSGD(inner, model.named_parameters(), start_localSGD_iter=period - 1,
                                averager=averager, buffers=model.buffers())
    return hva.DiLoCo(inner, averager, buffers=model.buffers())


def run(kind: str, phase: str, out: Path) -> dict:
    torch.manual_seed(42 + hvd.rank())  # every rank initializes its own model, as many scripts do
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = Net()
    optimizer = wrapper(kind, model, len(loader))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    checkpoint = out / f"{kind}.pt"
    start_epoch = 0
    if phase == "resume":
        saved = torch.load(checkpoint, weights_only=True)  # every rank reads rank 0's file
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        start_epoch = saved["epoch"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    steps = 0
    for epoch in range(start_epoch, start_epoch + EPOCHS[phase]):
        sampler.set_epoch(epoch)
        model.train()
        for batch, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            steps += 1
            if batch % 4 == 0:
                metric_average(loss.item(), f"recipe.{kind}.{epoch}.{batch}")
        scheduler.step()
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": start_epoch + EPOCHS[phase]},
                   checkpoint)
    flat = torch.cat([t.detach().reshape(-1).float() for t in model.state_dict().values()])
    everyone = hvd.allgather(flat.reshape(1, -1), name=f"recipe.{kind}.final")
    return {"wrapper": kind, "phase": phase, "rank": hvd.rank(), "size": hvd.size(),
            "averager_step": optimizer.averager.step, "state_dict_step": optimizer.state_dict()["step"],
            "steps_this_launch": steps, "steps_per_epoch": len(loader),
            "epochs_done": start_epoch + EPOCHS[phase], "inner_lr": optimizer.optim.param_groups[0]["lr"],
            "expected_lr": BASE_LR * hvd.size() * GAMMA ** (start_epoch + EPOCHS[phase]),
            "ranks_equal": all(torch.equal(everyone[0], row) for row in everyone)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--phase", choices=sorted(EPOCHS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    hva.init()
    for kind in WRAPPERS:
        verdict = run(kind, args.phase, args.out)
        (args.out / f"{kind}.{args.phase}.rank{hvd.rank()}.json").write_text(json.dumps(verdict))


if __name__ == "__main__":
    main()
