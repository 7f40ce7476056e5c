"""The demo's tasks and the race's pure rules: grid, time to target, arguments, summaries
(single process; the race itself runs under horovodrun in tools/run_tests.py)."""
import argparse

import pytest
import torch

from hvd_averaging.examples.methods import METHODS, check_race_args, parse_hierarchy, parse_methods
from hvd_averaging.examples.race import Snapshot, TrainingClock
from hvd_averaging.examples.race_rules import grid_times, pick_on_grid, time_to_reach
from hvd_averaging.examples.report import summarize, table
from hvd_averaging.examples.tasks import CharLMTask, stdlib_text
from hvd_averaging.examples.train import parse_args


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


def test_time_to_reach_interpolates_between_the_points_around_the_first_crossing():
    curve = [(0.0, 0, 0.0, 4.0), (1.5, 3, 1.0, 2.6), (3.0, 6, 2.0, 2.4), (4.0, 7, 3.0, 2.45),
             (5.0, 8, 4.0, 2.3)]
    # 2.5 is halfway from 2.6 (at 1.5 s) to 2.4 (at 3.0 s)
    assert time_to_reach(curve, 2.5) == pytest.approx(2.25)
    assert time_to_reach(curve, 2.6) == 1.5  # a point at the target is its own time
    assert time_to_reach(curve, 2.4) == pytest.approx(3.0)
    # the first crossing counts, not a later one after the curve went back up
    assert time_to_reach(curve, 2.42) == pytest.approx(1.5 + 1.5 * 0.18 / 0.2)
    assert time_to_reach(curve, 2.35) == pytest.approx(4.0 + 0.1 / 0.15)  # 2.45 -> 2.3
    assert time_to_reach(curve, 2.0) is None
    assert time_to_reach(curve, 4.5) == 0.0  # the start already reaches it
    # higher is better: 0.8 is three quarters of the way from 0.5 to 0.9
    assert time_to_reach([(0.0, 0, None, 0.5), (2.0, 1, None, 0.9)], 0.8,
                         lower_is_better=False) == pytest.approx(1.5)


def test_grid_covers_zero_to_the_budget():
    assert grid_times(10.0, 4) == [0.0, 2.5, 5.0, 7.5, 10.0]


def _snap(seconds, step):
    return Snapshot(seconds, step, 0.0, torch.tensor([float(step)]))


def test_pick_on_grid_takes_the_step_that_crossed_each_time_and_the_final_after_the_end():
    snaps = [_snap(0.0, 0), _snap(0.9, 1), _snap(2.1, 2), _snap(2.6, 3), _snap(4.2, 4)]
    final = _snap(4.4, 5)
    picked = pick_on_grid(snaps, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], final)
    assert [p.step for p in picked] == [0, 2, 2, 4, 4, 5]


def test_training_clock_leaves_out_paused_time():
    clock = TrainingClock()
    with clock.paused():
        import time
        time.sleep(0.2)
    assert clock.now() < 0.1


def _args(*argv):
    return parse_args(["--quiet", *argv])


def test_race_arguments_defaults_are_accepted():
    args = _args()
    assert args.methods[0] == "baseline" and args.outer_delay < args.outer_period
    assert _args("--full").seeds == 3
    long = _args("--long")
    assert (long.seeds, long.target_budget_s) == (3, 300.0)
    assert args.seeds == 1 and _args("--long", "--seeds", "1").seeds == 1  # --seeds wins


def test_cross_node_compression_is_named_in_every_averaging_label():
    from hvd_averaging.examples.methods import label
    args = _args("--cross-node-compression", "int8", "--error-feedback").for_world(0.01, 4)
    assert label("baseline", args) == "hvd.DistributedOptimizer"
    for method in ("local", "hierarchical", "diloco", "hierdiloco"):
        assert label(method, args).endswith(", int8 with error feedback across nodes")
    plain = _args().for_world(0.01, 4)
    assert "across nodes" not in label("local", plain)
    assert label("local", args.with_wire("none", False)) == label("local", plain)
    with pytest.raises(SystemExit):  # argparse names the choices
        _args("--cross-node-compression", "int4")


def test_outer_momentum_warmup_is_named_and_dropped_without_momentum():
    from hvd_averaging.examples.methods import label
    default = _args().for_world(0.01, 4)
    assert "momentum 0.9 warmed up over 8 outer steps" in label("diloco", default)
    assert "warmed up" not in label("diloco", _args("--outer-momentum-warmup", "0").for_world(0.01, 4))
    assert "warmed up" not in label("diloco", _args("--outer-momentum", "0").for_world(0.01, 4))


