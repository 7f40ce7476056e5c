"""The race's entrants, each as a :class:`~hvd_averaging.examples.race.Trainer`.

- ``baseline``: ``hvd.DistributedOptimizer``, what a Horovod user runs today (gradients
  allreduced every step, overlapped with the backward pass, fused by Horovod);
- ``local``: local SGD, parameters averaged every ``period`` steps;
- ``postlocal``: gradient allreduce for a warm-up, then local SGD (node-local gradients);
- ``hierarchical``: the node every few steps, everyone every ``period``;
- ``local-overlap`` / ``hierarchical-overlap``: the same, the top level's round overlapped with
  the next ``delay`` steps (``delay=`` of the averagers);
- ``diloco`` / ``hierdiloco``: DiLoCo's outer Nesterov step at the top level, overlapped with
  the next ``outer_delay`` inner steps (Streaming DiLoCo) unless ``outer_delay`` is 0.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional, Sequence

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from hvd_averaging.deadlines import blocking_call, guarded_enqueue
from hvd_averaging.examples.race import Trainer
from hvd_averaging.examples.settings import default_node_period

__all__ = ["METHODS", "DEFAULT_METHODS", "build_trainer", "label", "check_race_args",
           "parse_hierarchy", "parse_methods"]

METHODS = ("baseline", "local", "local-overlap", "postlocal", "hierarchical",
           "hierarchical-overlap", "diloco", "hierdiloco")
DEFAULT_METHODS = ("baseline", "local", "local-overlap", "hierarchical", "hierarchical-overlap",
                   "diloco", "hierdiloco")


def parse_hierarchy(text: str) -> dict[int, int]:
    """``"2:2,8:4"`` -> ``{2: 2, 8: 4}`` (period:group size pairs)."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return {int(p): int(s) for p, s in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected period:size pairs like 2:2,8:4") from None


def parse_methods(text: str) -> tuple[str, ...]:
    """``"baseline,diloco"`` -> the methods, each checked against :data:`METHODS`."""
    chosen = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in chosen if m not in METHODS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"--methods {text!r}: unknown {unknown or 'empty'}; choose from {', '.join(METHODS)}")
    return chosen


