"""`grpo_step.py`'s rows: the size of a run (`Size`) and the table row of one worker (means over the measured steps,
ratios to `GRPOTrainer`)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from grpo_workers import _max, _mean

TRAINERS = {"trl": "GRPOTrainer", "trl_cb": "GRPOTrainer+cb", "infinite": "InfiniteGRPOTrainer"}
MODELS = ("smollm2", "qwen3-0.6b", "qwen3-1.7b", "tiny")
PHASE_COLUMNS = {"rollout": "rollout_s", "reward": "reward_s", "forward": "forward_s", "backward": "backward_s",
                 "optim": "optim_s"}
GB = 1e9


@dataclass(frozen=True)
class Size:
    G: int
    prompts: int
    max_len: int

    @property
    def name(self) -> str:
        return f"{self.G}x{self.prompts}@{self.max_len}"

    @classmethod
    def parse(cls, text: str) -> Size:
        m = re.fullmatch(r"(\d+)x(\d+)@(\d+)", text)
        if m is None or min(map(int, m.groups())) < 1 or int(m.group(1)) < 2:
            raise argparse.ArgumentTypeError(f"a size is GxP@L with G >= 2, P >= 1, L >= 1 (e.g. 8x2@128), got "
                                             f"{text!r}")
        return cls(*map(int, m.groups()))


def add_ratios(row: dict, base: dict) -> None:
    """`x_trl_*`: `row` over GRPOTrainer's row `base` of the same size (nothing when that row failed)."""
    if "cpu_s" not in base:
        return
    row["x_trl_cpu"] = row["cpu_s"] / base["cpu_s"]
    row["x_trl_wall"] = row["wall_s"] / base["wall_s"]
    if row["peak_rss_GB"] is not None and base.get("peak_rss_GB"):
        row["x_trl_rss"] = row["peak_rss_GB"] / base["peak_rss_GB"]


def make_row(size: Size, kind: str, data: dict, clock: str, base: dict | None) -> dict:
    """The table row of one worker: means over the measured steps (all but the first), peaks over them."""
    row = {"size": size.name, "trainer": TRAINERS[kind]}
    if "error" in data:
        return {**row, "note": f"FAILED: {data['error']}", "failed": True}
    steps = data["steps"][1:]
    phases_key = "phases_cpu" if clock == "cpu" else "phases_wall"
    total_key = "cpu_s" if clock == "cpu" else "wall_s"
    row["cpu_s"] = _mean(s["cpu_s"] for s in steps)
    row["wall_s"] = _mean(s["wall_s"] for s in steps)
    named = 0.0
    for phase, column in PHASE_COLUMNS.items():
        row[column] = _mean(s[phases_key][phase] for s in steps)
        named += row[column]
    row["other_s"] = row[total_key] - named
    peak_rss = _max(s["peak_rss_bytes"] for s in steps)
    peak_cuda = _max(s["peak_cuda_bytes"] for s in steps)
    row["peak_rss_GB"] = peak_rss / GB if peak_rss is not None else None
    row["process_rss_GB"] = data["process_peak_rss_bytes"] / GB
    row["peak_cuda_GB"] = peak_cuda / GB if peak_cuda is not None else None
    row["mean_len"] = _mean(s["mean_len"] for s in steps)
    row["gen_and_score_s"] = _mean(s["inclusive_cpu" if clock == "cpu" else "inclusive_wall"]
                                   .get("_generate_and_score_completions") for s in steps)
    if kind == "trl":
        row["x_trl_cpu"] = row["x_trl_wall"] = 1.0
        row["x_trl_rss"] = 1.0 if row["peak_rss_GB"] is not None else None
    elif base is not None:
        add_ratios(row, base)
    if kind == "infinite":
        row["engine"] = "yes" if data.get("uses_engine") else "NO"
        if data.get("engine_fallback_reasons"):
            row["note"] = "TRL generate: " + "; ".join(data["engine_fallback_reasons"])[:300]
    row["first_step"] = data["steps"][0]
    row["all_steps"] = data["steps"]
    row["floor_data"] = data.get("floor")  # lengths, counts and rates: the floor table can be rebuilt from the JSON
    row["config"] = data["config"]
    return row
