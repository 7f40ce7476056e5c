"""One-shot int8 rounds with error feedback (``hva.average_parameters(params,
compression=hva.Int8(error_feedback=True))``) keep each tensor list's residuals from one call to
the next, as an averager level does: the mean of repeated rounds converges on the exact average
instead of keeping the error of one round."""
import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva

ROUNDS = 16


def every_rank_mean(values, name):
    return hvd.allgather(values.reshape(1, -1), name=name).double().mean(0)


def one_shot_rounds(p, values, rounds, compression):
    """Average ``p`` one-shot ``rounds`` times, each round starting again from ``values``."""
    results = []
    for _ in range(rounds):
        with torch.no_grad():
            p.copy_(values)
        hva.average_parameters([p], compression=compression)
        results.append(p.detach().double().clone())
    return results


def new_param(values):
    p = torch.nn.Parameter(values.clone())
    p.grad = torch.zeros_like(p)
    return p


def mean_error(results, exact):
    return float((torch.stack(results).mean(0) - exact).abs().mean())


def test_one_shot_error_feedback_cancels_errors_as_the_averagers_do(world, rank):
    """At the commit before this test the residual was dropped after every call: the mean of 16
    one-shot rounds was as far from the exact average as one round."""
    values = torch.randn(20_000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    exact = every_rank_mean(values, "test.oneshot.exact")
    plain = one_shot_rounds(new_param(values), values, ROUNDS, hva.Int8())
    fed = one_shot_rounds(new_param(values), values, ROUNDS, hva.Int8(error_feedback=True))
    one_round = float((plain[0] - exact).abs().mean())
    assert one_round > 0  # int8 did round
    assert mean_error(plain, exact) == pytest.approx(one_round, rel=1e-6)
    assert mean_error(fed, exact) < 0.25 * one_round
    # the same rounds, bit for bit, as an averager level keeping its residuals
    averager = hva.PeriodicModelAverager(1, compression="int8", error_feedback=True)
    p = new_param(values)
    by_averager = []
    for _ in range(ROUNDS):
        with torch.no_grad():
            p.copy_(values)
        averager.average_parameters([p])
        by_averager.append(p.detach().double().clone())
    assert all(torch.equal(a, b) for a, b in zip(fed, by_averager))
    # every rank holds the same values
    gathered = hvd.allgather(fed[-1].reshape(1, -1), name="test.oneshot.same")
    assert all(torch.equal(gathered[0], row) for row in gathered)


def test_one_shot_residuals_are_kept_per_tensor_list(world, rank):
    """Two models averaged one-shot in turn: each keeps its own residuals (one shared memory
    would feed one model's quantization error into the other's round)."""
    first_values = torch.randn(20_000, generator=torch.Generator().manual_seed(rank))
    second_values = torch.randn(20_000, generator=torch.Generator().manual_seed(100 + rank)) * 3
    exact = [every_rank_mean(first_values, "test.oneshot.first"),
             every_rank_mean(second_values, "test.oneshot.second")]
    params = [new_param(first_values), new_param(second_values)]
    results = [[], []]
    compression = hva.Int8(error_feedback=True)
    for _ in range(ROUNDS):
        for which, values in enumerate((first_values, second_values)):
            results[which] += one_shot_rounds(params[which], values, 1, compression)
    for which, values in enumerate((first_values, second_values)):
        alone = one_shot_rounds(new_param(values), values, ROUNDS, compression)
        assert all(torch.equal(a, b) for a, b in zip(results[which], alone))
        one_round = float((alone[0] - exact[which]).abs().mean())
        assert mean_error(results[which], exact[which]) < 0.25 * one_round
