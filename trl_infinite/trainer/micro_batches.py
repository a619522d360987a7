"""Micro batches for the backward pass: rows that share work together, each padded to its own longest completion.

TRL pads the whole generation batch to its longest completion and splits it at random, so every micro batch costs as
much as the longest sample. Here the rows are ordered, split into the same number of equal-size micro batches, and
each micro batch is trimmed to its own longest completion (right padding). The prompt columns stay the generation
batch's: a model numbers its tokens by column, so that keeps TRL's positions (`positions.py`); a RoPE whose
frequencies depend on the longest position (`dynamic`, `longrope`) keeps every column (`trim=False`).
- with the shared-prefix forward (`shared_prefix.py`), group by group (groups in random order), so a micro batch
  holds whole groups and encodes each prompt once; padding does not matter there (the rows are packed);
- otherwise by completion length, so a micro batch pads little.
For every loss whose normaliser does not depend on the split (`grpo`, `dr_grpo`, `dapo`, `cispo`, `sapo`, `luspo`,
`vespo`) the accumulated gradient is unchanged, as long as every optimizer step holds whole passes over the
generation batch (the trainer passes `trl_split=True` otherwise). `bnpo` averages tokens per micro batch, and the
entropy bonus, `top_entropy_quantile < 1` and the MoE auxiliary loss depend on which rows share a micro batch: with
those (`trl_split=True`) the split is TRL's own (`shuffle_sequence_dict` then `split_tensor_dict`: one
`torch.randperm` of the rows from the global generator, consecutive equal slices), so the micro batches hold TRL's
rows; only the padding is trimmed, which does not change them. Every split draws exactly TRL's `torch.randperm` and
nothing else (the group and micro-batch orders of the other splits derive from it), so the global generator leaves
the split as it leaves TRL's. TRL's metrics are per micro batch: `tag_trl_sets=True` marks each row with its micro
batch in TRL's split (`TRL_SET_KEY`), over which the trainer composes them (`loss_metrics.py`).
`buffer_micro_batches` is the trainer's `_prepare_inputs` work: which split, and the metrics that go with it.
"""

from __future__ import annotations

import warnings

import torch
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from trl_infinite.trainer.loss_metrics import TrlSetMetrics, split_metrics_warning

SPLIT_INVARIANT_LOSSES = ("grpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
TRL_SET_KEY = "trl_micro_batch"  # [B] int64: the row's micro batch in TRL's split (`make_micro_batches`)

# [B, C] tensors aligned with the completion (right padded)
_COMPLETION_KEYS = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "tool_mask",
)
_FULL_KEYS = ("token_type_ids", "mm_token_type_ids")  # [B, P + C]


def group_order(batch: dict, position: torch.Tensor) -> torch.Tensor:
    """Row permutation keeping the rows of each prompt together (in their order), prompts in random order: each
    group's rank is its first row's place in `position` (a random permutation's inverse: TRL's shuffle)."""
    ids = batch["prompt_ids"].masked_fill(batch["prompt_mask"] == 0, -1).cpu()
    _, group = torch.unique(ids, dim=0, return_inverse=True)
    n = group.numel()
    first = torch.full((int(group.max()) + 1,), n, dtype=torch.long).scatter_reduce(0, group, position, "amin")
    return torch.argsort(first[group] * n + torch.arange(n))


def length_order(batch: dict) -> torch.Tensor:
    """Row permutation by completion length, longest first (similar lengths share a micro batch)."""
    lengths = batch["completion_mask"].sum(dim=1).cpu()
    return torch.argsort(lengths, descending=True, stable=True)


