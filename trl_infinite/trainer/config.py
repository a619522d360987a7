"""`InfiniteGRPOConfig`: TRL's `GRPOConfig` plus the rollout engine's settings, all prefixed `rollout_`.

Every `rollout_<name>` field maps one-to-one onto `EngineConfig.<name>` (see `engine_config_from_args`), so adding an
engine setting to the trainer is one field here. Validation is the engine's own, with the error naming the
`rollout_` field.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields

from trl import GRPOConfig

from ..engine.config import ATTENTION_BACKENDS, SAMPLING_MODES, EngineConfig
from .streaming import REWARD_EXECUTORS

PREFIX = "rollout_"
TRAINER_ONLY = ("rollout_reward_executor",)  # `rollout_*` fields of the trainer itself, not of `EngineConfig`


def _default(name: str):
    """The engine's own default, so the trainer and the engine never drift apart."""
    f = EngineConfig.__dataclass_fields__[name]
    return f.default if f.default is not MISSING else f.default_factory()


@dataclass
class InfiniteGRPOConfig(GRPOConfig):
    """`GRPOConfig` with the rollout engine's settings. Every TRL field keeps its meaning; the defaults run the
    engine on its fast path (`fixed_slot` continuous batching, each prompt prefilled once for its G samples).

    KV budget (one budget, fixed for the whole run): `rollout_kv_cache_tokens` if set, else `rollout_kv_cache_gb`,
    else `rollout_kv_cache_fraction` of the free GPU memory when the engine starts (65,536 tokens on CPU). Set at
    most one of the first two.
    """

    rollout_sampling_mode: str = field(
        default=_default("sampling_mode"),
        metadata={
            "help": f"How the G samples of each prompt share the decode batch: one of {list(SAMPLING_MODES)}. "
            "`full_group`: all samples at once; `micro_group`: g at a time, the next g start when all g are done; "
            "`fixed_slot`: g slots refilled as soon as a sample finishes; `dynamic_slot`: as many as the KV budget "
            "holds."
        },
    )
    rollout_max_active_sequences: int | None = field(
        default=_default("max_active_sequences"),
        metadata={
            "help": "g, the number of samples decoding at once in `micro_group` and `fixed_slot` modes (ignored by "
            "`full_group` and `dynamic_slot`). Also the size of the chunks streamed to the reward functions."
        },
    )
    rollout_kv_cache_tokens: int | None = field(
        default=_default("kv_cache_tokens"),
        metadata={"help": "KV budget in tokens (all layers). Takes precedence over the other budgets."},
    )
    rollout_kv_cache_gb: float | None = field(
        default=_default("kv_cache_gb"),
        metadata={"help": "KV budget in GB (K and V, all layers). Set this or `rollout_kv_cache_tokens`, not both."},
    )
    rollout_kv_cache_fraction: float = field(
        default=_default("kv_cache_fraction"),
        metadata={"help": "With no explicit budget: fraction of the free GPU memory taken for the KV pool."},
    )
    rollout_block_size: int = field(
        default=_default("block_size"), metadata={"help": "Tokens per KV block of the paged cache."}
    )
    rollout_max_prefill_tokens: int = field(
        default=_default("max_prefill_tokens"),
        metadata={
            "help": "Most prompt tokens run through the model in one prefill forward (longer ones are chunked)."
        },
    )
    rollout_attention_backend: str = field(
        default=_default("attention_backend"),
        metadata={"help": f"Paged attention kernel: one of {list(ATTENTION_BACKENDS)} (`auto` picks the fastest)."},
    )
    rollout_cuda_graphs: bool = field(
        default=_default("cuda_graphs"),
        metadata={"help": "On CUDA, capture the decode step in one CUDA graph per batch bucket and replay it (recaptured "
                  "when parameter storage changes, e.g. ZeRO-3/FSDP gathers)."},
    )
    rollout_compile: bool = field(
        default=_default("compile"),
        metadata={"help": "torch.compile the static decode step (fullgraph); with CUDA graphs the compiled step is "
                  "captured."},
    )
    rollout_compile_backend: str = field(
        default=_default("compile_backend"),
        metadata={"help": "torch.compile backend of `rollout_compile` ('inductor', or 'eager' / 'aot_eager' to debug)."},
    )
    rollout_scheduler: str = field(
        default=_default("scheduler"),
        metadata={"help": "Scheduling policy (registry name) deciding which pending sample takes a free slot."},
    )
    rollout_batch_policy: str = field(
        default=_default("batch_policy"),
        metadata={"help": "Admission policy (registry name) deciding how many samples run at once."},
    )

    rollout_length_predictor: str | None = field(
        default=_default("length_predictor"),
        metadata={
            "help": "Length predictor of the length-aware schedulers (`sjf`, `lfs`, `lrf`, `fptas`, `infinite`): "
            "`history` (the prompt's lengths on earlier steps, else finished siblings, else `prefix`, else the mean), "
            "`prefix` (online regression head on the policy's hidden state at completion token k), `group` "
            "(finished siblings), `none`. In Python code also a callable `(prompt_ids, prefix_ids) -> length` or a "
            "sequence-classification model."
        },
    )
    rollout_prefix_predictor_k: int = field(
        default=_default("prefix_predictor_k"),
        metadata={"help": "k: completion tokens the `prefix` length predictor reads before predicting."},
    )
    rollout_fptas_epsilon: float = field(
        default=_default("fptas_epsilon"),
        metadata={"help": "FPTAS tolerance of the `fptas`/`infinite` schedulers: plan <= (1 + eps) * optimum."},
    )
    rollout_chunk_tokens: int | None = field(
        default=_default("chunk_tokens"),
        metadata={
            "help": "Divided rollout: a sample decodes at most this many tokens, then returns to the queue with its "
            "KV kept (moved to host memory when the pool needs room). None = off."
        },
    )
    rollout_sla_decode_ms: float | None = field(
        default=_default("sla_decode_ms"),
        metadata={"help": "`rollout_batch_policy='sla'`: target decode step latency in milliseconds."},
    )
    rollout_speculative_method: str | None = field(
        default=_default("speculative_method"),
        metadata={
            "help": "Lossless speculative decoding: None (off), `suffix` (drafts from sibling samples of the same "
            "prompt), `ngram` (prompt lookup), `draft_model`, `best_of_n` (picks per sample among the others)."
        },
    )
    rollout_num_speculative_tokens: int = field(
        default=_default("num_speculative_tokens"),
        metadata={"help": "Most draft tokens verified per sample and decode step (k)."},
    )
    rollout_speculative_draft_model: str | None = field(
        default=_default("speculative_draft_model"),
        metadata={"help": "Draft model path (sharing the policy's tokenizer) for `draft_model` and `best_of_n`."},
    )
    rollout_speculative_suffix_sources: str = field(
        default=_default("speculative_suffix_sources"),
        metadata={
            "help": "Texts the `suffix` drafter matches: `siblings+history` (this step's siblings and the prompt's "
            "completions from earlier steps), `siblings` or `history`."
        },
    )
    rollout_speculative_adaptive: bool = field(
        default=_default("speculative_adaptive"),
        metadata={
            "help": "Adapt each sample's draft length to its acceptance and switch speculation off while the batch "
            "is large (online cost model). False: always draft `rollout_num_speculative_tokens`."
        },
    )

    rollout_reward_executor: str = field(
        default="main_thread",
        metadata={
            "help": f"Where streamed reward functions run: one of {list(REWARD_EXECUTORS)}. `main_thread`: between "
            "decode steps on the training thread (like `GRPOTrainer`: `signal.alarm` timeouts work). `thread`: on "
            "one background thread, overlapping the decode steps on CPU too; reward functions then must not use "
            "signals (TRL's `accuracy_reward` silently disables its timeout there) and must be thread-safe."
        },
    )
    rollout_history_fallback: str = field(
        default=_default("history_fallback"),
        metadata={
            "help": "`rollout_length_predictor=history`: what predicts a prompt not seen before, before the mean of "
            "recent lengths: `none`, `siblings`, `prefix` or `siblings+prefix`."
        },
    )
    rollout_history_max_prompts: int = field(
        default=_default("history_max_prompts"),
        metadata={
            "help": "Per-prompt history kept across steps (GRPO revisits its prompts every epoch): the lengths and "
            "completions of each prompt's last visits feed the `history` length predictor and the `suffix` "
            "drafter. Most prompts kept (least recently visited dropped first); 0 = no history."
        },
    )
    rollout_history_max_visits: int = field(
        default=_default("history_max_visits"), metadata={"help": "Visits remembered per prompt (most recent)."}
    )
    rollout_history_max_tokens: int = field(
        default=_default("history_max_tokens"),
        metadata={"help": "Most completion token ids the history keeps for drafts; 0 = lengths only."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout_reward_executor not in REWARD_EXECUTORS:
            raise ValueError(
                f"`rollout_reward_executor` must be one of {list(REWARD_EXECUTORS)}, got {self.rollout_reward_executor!r}."
            )
        engine_config_from_args(self)  # validates; raises naming the `rollout_` field


def rollout_field_names(args) -> list[str]:
    """Names of the engine's `rollout_*` fields of a config (subclasses may add more)."""
    return [f.name for f in fields(args) if f.name.startswith(PREFIX) and f.name not in TRAINER_ONLY]


def engine_config_from_args(args) -> EngineConfig:
    """`EngineConfig` from the `rollout_*` fields: `rollout_<name>` -> `EngineConfig.<name>`."""
    engine_fields = {f.name for f in fields(EngineConfig)}
    kwargs = {}
    for name in rollout_field_names(args):
        key = name[len(PREFIX):]
        if key not in engine_fields:
            raise ValueError(f"`{name}` has no matching `EngineConfig.{key}` field.")
        kwargs[key] = getattr(args, name)
    try:
        return EngineConfig(**kwargs)
    except ValueError as err:
        # name the user's field: `block_size` -> `rollout_block_size`
        message = re.sub(r"`(\w+)`", lambda m: f"`{PREFIX}{m[1]}`" if m[1] in kwargs else m[0], str(err))
        raise ValueError(message) from err
