"""Pure rules of the float16 wire and of delayed averaging, exhaustively."""
import math

import pytest
import torch

from hvd_averaging.schedule import check_delay, delayed_level_pieces, level_delays, level_values
from hvd_averaging.transports.in_pieces import piece_bounds
from hvd_averaging.wire import FP16_MAX, fp16_error_bound, fp16_scale
from hvd_averaging.wire.fp16 import FP16_SUM_LIMIT


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8, 64, 1024])
@pytest.mark.parametrize("absmax", [1e-30, 1e-6, 0.5, 1.0, 3.0, 65504.0, 1e6, 3e38])
def test_fp16_scale_is_the_largest_power_of_two_that_keeps_the_sum_in_range(absmax, ranks):
    scale = fp16_scale(absmax, ranks)
    assert math.log2(scale).is_integer()
    assert ranks * absmax * scale <= FP16_SUM_LIMIT < FP16_MAX
    if scale < 2.0 ** 100:  # not clamped: twice the scale would pass the limit
        assert ranks * absmax * scale * 2 > FP16_SUM_LIMIT
    # a scaled value and the scaled sum are finite in float16, and scaling back is exact
    value = torch.tensor([absmax * scale * ranks], dtype=torch.float32)
    assert bool(torch.isfinite(value.half()).all())
    assert torch.tensor([absmax], dtype=torch.float64).mul(scale).div(scale).item() == absmax


def test_fp16_scale_edges():
    assert fp16_scale(0.0, 4) == 1.0
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="absmax must be a finite number >= 0"):
            fp16_scale(bad, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ranks must be an integer >= 1"):
            fp16_scale(1.0, bad)
    with pytest.raises(ValueError, match="do not fit float16 at any scale"):
        fp16_scale(1e300, 2)


def test_fp16_error_bound_holds_for_a_simulated_round():
    """Cast, sum in float16 (rounding after every addition, as Horovod's float16 sums do),
    divide: within the bound, elementwise, for magnitudes far apart."""
    g = torch.Generator().manual_seed(0)
    ranks = 8
    values = torch.randn(ranks, 10_000, generator=g, dtype=torch.float64) * torch.logspace(-6, 6, 10_000, dtype=torch.float64)
    scale = fp16_scale(float(values.abs().max()), ranks)
    total = torch.zeros(10_000, dtype=torch.float16)
    for row in values:
        total = (total.float() + (row * scale).half().float()).half()
    average = (total.float() / ranks).half().double() / scale
    exact = values.mean(0)
    bound = fp16_error_bound(values.abs().mean(0), ranks, scale)
    assert bool(((average - exact).abs() <= bound).all())


@pytest.mark.parametrize("period", [1, 2, 5, 100])
def test_check_delay_accepts_zero_to_period_minus_one(period):
    for delay in range(period):
        assert check_delay(delay, period) == delay
    with pytest.raises(ValueError, match=f"delay {period} must be smaller than the period {period}"):
        check_delay(period, period)


@pytest.mark.parametrize("bad, match", [(-1, "delay must be >= 0"), (1.0, "must be an integer"),
                                        ("2", "must be an integer"), (True, "must be an integer")])
def test_check_delay_names_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        check_delay(bad, 4)


def test_level_delays_and_values():
    assert level_delays(0, [2, 8]) == {2: 0, 8: 0}
    assert level_delays(7, [2, 8]) == {2: 0, 8: 7}
    assert level_delays({2: 1, 8: 5}, [2, 8]) == {2: 1, 8: 5}
    with pytest.raises(ValueError, match="level with period 2: delay 2 must be smaller"):
        level_delays({2: 2}, [2, 8])
    with pytest.raises(ValueError, match=r"delay names period\(s\) \[4\]"):
        level_delays({4: 1}, [2, 8])
    assert level_values("x", [2, 8], "compression", None) == {2: "x", 8: "x"}
    assert level_values({8: "x"}, [2, 8], "compression", None) == {2: None, 8: "x"}


def test_a_delayed_level_above_another_travels_in_one_piece_per_step_of_its_window():
    assert delayed_level_pieces({2: 0, 16: 8}) == {16: 8}
    assert delayed_level_pieces({2: 1, 8: 3}) == {8: 3}  # the lowest level travels whole
    assert delayed_level_pieces({2: 0, 4: 2, 16: 8}) == {4: 2, 16: 8}
    assert delayed_level_pieces({2: 0, 16: 1}) == {}  # one step: nothing to cut
    assert delayed_level_pieces({16: 8}) == {} and delayed_level_pieces({}) == {}


def test_pieces_are_at_least_the_minimum_and_cover_the_buffer():
    # the race's 1.4 MiB model: 5 pieces of >= 256 KiB (64 blocks of 1024 float32) out of 8 allowed
    bounds = piece_bounds(367_000, 1024, 8, min_blocks=64)
    assert len(bounds) == 5 and bounds[0][0] == 0 and bounds[-1][1] == 367_000
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all((hi - lo) * 4 >= 256 * 1024 for lo, hi in bounds[:-1])
    assert piece_bounds(40_000, 1024, 8, min_blocks=64) == [(0, 40_000)]

