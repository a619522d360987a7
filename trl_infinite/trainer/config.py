"""`InfiniteGRPOConfig`: TRL's `GRPOConfig` plus the rollout engine's settings, all prefixed `rollout_`.

The `rollout_<flag>` fields are generated from `EngineConfig`'s settings, nested sections included (each setting's
flag is its section's prefix + its name, `engine/config/sections.py`: `rollout_kv_cache_gb` -> `config.kv_cache.gb`), with
the setting's type, default and help, and the modules that read it; `_add_engine_fields`). A new engine setting is a
trainer flag with no edit here. Fields whose engine type the command line cannot parse (`object`: a name *or* a
callable / model) take their string form (`CLI_TYPES`). Validation is the engine's own, with the error naming the
`rollout_` field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.config.sections import flags
from trl_infinite.trainer.streamed_rewards import REWARD_CHUNKS, REWARD_EXECUTORS

PREFIX = "rollout_"
TRAINER_ONLY = ("rollout_reward_executor", "rollout_reward_chunks")  # `rollout_*` fields of the trainer itself, not of `EngineConfig`
# engine settings typed `object` (a registry name, or in Python a callable / model): the CLI parses their string form
CLI_TYPES = {"length_predictor": "str", "speculative_draft_model": "str | None"}
# what the trainer adds to an engine field's help
TRAINER_NOTES = {"max_active_sequences": "Also the least number of completions (whole prompt groups) in one streamed "
                                         "reward call (`rollout_reward_chunks`)."}


def flag_help(flag) -> str:
    """A trainer flag's help: the setting's, the trainer's note, and where it is read (`Flag.readers`)."""
    read = "Read in " + ", ".join(f"`{m}`" for m in flag.readers) + "."
    return " ".join(x for x in (flag.field.metadata["help"], TRAINER_NOTES.get(flag.name, ""), read) if x)