def check_race_args(args: argparse.Namespace) -> None:
    """Bad combinations, each named with its fix (every rank parses the same argv, so every
    rank raises the same error before any collective)."""
    if args.budget_s is not None and not args.budget_s > 0:
        raise ValueError(f"--budget-s {args.budget_s}: the budget must be a positive number "
                         "of seconds")
    if args.budget_s is None and "baseline" not in args.methods:
        raise ValueError(f"--methods {','.join(args.methods)}: without the baseline there is no "
                         "budget; add baseline or give --budget-s")
    for name in ("period", "outer_period", "steps", "seeds", "grid_points"):
        value = getattr(args, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be a positive integer")
    if not 0 < args.delay < args.period:
        raise ValueError(f"--delay {args.delay}: the overlapped methods' overlap must be shorter "
                         f"than their period ({args.period}); use 1..{args.period - 1}")
    # the shortest period below a top level (a hierarchy left to its default: its node period)
    shortest = min(min(sorted(h)[:-1], default=2) if h else default_node_period(top)
                   for h, top in ((args.hierarchy, args.period),
                                  (args.outer_hierarchy, args.outer_period)))
    if not 0 <= args.node_delay < shortest:
        raise ValueError(f"--node-delay {args.node_delay}: the lower levels' overlap must be "
                         f"shorter than their shortest period ({shortest}); use 0..{shortest - 1}")
    if not 0 <= args.outer_delay < args.outer_period:
        raise ValueError(f"--outer-delay {args.outer_delay}: the overlap must be shorter than "
                         f"the outer period ({args.outer_period}); use 0..{args.outer_period - 1}")
    for name in ("lr", "outer_lr"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be positive")
    if not 0 <= args.outer_momentum < 1:
        raise ValueError(f"--outer-momentum {args.outer_momentum}: must be in [0, 1)")
    if args.outer_momentum_warmup < 0:
        raise ValueError(f"--outer-momentum-warmup {args.outer_momentum_warmup}: must be >= 0 "
                         "(0: no warm-up)")


def label(method: str, args: argparse.Namespace) -> str:
    levels = lambda h: ",".join(f"{p}:{s}" for p, s in h.items())  # noqa: E731
    node = f", node overlap {args.node_delay}" if args.node_delay else ""
    overlap = f", overlap {args.outer_delay}" if args.outer_delay else ""
    warmup = (f" warmed up over {args.outer_momentum_warmup} outer steps"
              if args.outer_momentum_warmup and args.outer_momentum else "")
    outer = f"outer lr {args.outer_lr:g}, momentum {args.outer_momentum:g}{warmup}{overlap}"
    wire = ""
    if method != "baseline" and args.cross_node_compression != "none":
        feedback = " with error feedback" if args.error_feedback else ""
        wire = f", {args.cross_node_compression}{feedback} across nodes"
    return {
        "baseline": f"hvd.DistributedOptimizer{' fp16' if args.baseline_fp16 else ''}",
        "local": f"local SGD (period {args.period})",
        "local-overlap": f"local SGD (period {args.period}, overlap {args.delay})",
        "postlocal": f"post-local SGD (warm-up {args.warmup_percent}%, period {args.period})",
        "hierarchical": f"hierarchical SGD {levels(args.hierarchy)}",
        "hierarchical-overlap":
            f"hierarchical SGD {levels(args.hierarchy)} (overlap {args.delay}{node})",
        "diloco": f"DiLoCo (H {args.outer_period}, {outer})",
        "hierdiloco": f"hierarchical DiLoCo {levels(args.outer_hierarchy)} ({outer}{node})",
    }[method] + wire


class _Timed:
    """Seconds spent in an optimizer's own ``step`` (its step hooks), summed."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.seconds = 0.0
        self._began = 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_):
        self._began = time.perf_counter()

    def _post(self, *_):
        self.seconds += time.perf_counter() - self._began

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _forward_backward(opt, task, model, x, y) -> tuple[torch.Tensor, float]:
    """Gradients zeroed, forward and backward: (the loss, seconds it took)."""
    began = time.perf_counter()
    opt.zero_grad()
    loss = task.loss(model, x, y)
    loss.backward()
    return loss, time.perf_counter() - began


class BaselineTrainer(Trainer):
    """``hvd.DistributedOptimizer``: backward enqueues the gradient allreduces; ``synchronize()``
    waits for them (communication), then the inner step runs (compute)."""

    def __init__(self, model, task, args):
        self.model, self.task = model, task
        compression = hvd.Compression.fp16 if args.baseline_fp16 else hvd.Compression.none
        inner = task.inner_optimizer(model.parameters(), args.lr)
        self.opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                            compression=compression)

    def step(self, x, y):
        # backward enqueues the gradient allreduces (an enqueue Horovod can block) and
        # synchronize() waits on them with no handle this code may poll: the watchdog bounds both
        with guarded_enqueue("the baseline's backward (enqueues its gradient allreduces)"):
            loss, computed = _forward_backward(self.opt, self.task, self.model, x, y)
        waited = time.perf_counter()
        with blocking_call("the baseline's synchronize() (its gradient allreduces)"):
            self.opt.synchronize()
        began = time.perf_counter()
        waited = began - waited
        with self.opt.skip_synchronize():
            self.opt.step()
        return loss.item(), computed + time.perf_counter() - began, waited

    def sync_point(self, step):
        return True

    def handed_params(self):
        return list(self.model.parameters())


class AveragingTrainer(Trainer):
    """The library's optimizer wrappers; the inner optimizer's step is timed by its hooks."""

    def __init__(self, model, task, opt, inner: torch.optim.Optimizer):
        self.model, self.task, self.opt = model, task, opt
        self.inner = _Timed(inner)
        averager = opt.averager
        self._top = averager.top_level
        self._delay = averager.level_delays.get(self._top, 0)
        self._level_at = averager.level_at

    def step(self, x, y):
        loss, computed = _forward_backward(self.opt, self.task, self.model, x, y)
        began = time.perf_counter()
        self.opt.step()
        stepped, inner = time.perf_counter() - began, self.inner.take()
        return loss.item(), computed + inner, stepped - inner

    def sync_point(self, step):
        # after `step` steps: the top-level round fired at averager step `step - 1 - delay`
        # has been applied and nothing is in flight across the link
        fired = step - 1 - self._delay
        return fired >= 0 and self._level_at(fired) == self._top

    def handed_params(self):
        # every method alike, DiLoCo too: the ranks' parameters, averaged over the ranks later
        # (fresher than DiLoCo's global copy, which lags by up to H + delay steps: docs/demo.md)
        return list(self.model.parameters())

    def link_bytes(self):
        return float(hva.traffic().cross_node_bytes)


def _outer(args):
    nesterov = args.outer_momentum > 0
    return lambda params: torch.optim.SGD(params, lr=args.outer_lr, momentum=args.outer_momentum,
                                          nesterov=nesterov)


def _level_delays(hierarchy: dict, node_delay: int, top_delay: int) -> dict:
    """An overlapped hierarchy's ``delay=``: the top level's, and ``--node-delay`` below it."""
    top = max(hierarchy)
    return {period: top_delay if period == top else node_delay for period in hierarchy}


def build_trainer(method: str, model: torch.nn.Module, task, args, *,
                  warmup_steps: int = 0) -> Trainer:
    """The method's trainer over ``model`` (same construction on every rank)."""
    if method == "baseline":
        return BaselineTrainer(model, task, args)
    inner = task.inner_optimizer(model.parameters(), args.lr)
    # what crosses the link (the top level) travels in --cross-node-compression
    wire = {"compression": args.cross_node_compression, "error_feedback": args.error_feedback}
    if method in ("local", "local-overlap"):
        delay = args.delay if method == "local-overlap" else 0
        opt = hva.PostLocalSGDOptimizer(
            inner, hva.PeriodicModelAverager(args.period, delay=delay, **wire))
    elif method == "postlocal":
        opt = hva.PostLocalSGD(
            inner, model.named_parameters(), start_localSGD_iter=warmup_steps,
            averager=hva.PeriodicModelAverager(args.period, warmup_steps=warmup_steps, **wire),
            local_group_size=args.local_group_size)
    elif method in ("hierarchical", "hierarchical-overlap"):
        top = max(args.hierarchy)
        delay = (_level_delays(args.hierarchy, args.node_delay, args.delay)
                 if method == "hierarchical-overlap" else 0)
        opt = hva.PostLocalSGDOptimizer(inner, hva.HierarchicalModelAverager(
            args.hierarchy, delay=delay, compression={top: wire["compression"]},
            error_feedback=wire["error_feedback"]))
    elif method in ("diloco", "hierdiloco"):
        top = args.outer_period if method == "diloco" else max(args.outer_hierarchy)
        averager = (hva.PeriodicModelAverager(args.outer_period, delay=args.outer_delay, **wire)
                    if method == "diloco" else
                    hva.HierarchicalModelAverager(args.outer_hierarchy, delay=_level_delays(
                                                      args.outer_hierarchy, args.node_delay,
                                                      args.outer_delay),
                                                  compression={top: wire["compression"]},
                                                  error_feedback=wire["error_feedback"]))
        warmup = args.outer_momentum_warmup if args.outer_momentum else 0
        opt = hva.DiLoCo(inner, averager, outer_optimizer=_outer(args), outer_scheduler=(
            (lambda outer: hva.OuterMomentumWarmup(outer, warmup)) if warmup else None))
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    return AveragingTrainer(model, task, opt, inner)
