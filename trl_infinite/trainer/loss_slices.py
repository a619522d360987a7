"""The loss of one training micro batch (`InfiniteGRPOTrainer.compute_loss`): TRL's loss, run as slices under a token
budget on the forward and backward, and as one TRL loss call per TRL micro batch its rows belong to.

A micro batch larger than the budget runs as sub-batches whose gradients accumulate into exactly the micro batch's
gradient, and whose logged metrics merge into TRL's values (`loss_metrics.py`).

TRL runs one forward and one backward per micro batch (`per_device_train_batch_size` rows), so the activations grow
with G x completion length. Here a micro batch of more than `budget` tokens (the packed tokens of the shared-prefix
forward: each group's prompt once plus every completion; TRL's padded `rows x width` otherwise) is cut into `k`
consecutive slices of rows (whole groups where they fit, the rows being in group order): the first of up to
`budget` tokens, each later one of up to `budget / 2` (about 2 : 1 : ... : 1). The first slice's backward allocates
the whole gradient layer by layer as it frees the activations; every later slice runs its forward and backward
beside that gradient, so on SmolLM2 (gradient 0.54 GB, about the activations of 1,600 packed tokens) equal slices
made a two-slice step peak 0.55 GB above a one-slice step of the same slice size (`benchmarks/RESULTS-history.md`). Slice
i's loss is TRL's loss of the slice times `weight_i`, so that the weighted sum equals TRL's loss of the whole micro
batch for every loss whose value is a sum over rows:

    grpo, sapo, luspo, dr_grpo:  mean over rows            -> weight_i = rows_i / rows
    bnpo:                         sum over tokens / tokens  -> weight_i = tokens_i / tokens  (completion mask)
    dapo, cispo, vespo:           sum / num_items_in_batch  -> weight_i = 1 (the normaliser is the batch's)

Losses whose value is not such a sum are never split: the entropy bonus (a token mean next to a row mean),
`top_entropy_quantile < 1` (a quantile over the micro batch), the MoE auxiliary loss, multimodal inputs. `k` is the
largest over processes (every process runs the same number of TRL loss calls, whose collectives must pair up).

A micro batch holding rows of several of TRL's micro batches (`micro_batches.TRL_SET_KEY`) runs its forward once and
TRL's loss on each one's rows, weighted as the slices are, so its metrics are composed over TRL's micro batches
(`loss_metrics.TrlSetMetrics`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from accelerate.utils import DistributedType

from trl_infinite.engine.runner import host_memory
from trl_infinite.trainer.compat import TRL_HOOKS
from trl_infinite.trainer.loss_metrics import loss_mask, merge_metrics, metric_weights, piece_rows
from trl_infinite.trainer.micro_batches import TRL_SET_KEY, take_rows
from trl_infinite.trainer.recompute import Recompute, no_recompute, selective_recompute

ROW_MEAN_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")
TOKEN_MEAN_LOSSES = ("bnpo",)
GLOBAL_NORM_LOSSES = ("dapo", "cispo", "vespo")
SPLITTABLE_LOSSES = ROW_MEAN_LOSSES + TOKEN_MEAN_LOSSES + GLOBAL_NORM_LOSSES
ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
# accelerate setups whose gradient sync the slices' `no_sync` handles (DeepSpeed and FSDP count or shard backward
# passes themselves: one pass per micro batch there)
_SLICED_DISTRIBUTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
# the batch entries TRL's `_compute_loss` passes to the log-prob forward besides the ids and masks (row-aligned ones
# only reach `_loss_pieces`: batches with images use TRL's split)
_FORWARD_KEYS = TRL_HOOKS["_get_per_token_logps_and_entropies"][8:]


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
    tokens = [float(loss_mask(p).sum()) for p in parts]
    total = sum(tokens)
    return [t / total if total else 1.0 / len(parts) for t in tokens]


def micro_batch_loss(trainer, trl_loss, model, inputs: dict, return_outputs: bool, num_items_in_batch):
    """`compute_loss` of the trainer, `trl_loss` being TRL's (`GRPOTrainer.compute_loss`, bound): slices under the
    budget backpropagated one by one (all but the last here, under `no_sync`; the last by the caller), so the
    gradient and the returned value are the micro batch's and its activations never coexist; TRL's loss on each TRL
    micro batch's rows, whose metrics are composed over TRL's micro batches."""
    sets = inputs.get(TRL_SET_KEY)
    if sets is not None:
        inputs = {k: v for k, v in inputs.items() if k != TRL_SET_KEY}
    slices = None if return_outputs else loss_slices(trainer, inputs)
    if slices is None and (sets is None or return_outputs):
        with keep_activations(trainer, model, inputs):
            return trl_loss(model, inputs, return_outputs, num_items_in_batch)
    slices = slices or [slice(0, inputs["completion_mask"].shape[0])]
    parts = [take_rows(inputs, s) for s in slices]
    weights = loss_weights(trainer.loss_type, parts)
    accelerator, metrics = trainer.accelerator, trainer._metrics["train"]
    before = {key: len(values) for key, values in metrics.items()}
    pieces: list[tuple[int | None, dict]] = []  # (TRL micro batch, inputs) of every TRL loss call, in order
    done = None
    for i, (part, weight, rows) in enumerate(zip(parts, weights, slices)):
        with keep_activations(trainer, model, part):
            loss = _loss_pieces(trainer, trl_loss, model, part, None if sets is None else sets[rows],
                                num_items_in_batch, pieces) * weight
        if i == len(parts) - 1:
            break
        with accelerator.no_sync(model) if accelerator.sync_gradients else nullcontext():
            accelerator.backward(loss)
        if trainer.host_tensor_cache:  # the next slice's sizes differ: give this slice's freed blocks back
            host_memory.trim()
        done = loss.detach() if done is None else done + loss.detach()
    tokens, rows = metric_weights([p for _, p in pieces],
                                  lambda t: accelerator.reduce(t.to(accelerator.device), reduction="sum").cpu())
    one_column = inputs["completion_mask"].shape[1] == 1
    if sets is None or trainer._trl_sets is None:
        merge_metrics(metrics, before, tokens, rows, token_level=trainer.importance_sampling_level == "token",
                      one_column=one_column)
    else:
        trainer._trl_sets.add(metrics, before, [s for s, _ in pieces], tokens, rows, int(sets.numel()))
        trainer._trl_sets.flush(metrics, one_column)
    return loss if done is None else loss + done


def _loss_pieces(trainer, trl_loss, model, inputs: dict, sets: torch.Tensor | None, num_items_in_batch, pieces: list):
    """TRL's loss of `inputs` (rows of one micro batch): one call, or, where its rows belong to several of TRL's
    micro batches (`sets`), one forward and one TRL loss call on each one's rows, weighted to sum to the loss of
    `inputs`. Appends (TRL micro batch, inputs) of each call to `pieces`."""
    split = None if sets is None else piece_rows(sets)
    if split is None or len(split) == 1:
        pieces.append((None if split is None else split[0][0], inputs))
        return trl_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    logps, entropies, aux = trainer._get_per_token_logps_and_entropies(
        model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), inputs["completion_ids"].size(1),
        compute_entropy=True, compute_aux_loss=False, **{k: inputs.get(k) for k in _FORWARD_KEYS},
    )
    subs = [take_rows(inputs, index) for _, index in split]
    total = None
    for (s, index), sub, weight in zip(split, subs, loss_weights(trainer.loss_type, subs)):
        trainer._forward_rows = (logps[index], entropies[index], aux)  # read by the trainer's next forward call
        loss = trl_loss(model, sub, num_items_in_batch=num_items_in_batch) * weight
        total = loss if total is None else total + loss
        pieces.append((s, sub))
    return total


def row_costs(trainer, inputs: dict) -> torch.Tensor:
    """[B] tokens each row adds to the training forward: packed (shared-prefix forward) or the padded width."""
    if trainer.shared_prefix is not None:
        return packed_tokens(inputs)
    width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
    return torch.full((inputs["completion_mask"].shape[0],), width)


def _own_passes(trainer) -> bool:
    """The trainer may shape this loss's passes (slices, recomputation): a training backward under DDP or one
    process, not TRL's own forward (`trl_forward`)."""
    return (trainer.trl_forward is None and trainer.model.training and torch.is_grad_enabled()
            and trainer.accelerator.distributed_type in _SLICED_DISTRIBUTED)