def take_rows(batch: dict, rows: slice | torch.Tensor) -> dict:
    """The rows `rows` (a slice, or row indices in their order) of every per-row entry (tensors with a batch dim and
    lists); scalars shared."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            out[key] = value[rows if isinstance(rows, slice) else rows.to(value.device)]
        elif isinstance(value, list):
            out[key] = value[rows] if isinstance(rows, slice) else [value[i] for i in rows.tolist()]
        else:
            out[key] = value
    return out


def split_rows(batch: dict, num_chunks: int) -> list[dict]:
    """`num_chunks` equal consecutive slices of rows (scalars shared)."""
    size = batch["completion_mask"].size(0) // num_chunks
    return [take_rows(batch, slice(c * size, (c + 1) * size)) for c in range(num_chunks)]


def _round_up(n: int, multiple: int | None, limit: int) -> int:
    return min(limit, -(-n // multiple) * multiple) if multiple else n


def trim_padding(batch: dict, multiple: int | None = None) -> dict:
    """Drops the trailing completion columns no row of this micro batch uses (keeping the width a multiple of
    `multiple`, TRL's `pad_to_multiple_of`, when set). The prompt columns stay: they number the tokens."""
    P, completion_mask = batch["prompt_mask"].size(1), batch["completion_mask"]
    C = completion_mask.size(1)
    used_c = completion_mask.any(dim=0).nonzero()
    keep = _round_up(int(used_c[-1]) + 1 if used_c.numel() else 1, multiple, C)
    # TRL's metrics take a [B, 1] completion tensor for `importance_sampling_level="sequence"` values (one per row):
    # never trim to one column a batch that TRL runs wider
    keep = max(keep, min(2, C))
    if keep == C:
        return batch
    out = dict(batch)
    for key in _COMPLETION_KEYS:
        v = batch.get(key)
        if isinstance(v, torch.Tensor) and v.ndim == 2 and v.size(1) == C:
            out[key] = v[:, :keep]
    ratio = batch.get("importance_sampling_ratio")
    if isinstance(ratio, torch.Tensor) and ratio.ndim == 2 and ratio.size(1) == C:
        out["importance_sampling_ratio"] = ratio[:, :keep]
    for key in _FULL_KEYS:
        v = batch.get(key)
        if isinstance(v, torch.Tensor) and v.ndim == 2 and v.size(1) == P + C:
            out[key] = v[:, : P + keep]
    return out


def make_micro_batches(batch: dict, num_chunks: int, loss_type: str, multiple: int | None = None,
                       by_group: bool = False, trl_split: bool = False, trim: bool = True,
                       tag_trl_sets: bool = False) -> list[dict]:
    """The generation batch as `num_chunks` micro batches of equal row count, each padded to its own longest
    completion (`trim=False`: every column kept).

    Split-invariant losses get micro batches of whole groups (`by_group`, for the shared-prefix forward) or of
    similar lengths, in random order (so, with several optimizer steps per generation, no step sees only short or
    only long completions); `bnpo`, unknown losses and split-dependent loss terms (`trl_split`) get TRL's split.
    `tag_trl_sets`: with several micro batches not TRL's, each row carries its micro batch in TRL's split
    (`TRL_SET_KEY`).
    """
    rows = batch["completion_mask"].size(0)
    trl_perm = torch.randperm(rows)  # TRL's `shuffle_sequence_dict`: the generator's only draw, whatever the split
    sort = loss_type in SPLIT_INVARIANT_LOSSES and not trl_split
    if not sort:
        order = trl_perm
    else:
        position = torch.empty_like(trl_perm)
        position[trl_perm] = torch.arange(rows)  # each row's place in TRL's shuffled order
        order = group_order(batch, position) if by_group else length_order(batch)
        if tag_trl_sets and num_chunks > 1:
            batch = {**batch, TRL_SET_KEY: position // (rows // num_chunks)}
    chunks = split_rows(take_rows(batch, order), num_chunks)
    if sort:  # a random order of the micro batches, from the same draw
        chunks = [chunks[i] for i in torch.argsort(trl_perm[:num_chunks]).tolist()]
    return [trim_padding(c, multiple) if trim else c for c in chunks]


def buffer_micro_batches(trainer, batch: dict) -> list[dict]:
    """The trainer's `steps_per_generation` micro batches of one generation batch (TRL's
    `_generate_and_score_completions` output): whole groups with the shared-prefix forward, else similar lengths;
    TRL's split where a loss term depends on it, where an optimizer step holds only part of a pass over the
    generation batch (its rows are then TRL's step's rows), or with entries not aligned with the rows."""
    batch = split_pixel_values_by_grid(batch)
    spg, rows = trainer.args.steps_per_generation, batch["completion_mask"].shape[0]
    flat = unsplit_pixel_values_by_grid(batch)
    row_aligned = all(not (isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] != rows) for v in flat.values())
    trl_split = trainer.split_dependent_loss or trainer.args.gradient_accumulation_steps % spg != 0 or not row_aligned
    chunks = make_micro_batches(batch, spg, trainer.loss_type, trainer.pad_to_multiple_of,
                                by_group=trainer.shared_prefix is not None, trl_split=trl_split,
                                trim=trainer.length_dependent_rope is None,
                                tag_trl_sets=spg > 1 and trainer.accelerator.num_processes == 1)
    if any(TRL_SET_KEY in c for c in chunks):
        trainer._trl_sets = TrlSetMetrics(spg, rows, trainer.importance_sampling_level == "token")
    elif (spg > 1 and not trl_split and trainer.loss_type in SPLIT_INVARIANT_LOSSES
          and not getattr(trainer, "_split_metrics_warned", False)):
        trainer._split_metrics_warned = True
        warnings.warn(split_metrics_warning(trainer.accelerator.num_processes), UserWarning, stacklevel=3)
    return [unsplit_pixel_values_by_grid(c) for c in chunks]
