"""The race's results: per-method summaries over seeds, the table, ``results.json`` and the plots."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["speedup_ceiling", "run_ceiling", "summarize", "table", "plot"]


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    """Mean, or None when any value is None (a seed that did not reach the target)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(values)


def _spread(values: Sequence[Optional[float]]) -> Optional[list[float]]:
    known = [v for v in values if v is not None]
    return [min(known), max(known)] if len(known) > 1 else None


def speedup_ceiling(baseline_seeds: list[dict], compute_step_s: float) -> Optional[float]:
    """The most any method could gain over the baseline: its wall seconds per step in the race
    over one step of pure compute (same model, batch and inner optimizer, no communication;
    measured in the calibration). None without a baseline."""
    if not baseline_seeds or not compute_step_s > 0:
        return None
    return statistics.fmean(s["wall_s"] / s["steps"] for s in baseline_seeds) / compute_step_s


def run_ceiling(baseline_seed: Optional[dict], seed: dict) -> Optional[float]:
    """The ceiling at the host's speed while the method ran: the baseline's wall seconds per
    step in the same seed over the method's own compute seconds per step in its run. On a
    shared host whose speed drifts, the calibration's step (minutes earlier) can be faster or
    slower than what the method met; this one compares the method with what it could have
    done as it ran. None where either is unknown."""
    if not baseline_seed or not seed.get("compute_step_s"):
        return None
    return baseline_seed["wall_s"] / baseline_seed["steps"] / seed["compute_step_s"]


def summarize(method: str, label: str, seeds: list[dict], ceiling: Optional[float] = None,
              baseline_seeds: Optional[list[dict]] = None) -> dict:
    """One method over its seeds: means (None where a seed missed), min-max spreads, per seed;
    with a ``ceiling``, each speed-up's ``fraction_of_ceiling``; with the baseline's seeds (in
    the same order), each seed's ``run_ceiling`` and ``fraction_of_run_ceiling``."""
    if baseline_seeds is not None and len(baseline_seeds) != len(seeds):
        raise ValueError(f"{method}: {len(seeds)} seeds against the baseline's "
                         f"{len(baseline_seeds)}; each seed needs its own baseline")
    for i, seed in enumerate(seeds):
        speedup = seed.get("speedup_vs_baseline")
        seed["fraction_of_ceiling"] = None if speedup is None or not ceiling else speedup / ceiling
        own = run_ceiling(baseline_seeds[i], seed) if baseline_seeds else None
        seed["run_ceiling"] = own
        seed["fraction_of_run_ceiling"] = None if speedup is None or not own else speedup / own
    keys = ("final_loss", "steps", "wall_s", "time_to_target_s", "speedup_vs_baseline",
            "fraction_of_ceiling", "run_ceiling", "fraction_of_run_ceiling",
            "compute_utilization", "compute_step_s", "communication_share",
            "cross_node_mb_per_rank", "speedup_at_60s")
    out = {"method": method, "label": label}
    for key in keys:
        out[key] = _mean([s.get(key) for s in seeds])
        out[f"{key}_spread"] = _spread([s.get(key) for s in seeds])
    stages = [s["stage_shares"] for s in seeds if s.get("stage_shares")]
    out["stage_shares"] = {stage: statistics.fmean(s[stage] for s in stages)
                           for stage in stages[0]} if stages else {}
    out["reached_in"] = f"{sum(s['time_to_target_s'] is not None for s in seeds)} of {len(seeds)}"
    out["seeds"] = seeds
    return out


def _fmt(value: Optional[float], spec: str, spread: Optional[list] = None, unit: str = "") -> str:
    if value is None:
        return "not reached"
    text = f"{value:{spec}}{unit}"
    if spread:
        text += f" ({spread[0]:{spec}}-{spread[1]:{spec}})"
    return text


def _ms(spread: Optional[list]) -> Optional[list]:
    return [v * 1e3 for v in spread] if spread else None