def _add_engine_fields(cls: type) -> type:
    """Before `@dataclass`: add `rollout_<flag>` for each `EngineConfig` setting, in the engine's order, ahead of
    the class's own fields."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    annotations = {}
    for flag in flags(EngineConfig):
        annotations[PREFIX + flag.name] = CLI_TYPES.get(flag.name, flag.field.type)
        setattr(cls, PREFIX + flag.name, field(default=flag.default, metadata={"help": flag_help(flag)}))
    cls.__annotations__ = {**annotations, **own}
    return cls


@dataclass
@_add_engine_fields
class InfiniteGRPOConfig(GRPOConfig):
    """`GRPOConfig` with the rollout engine's settings. Every TRL field keeps its meaning; the defaults run the
    engine on its fast path (`fixed_slot` continuous batching, each prompt prefilled once for its G samples).

    KV budget (one budget, fixed for the whole run): `rollout_kv_cache_tokens` if set, else `rollout_kv_cache_gb`,
    else `rollout_kv_cache_fraction` of the free GPU memory when the engine starts (65,536 tokens on CPU). Set at
    most one of the first two. The `rollout_*` fields besides `rollout_reward_executor` are `EngineConfig`'s.
    """

    rollout_reward_executor: str = field(
        default="main_thread",
        metadata={
            "help": f"Where streamed reward functions run: one of {list(REWARD_EXECUTORS)}. `main_thread`: between "
            "decode steps on the training thread (like `GRPOTrainer`: `signal.alarm` timeouts work). `thread`: on "
            "one background thread, overlapping the decode steps on CPU too; reward functions then must not use "
            "signals (TRL's `accuracy_reward` silently disables its timeout there) and must be thread-safe."
        },
    )

    rollout_reward_chunks: str = field(
        default="groups",
        metadata={
            "help": f"What one streamed call of a reward function holds: one of {list(REWARD_CHUNKS)}. `groups`: "
            "whole prompt groups (all G completions of a prompt, as this process holds them), at least "
            "`rollout_max_active_sequences` (or G) completions, scored while the rest of the batch decodes, so a "
            "group-relative reward (e.g. a length penalty over a prompt's samples) gets the value it has on the "
            "whole batch. `batch`: the whole batch in one call, once every completion finished (what "
            "`GRPOTrainer` passes: for a function that compares completions across prompts). A single function can "
            "ask for the whole batch by having the attribute `reward_chunks = \"batch\"` (it is then called by "
            "TRL after the rollout)."
        },
    )

    shared_prefix_training: bool = field(
        default=True,
        metadata={
            "help": "Encode each group's prompt once in the training forward and backward instead of once per "
            "completion (`trainer/shared_prefix.py`): the G rows of a prompt are packed into one sequence, each "
            "completion attending to the shared prompt and to itself. Exact (same log-probs and gradients as TRL's "
            "padded forward, up to float rounding); a model it cannot run exactly (checked once at start-up) "
            "trains with TRL's forward, with a warning naming why."
        },
    )

    backward_token_budget: int | None = field(
        default=4096,
        metadata={
            "help": "Most tokens in one forward + backward of the loss (the packed tokens of the shared-prefix "
            "forward, else rows x padded width). A micro batch above it runs as that many slices of rows (whole "
            "groups where they fit) whose gradients accumulate into exactly the micro batch's, so the memory of the "
            "backward stays flat in G and completion length (`trainer/loss_slices.py`); TRL's metrics are merged "
            "back to the micro batch's values. Applies to the losses that are sums over rows (all but the entropy "
            "bonus, `top_entropy_quantile < 1` and the MoE auxiliary loss) without DeepSpeed / FSDP. None: TRL's "
            "one pass per micro batch."
        },
    )

    activation_memory_gb: float | None = field(
        default=None,
        metadata={
            "help": "With `gradient_checkpointing=True` (TRL's default): the most GB of activations one slice of the "
            "loss may keep for its backward. Slices whose activations fit (measured once per model: the bytes "
            "autograd saves per token) run without recomputing their forward in the backward, 3/4 of the work of "
            "a checkpointed step; slices that fit only with their matrix products' outputs kept (about half of "
            "that) recompute the rest selectively (PyTorch's selective activation checkpointing; it needs "
            "`use_reentrant=False`, TRL's default), so no matrix product runs twice; a micro batch is cut into "
            "more, smaller slices to fit (see `backward_token_budget`); where not even 256 tokens fit, every slice "
            "recomputes, as TRL does. Same values either way (`trainer/recompute.py`). DDP or one process, not "
            "with `top_entropy_quantile < 1` or dropout (TRL's own forward). None (the default): recompute "
            "whenever `gradient_checkpointing` is on, as TRL. Measured on CPU (SmolLM2-135M, float32, 8x2@128, "
            "one slice of about 2,230 tokens, forced lengths): 1.8 (the slice selective) takes 20% less backward "
            "time and 1.2 GB more peak memory; 0.4 cuts it into several selective slices, saves nothing and still "
            "raises the peak by 0.5 GB (each later slice runs beside the whole gradient)."
        },
    )

    host_tensor_cache_mb: int | None = field(
        default=256,
        metadata={
            "help": "Training on CPU: CPU tensors of 1 MiB or more come from a caching allocator (each its own "
            "mapping, a freed one reused by the next tensor of its size class) that keeps at most this many MiB of "
            "freed blocks, giving the oldest back to the OS beyond it, and all of them after each rollout and each "
            "backward slice (`engine/runner/host_memory.py`). With glibc's `malloc` alone the small allocations made "
            "between large ones fragment the heap, and the step's resident memory grows with the tokens per step far "
            "beyond its live tensors. Process-wide once installed; values are unchanged. None: off (PyTorch's "
            "default allocator)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.host_tensor_cache_mb is not None and (
            not isinstance(self.host_tensor_cache_mb, int) or isinstance(self.host_tensor_cache_mb, bool)
            or self.host_tensor_cache_mb < 0
        ):
            raise ValueError(f"`host_tensor_cache_mb` must be a non-negative integer or None, got "
                             f"{self.host_tensor_cache_mb!r}.")
        if self.backward_token_budget is not None and (
            not isinstance(self.backward_token_budget, int) or isinstance(self.backward_token_budget, bool)
            or self.backward_token_budget < 1
        ):
            raise ValueError(f"`backward_token_budget` must be a positive integer or None, got "
                             f"{self.backward_token_budget!r}.")
        if self.activation_memory_gb is not None and (
            not isinstance(self.activation_memory_gb, (int, float)) or isinstance(self.activation_memory_gb, bool)
            or not self.activation_memory_gb > 0
        ):
            raise ValueError(f"`activation_memory_gb` must be a positive number or None, got "
                             f"{self.activation_memory_gb!r}.")
        if not isinstance(self.shared_prefix_training, bool):
            raise ValueError(f"`shared_prefix_training` must be True or False, got {self.shared_prefix_training!r}.")
        if self.rollout_reward_chunks not in REWARD_CHUNKS:
            raise ValueError(
                f"`rollout_reward_chunks` must be one of {list(REWARD_CHUNKS)}, got {self.rollout_reward_chunks!r}."
            )
        if self.rollout_reward_executor not in REWARD_EXECUTORS:
            raise ValueError(
                f"`rollout_reward_executor` must be one of {list(REWARD_EXECUTORS)}, got {self.rollout_reward_executor!r}."
            )
        engine_config_from_args(self)  # validates; raises naming the `rollout_` field


def rollout_field_names(args) -> list[str]:
    """Names of the engine's `rollout_*` fields of a config (subclasses may add more)."""
    return [f.name for f in fields(args) if f.name.startswith(PREFIX) and f.name not in TRAINER_ONLY]


def engine_config_from_args(args, **overrides) -> EngineConfig:
    """`EngineConfig` from the `rollout_*` fields: `rollout_<flag>` -> the setting of that flag; `overrides`: flags
    set by the trainer whatever the fields say."""
    engine_flags = {f.name for f in flags(EngineConfig)}
    kwargs = {}
    for name in rollout_field_names(args):
        key = name[len(PREFIX):]
        if key not in engine_flags:
            raise ValueError(f"`{name}` has no matching `EngineConfig` setting `{key}`.")
        kwargs[key] = getattr(args, name)
    kwargs.update(overrides)
    try:
        return EngineConfig(**kwargs)
    except ValueError as err:
        # name the user's field: `block_size` -> `rollout_block_size`
        message = re.sub(r"`(\w+)`", lambda m: f"`{PREFIX}{m[1]}`" if m[1] in kwargs else m[0], str(err))
        raise ValueError(message) from err