def test_node_delay_overlaps_the_lower_levels_of_the_overlapped_hierarchies_only():
    from hvd_averaging.examples.methods import _level_delays, label
    args = _args("--node-delay", "1").for_world(0.01, 4)
    assert _level_delays(args.hierarchy, args.node_delay, args.delay) == {4: 1, 16: 8}
    assert _level_delays({2: 2, 4: 4, 16: 8}, 1, 8) == {2: 1, 4: 1, 16: 8}
    assert label("hierarchical-overlap", args).endswith("(overlap 8, node overlap 1)")
    assert "node overlap 1" in label("hierdiloco", args)
    for method in ("hierarchical", "diloco", "local-overlap"):
        assert "node overlap" not in label(method, args)
    assert "node overlap" not in label("hierdiloco", _args("--node-delay", "0").for_world(0.01, 4))
    assert _args().for_world(0.01, 4).node_delay == 1  # the default since the 3-seed race


@pytest.mark.parametrize("argv, words", [
    (["--budget-s", "0"], ["--budget-s 0.0", "positive"]),
    (["--budget-s", "-3"], ["--budget-s -3.0", "positive"]),
    (["--outer-delay", "16", "--outer-period", "16"], ["--outer-delay 16", "0..15"]),
    (["--outer-delay", "-1"], ["--outer-delay -1"]),
    (["--delay", "16"], ["--delay 16", "1..15"]),
    (["--delay", "0"], ["--delay 0", "shorter than their period"]),
    (["--methods", "diloco"], ["without the baseline", "--budget-s"]),
    (["--period", "0"], ["--period 0", "positive integer"]),
    (["--outer-momentum", "1.0"], ["--outer-momentum 1.0", "[0, 1)"]),
    (["--outer-momentum-warmup", "-1"], ["--outer-momentum-warmup -1", ">= 0"]),
    (["--lr", "0"], ["--lr 0.0", "positive"]),
    (["--node-delay", "4"], ["--node-delay 4", "0..3"]),
    (["--node-delay", "2", "--hierarchy", "2:2,16:4"], ["--node-delay 2", "0..1"]),
    (["--node-delay", "-1"], ["--node-delay -1", "shortest period (4)"]),
    (["--node-delay", "4", "--hierarchy", "4:2,16:4", "--outer-hierarchy", "8:2,16:4"],
     ["--node-delay 4", "0..3"]),
])
def test_bad_race_arguments_name_the_value_and_the_rule(argv, words):
    with pytest.raises(ValueError) as raised:
        _args(*argv)
    for word in words:
        assert word in str(raised.value)


def test_settings_are_resolved_once_and_frozen():
    import dataclasses
    fast = _args("--fast")
    assert (fast.period, fast.outer_period, fast.outer_delay, fast.grid_points) == (4, 4, 2, 8)
    world = fast.for_world(0.006, 4)
    assert world.lr == 0.006 and world.hierarchy == {2: 2, 4: 4} and world.local_group_size == 2
    assert _args("--lr", "0.1").for_world(0.006, 1).lr == 0.1
    assert _args().for_world(0.006, 1).local_group_size == 1
    # node rounds every 4 steps under a top period of 16 (docs/demo.md's A/B), 2 where 4 cannot be
    default = _args().for_world(0.006, 4)
    assert default.hierarchy == {4: 2, 16: 4} and default.outer_hierarchy == {4: 2, 16: 4}
    assert _args("--period", "10").for_world(0.006, 4).hierarchy == {2: 2, 10: 4}
    assert _args("--node-delay", "3").node_delay == 3  # below the default node period of 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        world.lr = 1.0
    assert world.as_json()["hierarchy"] == {"2": 2, "4": 4} and "out" not in world.as_json()


def test_a_method_alone_runs_with_a_budget():
    assert _args("--methods", "diloco", "--budget-s", "30").methods == ("diloco",)


def test_unknown_method_names_the_choices():
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        parse_methods("baseline,sgd")
    assert "'sgd'" in str(raised.value) and all(m in str(raised.value) for m in METHODS)


def test_summary_means_over_seeds_and_a_missed_target_is_not_averaged_away():
    seeds = [dict(final_loss=2.0, steps=10, wall_s=5.0, time_to_target_s=2.0, speedup_vs_baseline=2.5,
                  compute_utilization=0.9, cross_node_mb_per_rank=1.0, curve=[]),
             dict(final_loss=2.2, steps=12, wall_s=5.0, time_to_target_s=None, speedup_vs_baseline=None,
                  compute_utilization=0.8, cross_node_mb_per_rank=None, curve=[])]
    summary = summarize("local", "local SGD", seeds)
    assert summary["final_loss"] == pytest.approx(2.1)
    assert summary["final_loss_spread"] == [2.0, 2.2]
    assert summary["time_to_target_s"] is None and summary["reached_in"] == "1 of 2"
    assert "reached in 1 of 2 seeds" in table([summary], "held-out loss")


