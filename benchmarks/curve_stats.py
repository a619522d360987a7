"""The comparison and the plot of `learning_curve.py`'s runs: final reward, area under the curve, time to a level.

Statistics (stated in `learning_curve.py`'s docstring): per seed, `final` = the mean reward of the last
`final_window` steps and `auc` = the mean reward over all steps; ours minus TRL's across seeds with Welch's t
interval (unequal variances, Welch-Satterthwaite degrees of freedom): "equivalent" when the 90% interval lies inside
+-tolerance (TOST at 5%), "different" when the 95% interval excludes 0, "inconclusive" otherwise.

Completion lengths along the run (`length_blocks`): per block of `final_window` steps (the first step alone first:
both trainers sample it from the same weights), each seed's mean completion length over the block's steps; per
trainer the mean and spread over seeds, and ours minus TRL's with Welch's 95% interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LOG_KEYS = ("reward", "reward_std", "completions/mean_length", "entropy", "kl")
TRAINERS = {"trl": "GRPOTrainer", "infinite": "InfiniteGRPOTrainer"}


@dataclass
class Report:
    markdown: str
    level: float | None
    data: dict = field(default_factory=dict)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _std(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def rewards(run: dict) -> list[float]:
    return [s["reward"] for s in run["steps"] if "reward" in s]


def cumulative(run: dict, clock: str) -> list[float]:
    total, out = 0.0, []
    for s in run["steps"]:
        if "reward" in s:
            total += s.get(clock, 0.0)
            out.append(total)
    return out


def welch(a: list[float], b: list[float], level: float) -> tuple[float, float, float] | None:
    """(difference of means a - b, interval low, high) at two-sided `level`; None with fewer than 2 values a side."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = _std(a) ** 2 / len(a), _std(b) ** 2 / len(b)
    diff = _mean(a) - _mean(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = stats.t.ppf(0.5 + level / 2, df) * se
    return diff, diff - half, diff + half


def verdict(a: list[float], b: list[float], tolerance: float) -> tuple[str, tuple | None]:
    ci90, ci95 = welch(a, b, 0.90), welch(a, b, 0.95)
    if ci90 is None:
        return "too few seeds", None
    if -tolerance < ci90[1] and ci90[2] < tolerance:
        return "equivalent", ci90
    if _excludes_zero(ci95):
        return "different", ci95
    return "inconclusive", ci90


def _excludes_zero(ci: tuple) -> bool:
    return ci[1] > 0 or ci[2] < 0


def _span(ci90: tuple | None, ci95: tuple | None) -> str:
    """Both of Welch's intervals, and a difference that is significant yet inside the tolerance said in words."""
    if ci90 is None or ci95 is None:
        return ""
    text = (f"ours - TRL = {ci90[0]:+.3f}, 90% interval [{ci90[1]:+.3f}, {ci90[2]:+.3f}], "
            f"95% interval [{ci95[1]:+.3f}, {ci95[2]:+.3f}]")
    return text + ("; the 95% interval excludes 0" if _excludes_zero(ci95) else "")


def time_to_level(run: dict, level: float, smooth: int, clock: str) -> float | None:
    r, t = rewards(run), cumulative(run, clock)
    for i in range(len(r)):
        window = r[max(0, i - smooth + 1): i + 1]
        if sum(window) / len(window) >= level:
            return t[i]
    return None


def compare_runs(runs: list[dict], final_window: int, smooth: int, level: float | None, tolerance: float) -> Report:
    by = {k: [r for r in runs if r["trainer"] == k and rewards(r)] for k in TRAINERS}
    every = [r for rs in by.values() for r in rs]
    if not every:
        return Report("no run finished", None)
    first = _mean([rewards(r)[0] for r in every])
    final = {k: [_mean(rewards(r)[-final_window:]) for r in rs] for k, rs in by.items()}
    auc = {k: [_mean(rewards(r)) for r in rs] for k, rs in by.items()}
    if level is None:
        pooled_final = _mean([x for xs in final.values() for x in xs])
        level = round(first + 0.5 * (pooled_final - first), 3)
    lines = [f"Level: mean reward {level:.3g} (first step's mean over all runs: {first:.3g}); final = mean of the "
             f"last {final_window} steps; a seed reaches the level when its {smooth}-step running mean does.", "",
             "| trainer | seeds | final reward | AUC (mean reward) | wall s/step | CPU s/step | wall s to level "
             "| CPU s to level | reached | engine |", "|---|---|---|---|---|---|---|---|---|---|"]
    data: dict = {"level": level, "first_step_reward": first, "trainers": {}}
    reach = {}
    for k, rs in by.items():
        if not rs:
            continue
        wall = [time_to_level(r, level, smooth, "wall_s") for r in rs]
        cpu = [time_to_level(r, level, smooth, "cpu_s") for r in rs]
        reach[k] = ([x for x in wall if x is not None], [x for x in cpu if x is not None])
        steps = [s for r in rs for s in r["steps"] if "wall_s" in s]
        row = {"seeds": len(rs), "final": final[k], "auc": auc[k],
               "wall_s_per_step": _mean([s["wall_s"] for s in steps]),
               "cpu_s_per_step": _mean([s["cpu_s"] for s in steps]), "wall_to_level": wall, "cpu_to_level": cpu,
               "uses_engine": [r.get("uses_engine") for r in rs]}
        data["trainers"][k] = row

        def pm(xs):
            return _pm((_mean(xs), _std(xs)), ".3f")

        lines.append(f"| {TRAINERS[k]} | {len(rs)} | {pm(final[k])} | {pm(auc[k])} | {row['wall_s_per_step']:.1f} | "
                     f"{row['cpu_s_per_step']:.1f} | {_fmt(_mean(reach[k][0]))} | {_fmt(_mean(reach[k][1]))} | "
                     f"{len(reach[k][0])}/{len(rs)} | {all(row['uses_engine']) if k == 'infinite' else '-'} |")
    if by["infinite"] and by["trl"]:
        lines.append("")
        for name, values in (("final reward", final), ("AUC", auc)):
            word, ci = verdict(values["infinite"], values["trl"], tolerance)
            ci90, ci95 = welch(values["infinite"], values["trl"], 0.90), welch(values["infinite"], values["trl"], 0.95)
            data[f"{name}_verdict"] = {"verdict": word, "interval": ci, "welch90": ci90, "welch95": ci95}
            lines.append(f"- {name}: {word} (tolerance ±{tolerance:g}; {_span(ci90, ci95)})")
        for i, clock in enumerate(("wall", "CPU")):
            ours, trl = _mean(reach["infinite"][i]), _mean(reach["trl"][i])
            ratio = ours / trl if ours is not None and trl else None
            data[f"{clock}_to_level_ratio"] = ratio
            lines.append(f"- {clock} time to the level, ours / TRL's: {_fmt(ratio)}")
        blocks = length_blocks(by, final_window)
        data["length_blocks"] = blocks
        if blocks:
            lines += ["", "Mean completion length (tokens) by steps, mean ± spread over seeds; ours - TRL with Welch's "
                      "95% interval:", "", "| steps | GRPOTrainer | InfiniteGRPOTrainer | ours - TRL | 95% interval |",
                      "|---|---|---|---|---|"]
            for b in blocks:
                ci = b["welch95"]
                diff, span = (f"{ci[0]:+.1f}", f"[{ci[1]:+.1f}, {ci[2]:+.1f}]") if ci else ("-", "-")
                lines.append(f"| {b['steps']} | {_pm(b['trl'], '.1f')} | {_pm(b['infinite'], '.1f')} | {diff} | "
                             f"{span} |")
    return Report("\n".join(lines) + "\n", level, data)


def _pm(pair: tuple, spec: str) -> str:
    m, s = pair
    return "-" if m is None else f"{m:{spec}}" + (f" ± {s:{spec}}" if s is not None else "")


def length_blocks(by: dict[str, list[dict]], width: int) -> list[dict]:
    """Per block of steps (step 1 alone, then `width` steps at a time): each trainer's (mean, spread) over seeds of
    the seeds' mean completion length in the block, and ours - TRL's with Welch's 95% interval. Empty when a run
    logged no lengths."""
    key = "completions/mean_length"
    if any(key not in s for rs in by.values() for r in rs for s in r["steps"]):
        return []
    n = min(len(r["steps"]) for rs in by.values() for r in rs)
    edges = [(0, 1), *((a, min(a + width, n)) for a in range(1, n, width))]
    out = []
    for lo, hi in edges:
        per = {k: [_mean([s[key] for s in r["steps"][lo:hi]]) for r in rs] for k, rs in by.items()}
        out.append({"steps": f"{lo + 1}" if hi == lo + 1 else f"{lo + 1}-{hi}",
                    **{k: (_mean(xs), _std(xs)) for k, xs in per.items()},
                    "welch95": welch(per["infinite"], per["trl"], 0.95)})
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def plot_curves(runs: list[dict], level: float | None, path: str) -> None:
    """Mean reward with a min-max band across seeds, against step and against cumulative wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, color in (("trl", "tab:blue"), ("infinite", "tab:orange")):
        rs = [r for r in runs if r["trainer"] == kind and rewards(r)]
        if not rs:
            continue
        n = min(len(rewards(r)) for r in rs)
        table = [rewards(r)[:n] for r in rs]
        mean = [_mean([t[i] for t in table]) for i in range(n)]
        low = [min(t[i] for t in table) for i in range(n)]
        high = [max(t[i] for t in table) for i in range(n)]
        steps = list(range(1, n + 1))
        clock = [_mean([cumulative(r, "wall_s")[i] for r in rs]) for i in range(n)]
        label = f"{TRAINERS[kind]} ({len(rs)} seeds)"
        for ax, x in ((axes[0], steps), (axes[1], clock)):
            ax.plot(x, mean, color=color, label=label)
            ax.fill_between(x, low, high, color=color, alpha=0.2)
    for ax, xlabel in ((axes[0], "optimizer step"), (axes[1], "cumulative wall time (s)")):
        if level is not None:
            ax.axhline(level, color="grey", linestyle=":", linewidth=1, label=f"level {level:.3g}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean reward (band: min-max over seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
