"""The demo's tasks and its time-to-target rule (single process; the demo itself runs under
horovodrun in tools/run_tests.py)."""
import torch

from hvd_averaging.examples.tasks import CharLMTask, stdlib_text
from hvd_averaging.examples.train import parse_hierarchy, time_to_reach


def test_stdlib_text_is_large_and_fixed():
    text = stdlib_text()
    assert len(text) > 2_000_000
    assert text == stdlib_text()


def test_charlm_shards_are_disjoint_and_windows_shift_by_one():
    task = CharLMTask(batch_size=4, context=16)
    x0, y0 = next(task.batches(0, 4, seed=0))
    assert x0.shape == y0.shape == (4, 16)
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    assert int(x0.max()) < 128
    shard = len(task.train_tokens) // 4
    # rank 1's windows come from its own quarter of the training text
    x1, _ = next(task.batches(1, 4, seed=0))
    text = task.train_tokens[shard:2 * shard]
    first = x1[0]
    hits = (text.unfold(0, 16, 1) == first).all(1).nonzero()
    assert len(hits) >= 1
    assert task.eval_x.shape[1] == 16 and len(task.held_out) < len(task.train_tokens) / 10


def test_charlm_model_predicts_every_position():
    task = CharLMTask(width=32, layers=1, heads=2, context=16, batch_size=2)
    model = task.model(seed=0)
    x, y = next(task.batches(0, 1, seed=0))
    assert model(x).shape == (2, 16, 128)
    assert task.loss(model, x, y).item() > 3  # about ln(128) = 4.85 untrained


def test_time_to_reach_uses_the_first_point_at_the_target():
    result = {"curve": [(0.0, 0, 4.0), (1.5, 3, 2.6), (3.0, 6, 2.4), (4.0, 7, 2.45)]}
    assert time_to_reach(result, 2.5, lower_is_better=True) == 3.0
    assert time_to_reach(result, 2.0, lower_is_better=True) is None
    assert time_to_reach({"curve": [(0.0, 0, 0.5), (2.0, 1, 0.9)]}, 0.8, lower_is_better=False) == 2.0


def test_parse_hierarchy():
    assert parse_hierarchy("2:2,16:4") == {2: 2, 16: 4}
