"""The main job: synchronous SGD vs. local, post-local and hierarchical SGD on the same budget.

Trains a small MLP on scikit-learn's bundled digits (1797 8x8 images, shipped inside the
package, so it runs offline) with a held-out test split, data-parallel over Horovod ranks, and
compares the methods on the same seed, model, data shards and number of steps. Prints a table
(test accuracy, global and local allreduces, payload bytes per rank counted by the library, wall
time) and writes ``results.json``, ``results.md`` and ``accuracy_vs_global_rounds.png``.

    horovodrun -np 4 python -m hvd_averaging.examples.train --out results/demo
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_averaging as hva
from hvd_averaging.communication import reset_traffic, traffic

__all__ = ["main", "parse_hierarchy", "METHODS"]

METHODS = ("sync", "local", "postlocal", "hierarchical")


def parse_hierarchy(text: str) -> dict[int, int]:
    """``"2:2,8:4"`` -> ``{2: 2, 8: 4}`` (period:group size pairs)."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return {int(p): int(s) for p, s in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--hierarchy {text!r}: expected period:size pairs like 2:2,8:4") from None


def load_digits_split(seed: int):
    """Digits as float tensors: (x_train, y_train, x_test, y_test), a fixed 75/25 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.25, random_state=seed, stratify=y)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def build_optimizer(method: str, model, args, total_steps: int):
    """The method as one optimizer object: the training loop is the same for all."""
    local = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if method == "sync":
        # a warm-up spanning the whole run is synchronous SGD: gradients averaged every step
        return hva.PostLocalSGD(local, model.named_parameters(), start_localSGD_iter=total_steps,
                                averager=hva.PeriodicModelAverager(2, warmup_steps=total_steps))
    if method == "local":
        return hva.PostLocalSGDOptimizer(local, hva.PeriodicModelAverager(args.period))
    if method == "postlocal":
        start = max(1, total_steps * args.warmup_percent // 100)
        return hva.PostLocalSGD(
            local, model.named_parameters(), start_localSGD_iter=start,
            averager=hva.PeriodicModelAverager(args.period, warmup_steps=start),
            local_group_size=args.local_group_size)
    if method == "hierarchical":
        return hva.PostLocalSGDOptimizer(local, hva.HierarchicalModelAverager(args.hierarchy))
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def train(method: str, args, data) -> dict:
    x_train, y_train, x_test, y_test = data
    rank, size = hvd.rank(), hvd.size()
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]
    steps_per_epoch = len(x_shard) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    model = make_model(args.seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = build_optimizer(method, model, args, total_steps)
    generator = torch.Generator().manual_seed(args.seed + rank)
    reset_traffic()
    curve = [(0, accuracy(model, x_test, y_test))]
    hvd.barrier()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_shard), generator=generator)
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x_shard[idx]), y_shard[idx]).backward()
            opt.step()
        acc = accuracy(model, x_test, y_test)
        curve.append((traffic["global_allreduces"], acc))
        if rank == 0 and not args.quiet:
            print(f"  {method:<13} epoch {epoch + 1:>3}/{args.epochs}  rank-0 test acc {acc:.4f}  "
                  f"global rounds {traffic['global_allreduces']}", flush=True)
    # one final global average so every rank ends with the same model (counted below)
    hva.average_parameters(model.parameters())
    hvd.barrier()
    wall = time.perf_counter() - start
    final_acc = accuracy(model, x_test, y_test)
    curve.append((traffic["global_allreduces"], final_acc))
    agreed = hvd.allgather_object(round(final_acc, 6))
    assert len(set(agreed)) == 1, f"ranks disagree on the final model: {agreed}"
    return {
        "method": method,
        "label": label(method, args),
        "test_accuracy": final_acc,
        "global_allreduces": traffic["global_allreduces"],
        "local_allreduces": traffic["local_allreduces"],
        "bytes_per_rank": traffic["bytes"],
        "wall_s": wall,
        "steps": total_steps,
        "curve": curve,
    }


def label(method: str, args) -> str:
    if method == "local":
        return f"local SGD (period {args.period})"
    if method == "postlocal":
        return (f"post-local SGD (warm-up {args.warmup_percent}%, period {args.period}, "
                f"local grads in groups of {args.local_group_size})")
    if method == "hierarchical":
        return "hierarchical SGD " + ",".join(f"{p}:{s}" for p, s in args.hierarchy.items())
    return "synchronous SGD"


def table(results: list[dict]) -> str:
    base = results[0]
    rows = ["| method | test acc | vs sync (points) | global allreduces | local allreduces | "
            "payload MB/rank | wall s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(
            f"| {r['label']} | {r['test_accuracy']:.4f} | "
            f"{100 * (r['test_accuracy'] - base['test_accuracy']):+.2f} | {r['global_allreduces']} | "
            f"{r['local_allreduces']} | {r['bytes_per_rank'] / 1e6:.2f} | {r['wall_s']:.2f} |")
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        rounds, accs = zip(*r["curve"])
        ax.plot(rounds, accs, marker=".", label=r["label"])
    ax.set_xscale("symlog")
    ax.set_xlabel("global communication rounds (allreduces over all ranks)")
    ax.set_ylabel("test accuracy (rank 0's model)")
    ax.set_title(f"digits MLP, {hvd.size()} ranks, same steps per method")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=("all",) + METHODS, default="all")
    parser.add_argument("--period", type=int, default=16, help="local/post-local averaging period")
    parser.add_argument("--periods", type=str, default="4,16",
                        help="periods compared for local SGD with --method all")
    parser.add_argument("--hierarchy", type=parse_hierarchy, default=None,
                        help="period:size pairs (default 2:2,8:WORLD)")
    parser.add_argument("--warmup-percent", type=int, default=10,
                        help="post-local SGD: share of steps with global gradient allreduce")
    parser.add_argument("--local-group-size", type=int, default=2,
                        help="post-local SGD: gradient group size after warm-up (a simulated node)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/demo"))
    parser.add_argument("--fast", action="store_true", help="2 epochs (for tests)")
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    hva.init()
    if args.fast:
        args.epochs = 2
    if args.hierarchy is None:
        args.hierarchy = {2: min(2, hvd.size()), 8: hvd.size()}
    args.local_group_size = min(args.local_group_size, hvd.size())
    data = load_digits_split(args.seed)
    runs: list[tuple[str, int]] = []
    methods = METHODS if args.method == "all" else (args.method,)
    for method in methods:
        if method == "local" and args.method == "all":
            runs += [("local", int(p)) for p in args.periods.split(",")]
        else:
            runs.append((method, args.period))
    if "sync" not in methods:
        runs.insert(0, ("sync", args.period))  # the baseline is always measured
    results = []
    for method, period in runs:
        args.period = period
        results.append(train(method, args, data))
    if hvd.rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        md = table(results)
        print("\n" + md)
        (args.out / "results.md").write_text(md + "\n")
        (args.out / "results.json").write_text(json.dumps(
            {"ranks": hvd.size(), "epochs": args.epochs, "batch_size": args.batch_size,
             "lr": args.lr, "seed": args.seed, "results": results}, indent=1))
        plot(results, args.out / "accuracy_vs_global_rounds.png")
        print(f"\nwrote {args.out}/results.md, results.json, accuracy_vs_global_rounds.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