def test_parse_hierarchy():
    assert parse_hierarchy("2:2,16:4") == {2: 2, 16: 4}


def test_a_link_too_slow_for_the_timeout_is_refused_with_the_fix():
    import hvd_averaging as hva
    from hvd_averaging.examples.calibration import check_link_fits_timeout

    args = _args()
    limit = hva.timeout()
    check_link_fits_timeout({"rate_mbit": 10.0, "allreduce_s": limit / 2 - 0.1}, args)
    with pytest.raises(ValueError) as raised:
        check_link_fits_timeout({"rate_mbit": 0.5, "allreduce_s": limit}, args)
    assert "link rate 0.5 Mbit/s" in str(raised.value) and "HVA_TIMEOUT_SECONDS" in str(raised.value)


def test_stop_rule_estimates_the_present_from_the_clocks_agreed_at_earlier_points():
    from hvd_averaging.examples.race_rules import stop_at_sync_point

    assert not stop_at_sync_point(16, [], 16, 35.0)  # nothing agreed yet
    # one agreed point: 1.5 s for 1 step (start-up) puts step 17 at 25.5 s: no stop...
    assert not stop_at_sync_point(17, [(1.5, 1)], 16, 35.0)
    # ...but only a spent budget stops there, never the next point's estimate
    assert not stop_at_sync_point(22, [(1.5, 1)], 16, 35.0)
    assert stop_at_sync_point(24, [(1.5, 1)], 16, 35.0)  # 36 s: spent
    # 0.3 s a step between the last two points: step 100 is at 29.7 s; 16 more end at 34.5 s
    assert not stop_at_sync_point(100, [(20.1, 68), (24.9, 84)], 16, 35.0)
    # 0.3 s a step, from 0.6 s later: the next point would end at 35.1 s
    assert stop_at_sync_point(100, [(20.7, 68), (25.5, 84)], 16, 35.0)
    # only the last two points set the pace (an earlier slow start does not)
    assert not stop_at_sync_point(100, [(9.0, 1), (20.1, 68), (24.9, 84)], 16, 35.0)
    # the present estimated past the budget stops at once
    assert stop_at_sync_point(100, [(30.0, 68), (34.8, 84)], 16, 35.0)


def _seed(**fields) -> dict:
    """One seed's result as the race writes it; the fields a test does not set filled in."""
    return dict(final_loss=2.0, steps=10, wall_s=5.0, time_to_target_s=2.0,
                speedup_vs_baseline=2.5, compute_utilization=0.9, cross_node_mb_per_rank=1.0,
                curve=[]) | fields


def test_the_speedup_ceiling_and_each_method_s_fraction_of_it():
    from hvd_averaging.examples.report import speedup_ceiling, summarize, table
    baseline = [dict(wall_s=60.0, steps=48), dict(wall_s=66.0, steps=48)]
    ceiling = speedup_ceiling(baseline, 0.25)
    assert ceiling == pytest.approx((60 / 48 + 66 / 48) / 2 / 0.25)
    assert speedup_ceiling([], 0.25) is None
    seeds = [_seed(), _seed(final_loss=2.1, time_to_target_s=2.5, speedup_vs_baseline=2.0)]
    summary = summarize("local", "local SGD", seeds, ceiling)
    assert summary["fraction_of_ceiling"] == pytest.approx(2.25 / ceiling)
    assert [s["fraction_of_ceiling"] for s in seeds] == [2.5 / ceiling, 2.0 / ceiling]
    assert "| of the ceiling |" in table([summary], "loss")
    assert summarize("local", "l", [dict(seeds[0])], None)["fraction_of_ceiling"] is None


def test_each_seed_s_ceiling_at_the_host_s_speed_while_the_method_ran():
    from hvd_averaging.examples.report import run_ceiling, summarize, table
    # the baseline's seeds: 1.0 s and 1.2 s a step; the method computed 0.25 s and 0.2 s a step
    baseline = [dict(wall_s=60.0, steps=60), dict(wall_s=72.0, steps=60)]
    seeds = [_seed(speedup_vs_baseline=3.0, compute_step_s=0.25),
             _seed(speedup_vs_baseline=4.5, compute_step_s=0.2)]
    assert run_ceiling(baseline[0], seeds[0]) == pytest.approx(4.0)
    assert run_ceiling(None, seeds[0]) is None
    assert run_ceiling(baseline[0], dict(seeds[0], compute_step_s=None)) is None
    summary = summarize("local", "local SGD", seeds, 5.0, baseline)
    # each seed against its own baseline seed, not the mean of the baselines
    assert [s["run_ceiling"] for s in seeds] == pytest.approx([4.0, 6.0])
    assert [s["fraction_of_run_ceiling"] for s in seeds] == pytest.approx([0.75, 0.75])
    assert [s["fraction_of_ceiling"] for s in seeds] == pytest.approx([0.6, 0.9])
    assert summary["fraction_of_run_ceiling"] == pytest.approx(0.75)
    assert "| 0.75 (0.60-0.90) | 0.75 (0.75-0.75) |" in table([summary], "loss")
    # a seed that missed the target has no fraction; a seed without a baseline is refused
    missed = summarize("local", "l", [dict(seeds[0], speedup_vs_baseline=None)], 5.0, baseline[:1])
    assert missed["seeds"][0]["run_ceiling"] == pytest.approx(4.0)
    assert missed["fraction_of_run_ceiling"] is None
    with pytest.raises(ValueError, match="2 seeds against the baseline's 1"):
        summarize("local", "l", [dict(s) for s in seeds], 5.0, baseline[:1])
    # without a baseline in the race: the column shows "-"
    assert "| 0.75 (0.60-0.90) | - |" in table([summarize("local", "l", [dict(s) for s in seeds],
                                                           5.0)], "loss")