def table(methods: list[dict], metric: str) -> str:
    """Markdown: one row per method (mean over seeds, min-max in brackets with several)."""
    rows = [f"| method | {metric} at the budget | steps | wall s | time to target | speed-up "
            "| of the ceiling | of the run's ceiling | compute utilization | compute ms/step "
            "| communication share | MB/rank across the link |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        ttt = _fmt(m["time_to_target_s"], ".1f", m["time_to_target_s_spread"], " s")
        speedup = _fmt(m["speedup_vs_baseline"], ".2f", m["speedup_vs_baseline_spread"], "x")
        of_ceiling = _fmt(m["fraction_of_ceiling"], ".2f", m["fraction_of_ceiling_spread"])
        of_run = ("-" if m.get("fraction_of_run_ceiling") is None else
                  _fmt(m["fraction_of_run_ceiling"], ".2f", m["fraction_of_run_ceiling_spread"]))
        reached = sum(s["time_to_target_s"] is not None for s in m["seeds"])
        if 0 < reached < len(m["seeds"]):
            ttt, speedup, of_ceiling, of_run = f"reached in {m['reached_in']} seeds", "-", "-", "-"
        mb, share, step = m["cross_node_mb_per_rank"], m["communication_share"], m["compute_step_s"]
        rows.append(
            f"| {m['label']} | {_fmt(m['final_loss'], '.4f', m['final_loss_spread'])} | "
            f"{m['steps']:.0f} | {m['wall_s']:.1f} | {ttt} | {speedup} | {of_ceiling} | {of_run} | "
            f"{m['compute_utilization']:.2f} | "
            f"{'-' if step is None else _fmt(step * 1e3, '.0f', _ms(m['compute_step_s_spread']))} | "
            f"{'-' if share is None else f'{share:.2f}'} | "
            f"{'-' if mb is None else f'{mb:.1f}'} |")
    return "\n".join(rows) + _early_table(methods) + _stage_table(methods)


def _early_table(methods: list[dict]) -> str:
    """A long race: the speed-up after one minute against the one at the budget, and their
    ratio (does the first minute's speed-up hold?)."""
    measured = [m for m in methods if m["method"] != "baseline" and m.get("speedup_at_60s")]
    if not measured:
        return ""
    rows = ["", "", "Does the speed-up seen after one minute hold to the budget?", "",
            "| method | speed-up at 60 s | speed-up at the budget | budget / 60 s |",
            "|---|---|---|---|"]
    for m in measured:
        early, late = m["speedup_at_60s"], m["speedup_vs_baseline"]
        held = "-" if late is None else f"{late / early:.2f}"
        rows.append(f"| {m['label']} | {_fmt(early, '.2f', m['speedup_at_60s_spread'], 'x')} | "
                    f"{_fmt(late, '.2f', m['speedup_vs_baseline_spread'], 'x')} | {held} |")
    return "\n".join(rows)


def _stage_table(methods: list[dict]) -> str:
    """Where each method's communication time goes (shares of its wall time, from the
    library's counters), for the methods that average."""
    measured = [m for m in methods if any(m.get("stage_shares", {}).values())]
    if not measured:
        return ""
    stages = list(measured[0]["stage_shares"])
    rows = ["", "", "Share of the wall time per stage (rank mean; the library's counters):", "",
            "| method | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
    rows += [f"| {m['label']} | " + " | ".join(f"{m['stage_shares'][s]:.3f}" for s in stages)
             + " |" for m in measured]
    return "\n".join(rows)


def _mean_curve(seeds: list[dict], index: int) -> tuple[list, list, list, list]:
    """Grid-aligned mean curve over seeds: x (mean of coordinate ``index``), mean, min, max."""
    curves = [s["curve"] for s in seeds]
    length = min(len(c) for c in curves)
    xs, mean, low, high = [], [], [], []
    for i in range(length):
        coords = [c[i][index] for c in curves]
        if any(v is None for v in coords):
            return [], [], [], []
        values = [c[i][-1] for c in curves]
        xs.append(statistics.fmean(coords))
        mean.append(statistics.fmean(values))
        low.append(min(values))
        high.append(max(values))
    return xs, mean, low, high


def plot(methods: list[dict], target: Optional[float], budget_s: float, metric: str, title: str,
         out: Path) -> list[str]:
    """Held-out metric against wall seconds and against MB sent across the link per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for index, name, xlabel in ((0, "vs_wall_time", "training wall-clock seconds (evaluation excluded)"),
                                (2, "vs_link_mb", "MB per rank sent across the link between nodes")):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        shown = []
        for m in methods:
            xs, mean, low, high = _mean_curve(m["seeds"], index)
            if not xs:
                continue
            line, = ax.plot(xs, mean, marker=".", markersize=3, label=m["label"])
            if len(m["seeds"]) > 1:
                ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
            # zoom: leave out the first eighth of the budget, where every curve falls steeply
            shown += [v for x, v in zip(xs, mean) if index != 0 or x >= budget_s / 8]
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=1,
                       label=f"target: baseline's final {metric} {target:.3f}")
            shown.append(target)
        if shown:
            span = max(shown) - min(shown)
            ax.set_ylim(min(shown) - 0.05 * span, max(shown) + 0.05 * span)
        if index == 2:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{metric} (the model handed over: the ranks' average)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{metric.replace(' ', '_').replace('-', '_')}_{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path.name)
    return written
