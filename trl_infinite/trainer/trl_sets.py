"""TRL's per-micro-batch metrics over TRL's micro batches, whatever rows share one of ours.

TRL's loss logs, per micro batch, token means (`entropy`, `kl`, the clip ratios), row means (`vespo/phi_seq_mean`,
sequence-level ratios) and a min / max over the rows (`clip_ratio/low_min` / `clip_ratio/high_max`); its log then
averages them over the micro batches. Those values depend on which rows share a micro batch, and ours are not TRL's
where the rows are grouped by prompt or by length (`backprop.py`). Every row carries its micro batch in TRL's split
(`backprop.TRL_SET_KEY`): a micro batch of ours runs its forward once, then TRL's own loss on the rows of each of
TRL's micro batches it holds (one call per such piece, on the forward's rows, weighted as the token-budget slices
are, so the sum is the micro batch's loss and the gradient is unchanged: `sub_batches.loss_weights`). The pieces'
metric values are kept with their token and row counts (`TrlSetMetrics`); once every row of the generation batch
ran (one pass over it, inside one optimizer step: the trainer uses TRL's split otherwise) each of TRL's micro
batches gets the value TRL logs for it, merged as `sub_batches.merge_value` merges slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trl_infinite.trainer.sub_batches import (
    MAX_METRICS,
    MIN_METRICS,
    RATIO_METRICS,
    ROW_METRICS,
    TOKEN_METRICS,
    merge_value,
)

SPLIT_METRICS = TOKEN_METRICS + RATIO_METRICS + ROW_METRICS + MIN_METRICS + MAX_METRICS


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
        for key, values in metrics.items():
            new = values[before.get(key, 0):]
            if len(new) != len(sets):
                continue  # not appended once per piece (e.g. logged outside the loss): left as it is
            del values[before.get(key, 0):]
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