def test_each_method_s_compute_per_step_is_in_the_table_in_milliseconds():
    # the host's speed while each method ran, beside the calibration's step
    seeds = [_seed(compute_step_s=0.2),
             _seed(final_loss=2.1, time_to_target_s=2.5, speedup_vs_baseline=2.0,
                   compute_step_s=0.25)]
    summary = summarize("local", "local SGD", seeds)
    assert summary["compute_step_s"] == pytest.approx(0.225)
    text = table([summary], "loss")
    assert "| compute ms/step |" in text and "| 0.90 | 225 (200-250) |" in text
    old_run = [{k: v for k, v in seed.items() if k != "compute_step_s"} for seed in seeds]
    assert "| 0.90 | - |" in table([summarize("local", "local SGD", old_run)], "loss")


@pytest.mark.parametrize("tag, rank", [("[1,3]<stderr>:", 3), ("[2]<stderr>:", 2)])
def test_the_demo_launcher_keeps_every_rank_s_tail_under_mpi_and_gloo(tag, rank, capsys):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from run_demo import TAIL_LINES, RankOutput
    output = RankOutput()
    zero = tag.replace(str(rank), "0").replace("stderr", "stdout")
    output.feed(f"{zero}shown as it comes{zero}\n")  # the launcher may tag pieces of a line
    for i in range(TAIL_LINES + 5):
        output.feed(f"{tag}line {i}\n")
    output.feed("the launcher's own line\n")
    shown = capsys.readouterr().out
    assert "shown as it comes\n" in shown and "the launcher's own line" in shown
    assert "<stdout>" not in shown.split("the launcher's own line")[0]
    assert "line 0" not in shown  # another rank's lines wait for a failure
    report = output.failure_report()
    assert f"rank {rank}'s output" in report and "rank 0's output" in report
    assert f"line {TAIL_LINES + 4}" in report and "line 4\n" not in report


def test_the_speed_up_a_user_would_have_seen_after_the_first_minute():
    from hvd_averaging.examples.race_rules import speedup_at
    from hvd_averaging.examples.report import summarize, table
    baseline = [(0.0, 0, None, 4.0), (30.0, 10, None, 3.0), (60.0, 20, None, 2.5),
                (90.0, 30, None, 2.2), (120.0, 40, None, 2.0)]
    method = [(0.0, 0, None, 4.0), (15.0, 20, None, 2.6), (20.0, 30, None, 2.5),
              (40.0, 60, None, 2.1), (60.0, 90, None, 1.9)]
    # at 60 s the baseline is at 2.5, reached at 20 s: 3x; at 120 s at 2.0, reached halfway
    # from 2.1 (40 s) to 1.9 (60 s): 50 s, 2.4x
    assert speedup_at(baseline, method, 60.0) == pytest.approx(3.0)
    assert speedup_at(baseline, method, 120.0) == pytest.approx(2.4)
    # the next baseline point: 2.2 at 90 s, reached 3/4 of the way from 2.5 (20 s) to 2.1 (40 s)
    assert speedup_at(baseline, method, 61.0) == pytest.approx(90.0 / 35.0)
    assert speedup_at(baseline, method, 121.0) is None  # the baseline never got there
    assert speedup_at(baseline, method[:3], 120.0) is None  # never reached 2.0
    seeds = [dict(final_loss=1.9, steps=90, wall_s=120.0, time_to_target_s=60.0,
                  speedup_vs_baseline=2.0, speedup_at_60s=3.0, compute_utilization=0.9,
                  communication_share=0.1, cross_node_mb_per_rank=1.0)]
    text = table([summarize("local", "local SGD", seeds)], "loss")
    assert "| local SGD | 3.00x | 2.00x | 0.67 |" in text
