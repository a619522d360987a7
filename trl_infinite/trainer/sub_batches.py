"""A token budget on the loss's forward and backward: a micro batch larger than the budget runs as sub-batches whose
gradients accumulate into exactly the micro batch's gradient, and whose logged metrics merge into TRL's values.

TRL runs one forward and one backward per micro batch (`per_device_train_batch_size` rows), so the activations grow
with G x completion length. Here a micro batch of more than `budget` tokens (the packed tokens of the shared-prefix
forward: each group's prompt once plus every completion; TRL's padded `rows x width` otherwise) is cut into `k`
consecutive slices of rows (whole groups where they fit, the rows being in group order): the first of up to
`budget` tokens, each later one of up to `budget / 2` (about 2 : 1 : ... : 1). The first slice's backward allocates
the whole gradient layer by layer as it frees the activations; every later slice runs its forward and backward
beside that gradient, so on SmolLM2 (gradient 0.54 GB, about the activations of 1,600 packed tokens) equal slices
made a two-slice step peak 0.55 GB above a one-slice step of the same slice size (`benchmarks/RESULTS.md`). Slice
i's loss is TRL's loss of the slice times `weight_i`, so that the weighted sum equals TRL's loss of the whole micro
batch for every loss whose value is a sum over rows:

    grpo, sapo, luspo, dr_grpo:  mean over rows            -> weight_i = rows_i / rows
    bnpo:                         sum over tokens / tokens  -> weight_i = tokens_i / tokens  (completion mask)
    dapo, cispo, vespo:           sum / num_items_in_batch  -> weight_i = 1 (the normaliser is the batch's)

Losses whose value is not such a sum are never split: the entropy bonus (a token mean next to a row mean),
`top_entropy_quantile < 1` (a quantile over the micro batch), the MoE auxiliary loss, multimodal inputs. `k` is the
largest over processes (every process runs the same number of TRL loss calls, whose collectives must pair up).

TRL's loss logs metrics per call; each slice appends one value per metric, merged back into one
(`merge_metrics`): token- or row-weighted means for TRL's masked means (weights summed over processes), min / max
for `clip_ratio/low_min` / `clip_ratio/high_max`, the plain mean for any other key.
"""

from __future__ import annotations

import math

import torch

from trl_infinite.trainer.backprop import take_rows

ROW_MEAN_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")
TOKEN_MEAN_LOSSES = ("bnpo",)
GLOBAL_NORM_LOSSES = ("dapo", "cispo", "vespo")
SPLITTABLE_LOSSES = ROW_MEAN_LOSSES + TOKEN_MEAN_LOSSES + GLOBAL_NORM_LOSSES
# TRL's per-call metrics: how a micro batch's value follows from its slices' values
MIN_METRICS = ("clip_ratio/low_min",)
MAX_METRICS = ("clip_ratio/high_max",)
TOKEN_METRICS = ("entropy", "kl")  # masked means over (B, T) tensors
RATIO_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")
ROW_METRICS = ("vespo/phi_seq_mean",)
ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")


def packed_tokens(inputs: dict) -> torch.Tensor:
    """[B] tokens each row adds to the packed forward, in row order: its completion plus one (the prompt's last
    token), plus the rest of its prompt on the first row of each run of rows that share it."""
    prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
    cost = completion_mask.sum(1) + 1
    ids = inputs["prompt_ids"].masked_fill(prompt_mask == 0, -1)
    first = torch.ones_like(cost, dtype=torch.bool)
    first[1:] = (ids[1:] != ids[:-1]).any(dim=1)
    return (cost + first * (prompt_mask.sum(1) - 1)).cpu()


def slice_rows(costs: torch.Tensor, parts: int) -> list[slice]:
    """`parts` consecutive non-empty slices of rows (`parts` <= rows), the first with about twice the cost of each
    later one (costs 2 : 1 : ... : 1 of the total, to within a row)."""
    n = costs.numel()
    bounds = [0]
    total = float(costs.sum())
    cum = torch.cumsum(costs.double(), 0)
    for i in range(1, parts):
        target = total * (i + 1) / (parts + 1)
        cut = int(torch.searchsorted(cum, torch.tensor(target, dtype=torch.float64)).item()) + 1
        cut = min(max(cut, bounds[-1] + 1), n - (parts - i))  # every slice keeps at least one row
        bounds.append(cut)
    bounds.append(n)
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def num_parts(total_tokens: int, budget: int, rows: int) -> int:
    """Slices for `total_tokens` (at most `rows`): one if they fit in `budget`, else the first at most `budget` and
    the later ones at most `budget / 2` (the 2 : 1 : ... : 1 split of `slice_rows`)."""
    if total_tokens <= budget:
        return 1
    return max(1, min(rows, 1 + math.ceil((total_tokens - budget) / max(1, budget // 2))))


def loss_weights(loss_type: str, parts: list[dict]) -> list[float]:
    """`weight_i` of the module docstring for each slice (`parts`: the slices' inputs)."""
    if loss_type in GLOBAL_NORM_LOSSES:
        return [1.0] * len(parts)
    if loss_type in ROW_MEAN_LOSSES:
        rows = [p["completion_mask"].shape[0] for p in parts]
        return [r / sum(rows) for r in rows]
    tokens = [float(_loss_mask(p).sum()) for p in parts]
    total = sum(tokens)
    return [t / total if total else 1.0 / len(parts) for t in tokens]


def _loss_mask(inputs: dict) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def split_inputs(inputs: dict, slices: list[slice]) -> list[dict]:
    """The micro batch's row-aligned entries cut into `slices` (scalars shared)."""
    return [take_rows(inputs, s) for s in slices]


def metric_weights(parts: list[dict], reduce) -> tuple[list[float], list[float]]:
    """(token weights, row weights) of the slices for the masked-mean metrics, summed over processes by `reduce`
    (a sum-reduction of a tensor)."""
    tokens = torch.tensor([float(_loss_mask(p).sum()) for p in parts], dtype=torch.float64)
    rows = torch.tensor([float(p["completion_mask"].shape[0]) for p in parts], dtype=torch.float64)
    both = reduce(torch.stack([tokens, rows]))
    return both[0].tolist(), both[1].tolist()


def merge_metrics(metrics: dict, before: dict[str, int], tokens: list[float], rows: list[float],
                  token_level: bool, one_column: bool = False) -> None:
    """Replace the values the slices appended to each metric list by the value TRL logs for the whole micro batch
    (see the module docstring). `before`: each list's length before the slices ran; `token_level`: TRL's
    `importance_sampling_level == "token"` (its clip ratios are then token means, else row means); `one_column`: the
    micro batch's completions are one column wide, which TRL's metrics read as one value per row (row means)."""
    k = len(tokens)
    for key, values in metrics.items():
        new = values[before.get(key, 0):]
        if len(new) != k:
            continue  # not appended once per slice (e.g. logged outside the loss): left as it is
        merged = merge_value(key, new, tokens, rows, token_level, one_column)
        del values[before.get(key, 0):]
        values.append(merged)


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
