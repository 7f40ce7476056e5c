"""bench/eager_sim.py's variants against what they must reduce to (single process)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from eager_sim import simulate  # noqa: E402

from hvd_averaging.examples.tasks import CharLMTask  # noqa: E402


@pytest.fixture(scope="module")
def task():
    return CharLMTask(width=32, layers=1, context=16)


def _run(task, variant, ranks, steps=18, period=4):
    return simulate(variant, task, seed=0, ranks=ranks, steps=steps, period=period, outer_lr=0.5,
                    momentum=0.9, warmup=2, eval_at=lambda n: True)


def test_eager_on_one_rank_is_the_blocking_outer_step(task):
    # one rank: the average that arrived is its own stale share, which its fresh one replaces
    eager, blocking = _run(task, "eager-whole", 1), _run(task, "blocking", 1)
    assert [n for n, _ in eager] == [n for n, _ in blocking] == list(range(1, 19))
    # the same sums up to float32 rounding (a + (b - a) for b)
    assert [loss for _, loss in eager] == pytest.approx([loss for _, loss in blocking], abs=1e-4)


def test_the_variants_differ_once_a_delayed_round_lands_and_not_before(task):
    curves = {v: _run(task, v, 2) for v in ("blocking", "delay-half", "delay-whole", "eager-whole")}
    # the first round fires after the first step; a delayed one changes nothing before it lands
    assert curves["delay-half"][:2] == curves["delay-whole"][:2]
    assert curves["delay-half"][2] != curves["delay-whole"][2]  # landed after step 3 (counter 2)
    assert curves["blocking"][0] != curves["delay-half"][0]  # applied at once
    assert len({tuple(c) for c in curves.values()}) == 4


def test_the_allreduce_variant_steps_on_the_gradient_of_every_rank_s_batch(task):
    import torch
    curve = simulate("allreduce", task, seed=0, ranks=2, steps=5, period=4, outer_lr=0.5,
                     momentum=0.9, warmup=2, eval_at=lambda n: True, inner_lr=1e-2)
    # the reference: one model on both ranks' batches at once (equal sizes: the same mean loss)
    model = task.model(0)
    optimizer = task.inner_optimizer(model.parameters(), 1e-2)
    feeds = [task.batches(rank, 2, 0) for rank in range(2)]
    expected = []
    for step in range(5):
        (x0, y0), (x1, y1) = next(feeds[0]), next(feeds[1])
        optimizer.zero_grad()
        task.loss(model, torch.cat([x0, x1]), torch.cat([y0, y1])).backward()
        optimizer.step()
        expected.append((step + 1, task.evaluate(model)))
    assert [n for n, _ in curve] == [1, 2, 3, 4, 5]
    assert [loss for _, loss in curve] == pytest.approx([loss for _, loss in expected], abs=1e-5)
    # and it differs from a local method's average from the first step on
    assert curve[0][1] != _run(task, "blocking", 2)[0][1]


def test_the_inner_learning_rate_is_the_task_s_unless_given(task):
    given = simulate("delay-half", task, seed=0, ranks=2, steps=3, period=4, outer_lr=0.5,
                     momentum=0.9, warmup=2, eval_at=lambda n: True, inner_lr=task.default_lr)
    assert given == _run(task, "delay-half", 2, steps=3)
    assert given != simulate("delay-half", task, seed=0, ranks=2, steps=3, period=4, outer_lr=0.5,
                             momentum=0.9, warmup=2, eval_at=lambda n: True, inner_lr=1e-4)
