"""TRL's per-call metrics of one micro batch, as TRL logs them, whatever rows share a micro batch of ours.

TRL's loss logs, per call, token means (`entropy`, `kl`, the clip ratios), row means (`vespo/phi_seq_mean`,
sequence-level ratios) and a min / max over the rows (`clip_ratio/low_min` / `clip_ratio/high_max`); its log then
averages them over the micro batches. Two things run TRL's loss on pieces of rows (`loss_slices.py`), and each piece
appends one value per metric:
- the token-budget slices of one micro batch: merged back into one value (`merge_metrics`): token- or row-weighted
  means for TRL's masked means (weights summed over processes), min / max for `clip_ratio/low_min` /
  `clip_ratio/high_max`, the plain mean for any other key;
- TRL's micro batches inside ours: those values depend on which rows share a micro batch, and ours are not TRL's
  where the rows are grouped by prompt or by length (`micro_batches.py`). Every row carries its micro batch in TRL's
  split (`micro_batches.TRL_SET_KEY`): a micro batch of ours runs its forward once, then TRL's own loss on the rows of
  each of TRL's micro batches it holds (weighted as the slices are, so the sum is the micro batch's loss and the
  gradient is unchanged). The pieces' values are kept with their token and row counts (`TrlSetMetrics`); once every
  row of the generation batch ran (one pass over it, inside one optimizer step: the trainer uses TRL's split
  otherwise) each of TRL's micro batches gets the value TRL logs for it, merged as slices are (`merge_value`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# TRL's per-call metrics: how a micro batch's value follows from its slices' values
MIN_METRICS = ("clip_ratio/low_min",)
MAX_METRICS = ("clip_ratio/high_max",)
TOKEN_METRICS = ("entropy", "kl")  # masked means over (B, T) tensors
RATIO_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")
ROW_METRICS = ("vespo/phi_seq_mean",)
SPLIT_METRICS = TOKEN_METRICS + RATIO_METRICS + ROW_METRICS + MIN_METRICS + MAX_METRICS


def loss_mask(inputs: dict) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def metric_weights(parts: list[dict], reduce) -> tuple[list[float], list[float]]:
    """(token weights, row weights) of the slices for the masked-mean metrics, summed over processes by `reduce`
    (a sum-reduction of a tensor)."""
    tokens = torch.tensor([float(loss_mask(p).sum()) for p in parts], dtype=torch.float64)
    rows = torch.tensor([float(p["completion_mask"].shape[0]) for p in parts], dtype=torch.float64)
    both = reduce(torch.stack([tokens, rows]))
    return both[0].tolist(), both[1].tolist()


def take_appended(metrics: dict, before: dict[str, int], count: int) -> dict[str, list]:
    """The values appended to each metric list since `before` (each list's length then), removed from `metrics`, for
    the metrics appended once per piece (`count` pieces); the others (e.g. logged outside the loss) left as they are."""
    out = {}
    for key, values in metrics.items():
        new = values[before.get(key, 0):]
        if len(new) == count:
            del values[before.get(key, 0):]
            out[key] = new
    return out


def merge_metrics(metrics: dict, before: dict[str, int], tokens: list[float], rows: list[float],
                  token_level: bool, one_column: bool = False) -> None:
    """Replace the values the slices appended to each metric list by the value TRL logs for the whole micro batch
    (see the module docstring). `before`: each list's length before the slices ran; `token_level`: TRL's
    `importance_sampling_level == "token"` (its clip ratios are then token means, else row means); `one_column`: the
    micro batch's completions are one column wide, which TRL's metrics read as one value per row (row means)."""
    for key, new in take_appended(metrics, before, len(tokens)).items():
        metrics[key].append(merge_value(key, new, tokens, rows, token_level, one_column))


def merge_value(key: str, values: list[float], tokens: list[float], rows: list[float], token_level: bool,
                one_column: bool = False) -> float:
    """TRL's value of metric `key` over the union of some pieces of rows, from each piece's value and its token and
    row counts (`merge_metrics`)."""
    if one_column:
        tokens = rows
    if key in MIN_METRICS or key in MAX_METRICS:
        finite = [v for v in values if not math.isnan(v)]
        return (min(finite) if key in MIN_METRICS else max(finite)) if finite else float("nan")
    if key in TOKEN_METRICS or (key in RATIO_METRICS and token_level):
        return _weighted(values, tokens)
    if key in ROW_METRICS or key in RATIO_METRICS:
        return _weighted(values, rows)
    return sum(values) / len(values)


def _weighted(values: list[float], weights: list[float]) -> float:
    total = sum(w for v, w in zip(values, weights) if not math.isnan(v))
    if total == 0:  # no token in the micro batch: TRL's masked mean divides by `count.clamp(min=1)`, giving 0
        return 0.0 if any(not math.isnan(v) for v in values) else float("nan")
    return sum(v * w for v, w in zip(values, weights) if not math.isnan(v)) / total


@dataclass
class TrlSetMetrics:
    """The metric pieces of one pass over a generation batch, per TRL micro batch (`num_sets` of them)."""

    num_sets: int
    rows: int  # rows of the generation batch on this process
    token_level: bool  # TRL's `importance_sampling_level == "token"`
    seen: int = 0  # rows whose pieces ran in this pass
    # metric -> TRL micro batch -> (value, tokens, rows) per piece
    pieces: dict[str, list[list[tuple[float, float, float]]]] = field(default_factory=dict)

    def add(self, metrics: dict, before: dict[str, int], sets: list[int], tokens: list[float], rows: list[float],
            local_rows: int) -> None:
        """Moves the values the pieces appended (one per piece and metric, in piece order) out of `metrics`.
        `sets`: each piece's TRL micro batch; `tokens` / `rows`: its weights (summed over processes)."""
        for key, new in take_appended(metrics, before, len(sets)).items():
            per_set = self.pieces.setdefault(key, [[] for _ in range(self.num_sets)])
            for value, s, t, r in zip(new, sets, tokens, rows):
                per_set[s].append((value, t, r))
        self.seen += local_rows

    def flush(self, metrics: dict, one_column: bool) -> bool:
        """Once the pass is complete: one value per TRL micro batch appended to each metric (TRL's values), and a
        new pass begins. True where it flushed."""
        if self.seen < self.rows:
            return False
        for key, per_set in self.pieces.items():
            for pieces in per_set:
                if not pieces:
                    continue
                values, tokens, rows = (list(x) for x in zip(*pieces))
                metrics.setdefault(key, [])
                metrics[key].append(merge_value(key, values, tokens, rows, self.token_level, one_column))
        self.seen, self.pieces = 0, {}
        return True


def piece_rows(sets: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(TRL micro batch, row indices) of each piece of a micro batch whose rows carry `sets`, in set order."""
    return [(int(s), (sets == s).nonzero().flatten()) for s in torch.unique(sets)]


def split_metrics_warning(num_processes: int) -> str:
    """Why TRL's per-micro-batch metrics are not composed over TRL's micro batches (several processes: TRL's loss
    call on each piece reduces across processes, which would need the same pieces on every process)."""
    return (
        f"InfiniteGRPOTrainer logs {', '.join(f'`{m}`' for m in SPLIT_METRICS)} as means (min / max) over its own "
        f"micro batches (rows grouped by prompt or completion length) with {num_processes} processes, not over "
        "GRPOTrainer's random split of the rows: those logged values differ from GRPOTrainer's (the loss, the "
        "gradients and every other metric are TRL's). A loss term that depends on the split (`entropy_coef`, "
        "`top_entropy_quantile`, the MoE auxiliary loss) or `loss_type=\"bnpo\"` uses TRL's split."
    )
