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