def keep_activations(trainer, model, inputs: dict):
    """The recomputation of a forward of these rows (`recompute.py`): none where its tokens' activations fit the
    budget, selective where the kept matrix products fit, else TRL's (nothing changed)."""
    policy = getattr(trainer, "recompute", None)  # (TRL's tests build trainers without `__init__`)
    if policy is None or policy.limit_bytes is None or not _own_passes(trainer):
        return nullcontext()
    mode = policy.mode(trainer._policy_module(trainer.model), int(row_costs(trainer, inputs).sum()))
    if mode is Recompute.NONE:
        return no_recompute(model)
    return selective_recompute(model) if mode is Recompute.SELECTIVE else nullcontext()


def loss_slices(trainer, inputs: dict) -> list[slice] | None:
    """The row slices of a training micro batch over `backward_token_budget` tokens, or over the tokens whose
    activations fit `activation_memory_gb` without recomputing a matrix product, whichever is fewer (None: one
    pass)."""
    budget = getattr(trainer.args, "backward_token_budget", None)
    accelerator = trainer.accelerator
    if (budget is None or not _own_passes(trainer) or trainer.loss_type not in SPLITTABLE_LOSSES
            or trainer.split_dependent_loss):
        return None
    if any(isinstance(v, torch.Tensor) and v.ndim >= 1 and k not in ROW_KEYS
           and v.shape[0] != inputs["completion_mask"].shape[0] for k, v in inputs.items()):
        return None  # an entry not aligned with the rows (e.g. pixel values): one pass
    limit = trainer.recompute.max_tokens(trainer._policy_module(trainer.model))
    costs = row_costs(trainer, inputs)
    if limit is not None and limit < budget:  # slices sized so their activations fit without recomputation
        slices = fit_slices(trainer, inputs, limit)
        parts = len(slices)
    else:
        slices, parts = None, num_parts(int(costs.sum()), budget, costs.numel())
    if accelerator.num_processes > 1:  # the same number of loss calls on every process
        parts = int(accelerator.gather(torch.tensor([parts], device=accelerator.device)).max())
        parts = min(parts, costs.numel())
    if slices is not None:
        while len(slices) < parts:  # halve the largest slice of several rows (each stays within the limit)
            i = max((j for j, sl in enumerate(slices) if sl.stop - sl.start > 1),
                    key=lambda j: slices[j].stop - slices[j].start)
            mid = (slices[i].start + slices[i].stop) // 2
            slices[i:i + 1] = [slice(slices[i].start, mid), slice(mid, slices[i].stop)]
        return slices if len(slices) > 1 else None
    return slice_rows(costs, parts) if parts > 1 else None


def fit_slices(trainer, inputs: dict, limit: int) -> list[slice]:
    """Consecutive slices of rows, each as many rows as fit in `limit` tokens of the forward (a slice that starts
    inside a group encodes its prompt again); a row over the limit alone is a slice of its own."""
    rows = inputs["completion_mask"].shape[0]
    if trainer.shared_prefix is None:
        width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
        per_slice = max(1, limit // width)
        return [slice(a, min(a + per_slice, rows)) for a in range(0, rows, per_slice)]
    own = (inputs["completion_mask"].sum(1) + 1).tolist()
    prompt = (inputs["prompt_mask"].sum(1) - 1).tolist()
    group_start = (packed_tokens(inputs) > inputs["completion_mask"].sum(1) + 1).tolist()
    slices, start = [], 0
    while start < rows:
        cost, end = own[start] + prompt[start], start + 1
        while end < rows and cost + own[end] + (prompt[end] if group_start[end] else 0) <= limit:
            cost += own[end] + (prompt[end] if group_start[end] else 0)
            end += 1
        slices.append(slice(start, end))
        start = end
    return slices
