"""TRL's two built-in rollout paths, reproduced as `GRPOTrainer._generate_single_turn` runs them, with forced lengths.

- `trl_generate`: the regular path: prompts (each repeated G times, as TRL's `RepeatSampler` yields them) left-padded
  with `trl.trainer.utils.pad`, then `model.generate(generation_config=...)` with the `GenerationConfig` the trainer
  builds from `GRPOConfig`, then TRL's mask-after-first-EOS.
- `trl_continuous_batching`: `use_transformers_continuous_batching=True`: transformers' continuous batching with
  `ContinuousBatchingConfig(max_memory_percent=0.5)` (TRL's default) and the same `GenerationConfig`.

Forcing lengths (random weights never emit EOS on cue): for `generate`, `ForcedLengthLogitsProcessor` bans EOS until
the sample's target length and then forces it, so every row stops exactly there (generate keeps running a batch
until its longest row ends, as it would with real EOS). Continuous batching has no per-request custom processors, so
each request is submitted with `max_new_tokens=target` and EOS disabled (`eos_token_id=-1`): the same number of
forward passes per request, the last token just is not an EOS. The loop is `generate_batch`'s own, with one
`add_request` per sample instead of `add_requests` (which takes a single `max_new_tokens`).
"""

from __future__ import annotations

import tempfile

import torch
from common import Workload
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList


def grpo_generation_config(
    workload: Workload, max_new: int, bf16: bool, cb_memory_percent: float | None = None
) -> tuple[GenerationConfig, object]:
    """The `GenerationConfig` `GRPOTrainer.__init__` builds for its non-vLLM paths, from `GRPOConfig` defaults, and
    the config object itself. `cb_memory_percent` sets `transformers_continuous_batching_config`'s
    `max_memory_percent` (None: TRL's default 0.5)."""
    from trl import GRPOConfig

    g = workload.group_size
    cb = None if cb_memory_percent is None else {"max_memory_percent": cb_memory_percent}
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), report_to="none", bf16=bf16, num_generations=g,
        per_device_train_batch_size=g, max_completion_length=max_new, transformers_continuous_batching_config=cb,
    )
    generation_kwargs = {  # as in GRPOTrainer.__init__ (trl 1.x)
        "max_new_tokens": args.max_completion_length,
        "do_sample": True,
        "pad_token_id": workload.pad_id,
        "bos_token_id": None,
        "eos_token_id": [workload.eos_id],
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "cache_implementation": args.cache_implementation,
    }
    if args.generation_kwargs is not None:
        generation_kwargs.update(args.generation_kwargs)
    return GenerationConfig(**generation_kwargs, disable_compile=True), args


class ForcedLengthLogitsProcessor(LogitsProcessor):
    """Row b emits EOS exactly as its `targets[b]`-th token: EOS banned before, the only choice then. `eos_id`: one
    id or several (all banned before the target; any of them may end the row at it)."""

    def __init__(self, targets: list[int], prompt_width: int, eos_id: int | list[int], device: torch.device):
        self.targets = torch.tensor(targets, device=device)  # [B]
        self.prompt_width = prompt_width
        self.eos_ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_width  # tokens generated so far
        last = (self.targets - 1 == step)[:, None]  # [B, 1]
        is_eos = torch.zeros_like(scores, dtype=torch.bool)
        is_eos[:, self.eos_ids] = True
        scores = scores.masked_fill(is_eos & ~last, float("-inf"))
        return scores.masked_fill(~is_eos & last, float("-inf"))


def repeated(workload: Workload) -> tuple[list[list[int]], list[int]]:
    """TRL's batch: each prompt repeated G times (prompt-major) and the matching targets."""
    prompts = [p for p, group in zip(workload.prompt_ids, workload.lengths) for _ in group]
    return prompts, [n for group in workload.lengths for n in group]


@torch.no_grad()
def trl_generate(model, workload: Workload, gen_config: GenerationConfig, args) -> list[list[int]]:
    """`_generate_single_turn`'s regular path on the repeated batch; returns the completions cut after EOS."""
    from trl.trainer.utils import pad

    device = next(model.parameters()).device
    prompts, targets = repeated(workload)
    tensors = [torch.tensor(ids) for ids in prompts]
    multiple = args.pad_to_multiple_of
    padded = pad(tensors, padding_value=workload.pad_id, padding_side="left", pad_to_multiple_of=multiple)
    ones = [torch.ones_like(t) for t in tensors]
    mask = pad(ones, padding_value=0, padding_side="left", pad_to_multiple_of=multiple)
    forced = ForcedLengthLogitsProcessor(targets, padded.shape[1], workload.eos_id, device)
    out = model.generate(input_ids=padded.to(device), attention_mask=mask.to(device), generation_config=gen_config,
                         logits_processor=LogitsProcessorList([forced]))
    completion_ids = out[:, padded.shape[1]:]
    is_eos = completion_ids == workload.eos_id  # TRL: keep everything up to the first EOS
    eos_idx = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])
    keep = torch.arange(completion_ids.shape[1], device=device)[None] <= eos_idx[:, None]
    return [c[m].tolist() for c, m in zip(completion_ids.cpu(), keep.cpu())]


@torch.no_grad()
def trl_continuous_batching(model, workload: Workload, gen_config: GenerationConfig, args) -> list[list[int]]:
    """`_generate_single_turn`'s `use_transformers_continuous_batching` path, lengths forced per request."""
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cb_kwargs = dict(args.transformers_continuous_batching_config or {})
    cb_kwargs.setdefault("max_memory_percent", 0.5)  # TRL's training-aware default
    cb_config = ContinuousBatchingConfig(**cb_kwargs)
    prompts, targets = repeated(workload)
    hints = WorkloadHints(max(map(len, prompts)), max(targets), len(prompts))
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=5,
        workload_hints=hints,
    ) as manager:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, targets)]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("continuous batching thread stopped before finishing every request")
    return [list(results[i].generated_tokens) for i in ids]
