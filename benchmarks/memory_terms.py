"""Where our step's peak memory goes as completions grow (issue 43): a `grpo_scaling.py` / `grpo_step.py` JSON's rows
of `InfiniteGRPOTrainer`, each measured phase peak beside the terms that should explain it.

Measured (CPU: VmHWM per phase of a measured step, `grpo_probes.py`): `static_GB` = the reward phase's peak (after
the rollout has given its pool back, before the training forward: weights, gradients, optimizer states, the
process), `rollout_GB` and `backward_GB` = those phases' peaks minus `static_GB`.

Predicted, from the model's shape and our defaults (float32, no sharing beyond the prompt):
- `kv_GB`: the rollout's KV at its fullest, each group's prompt once plus every sample's own tokens:
  (p + G L) x 2 x layers x kv_dim x 4 bytes (rounded up to whole blocks by the pool: a few blocks more);
- `slice_GB`: one backward slice's activations under gradient checkpointing: each layer's input kept for the slice's
  tokens (layers x hidden x 4 bytes a token) plus one layer's activations while it is recomputed and differentiated
  (`ModelShape.activation_bytes_per_token() / layers`), for the tokens of the largest slice `loss_slices.py` cuts
  at `backward_token_budget` (a group's prompt once, each row its completion + 1);
- `tiles_GB`: the log-prob head's tiles, `TILE_BYTES` each and about 7 alive in its backward (`trainer/logprobs.py`);
- `grads_GB`: the gradients, allocated by the first slice's backward (TRL's `zero_grad` frees them between steps):
  every weight once, 4 bytes (float32 weights);
- `cache_GB`: the most freed blocks the host tensor cache may hold within a phase (`host_tensor_cache_mb`, given back
  after each rollout and each slice): an upper bound, not a prediction.
So the rollout's term is `kv + cache` at most and the backward's `grads + slice + tiles` (+ cache). Only the KV grows
with G x L (linearly); the slice is capped by `backward_token_budget`, the rest is constant.

    python benchmarks/memory_terms.py /tmp/scaling.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from floor_table import _shape

from trl_infinite import InfiniteGRPOConfig
from trl_infinite.trainer.logprobs import TILE_BYTES
from trl_infinite.trainer.loss_slices import num_parts, slice_rows

COLUMNS = ["G", "L", "tokens", "static_GB", "rollout_GB", "kv_GB", "cache_GB", "backward_GB", "grads_GB", "slice_GB",
           "slice_tokens", "tiles_GB", "peak_GB"]
BUDGET = InfiniteGRPOConfig.__dataclass_fields__["backward_token_budget"].default
CACHE_MB = InfiniteGRPOConfig.__dataclass_fields__["host_tensor_cache_mb"].default
LIVE_TILES = 7


def largest_slice(prompt_len: int, G: int, L: int, budget: int | None) -> int:
    """Tokens of the largest slice of one group of G completions of L tokens (the slices `loss_slices` cuts)."""
    costs = torch.full((G,), L + 1)
    costs[0] += prompt_len - 1  # the group's prompt, once, on its first row
    total = int(costs.sum())
    if budget is None:
        return total
    slices = slice_rows(costs, num_parts(total, budget, G))
    return max(int(costs[sl].sum()) + (prompt_len - 1 if sl.start > 0 else 0) for sl in slices)


def memory_row(row: dict, budget: int | None = BUDGET) -> dict | None:
    """The table's row for one of our measured points (None for GRPOTrainer's rows or rows without the data)."""
    floor, steps = row.get("floor_data"), (row.get("all_steps") or [])[1:]
    if row.get("trainer") != "InfiniteGRPOTrainer" or not floor or not steps:
        return None
    shape = _shape(floor)
    G, L = row.get("G"), row.get("L")
    prompt = floor["steps"][-1]["prompt_lens"][0]
    phases = [s["phase_peak_rss"] for s in steps]
    static = min(p["reward"] for p in phases)
    rollout = max(p["rollout"] for p in phases) - static
    backward = max(p["backward"] for p in phases) - static
    kv_token = 2 * shape.layers * shape.kv_dim * shape.dtype_bytes
    tokens = largest_slice(prompt, G, L, budget)
    per_token = shape.layers * shape.hidden * 4 + shape.activation_bytes_per_token() / shape.layers
    return {"G": G, "L": L, "tokens": G * L, "static_GB": static / 1e9, "rollout_GB": rollout / 1e9,
            "kv_GB": (prompt + G * L) * kv_token / 1e9, "cache_GB": (CACHE_MB or 0) * 2**20 / 1e9,
            "backward_GB": backward / 1e9, "grads_GB": shape.weight_bytes * 4 / shape.dtype_bytes / 1e9,
            "slice_GB": tokens * per_token / 1e9, "slice_tokens": tokens, "tiles_GB": LIVE_TILES * TILE_BYTES / 1e9,
            "peak_GB": row.get("peak_GB")}


def memory_rows(rows: list[dict], budget: int | None = BUDGET) -> list[dict]:
    return [r for r in (memory_row(x, budget) for x in rows) if r is not None]


if __name__ == "__main__":
    from common import Table

    data = json.loads(Path(sys.argv[1]).read_text())
    print(Table(COLUMNS, memory_rows(data["rows"])).markdown())
