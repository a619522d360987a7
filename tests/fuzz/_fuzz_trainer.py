"""The trainer fuzzer's draws (`test_trainer_fuzz.py`): the `Case` (model family and config, `GRPOConfig` /
`InfiniteGRPOConfig` options, prompts, how completions are made, reward functions), the strategy `cases()` over them,
and `PENDING`, the draws gated until their issue-40 fix merges. Running a case and the checks: `_fuzz_trainer_run.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from _fuzz_tools import MAX_COMPLETION, MAX_POSITIONS, TOOL_FAMILIES
from hypothesis import strategies as st

# Draws gated until the helper fixing the case merges (issue 40); the coordinator removes an entry to fuzz it.
PENDING: set[str] = set()  # (none left: every draw of issue 40 is fuzzed)
# `TRL_INFINITE_FUZZ_ENABLE=name,...` fuzzes pending draws too (to check a fix before merging it)
PENDING -= set(filter(None, os.environ.get("TRL_INFINITE_FUZZ_ENABLE", "").split(",")))

LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
EOS = 1  # the tiny tokenizer's `<eos>`
@dataclass(frozen=True)
class Family:
    """A model of the matrix: its model type, the config overrides drawn, and what it needs (`gate`: a PENDING
    entry that must be off; `refused`: `engine` (the engine's contract refuses it) or None; `absolute_positions`:
    learned positions by column, so a left-padded row's training forward is not the rollout's distribution)."""

    model_type: str
    overrides: dict = field(default_factory=dict)
    gate: str | None = None
    refused: str | None = None
    moe: bool = False
    absolute_positions: bool = False


def _rope(kind: str, **extra) -> dict:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **extra}}


FAMILIES: dict[str, Family] = {
    "llama": Family("llama"),
    "llama-linear": Family("llama", _rope("linear", factor=2.0)),
    "llama-yarn": Family("llama", _rope("yarn", factor=2.0, original_max_position_embeddings=256)),
    "llama3": Family("llama", _rope("llama3", factor=2.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "mistral": Family("mistral"),  # a sliding window is drawn
    "gemma2": Family("gemma2"),  # soft-caps, sliding layers, eager attention
    "gemma3_text": Family("gemma3_text"),
    "olmo2": Family("olmo2"),
    "phi3": Family("phi3"),
    "gpt_neox": Family("gpt_neox"),  # partial rotary
    "starcoder2": Family("starcoder2"),
    "cohere": Family("cohere"),
    "granite": Family("granite"),
    "qwen3_moe": Family("qwen3_moe", moe=True),
    "mixtral": Family("mixtral", moe=True),
    # positions that depend on the padding (GPT-2: learned, by column; OPT: from the mask); both with dropout on by
    # default (TRL's micro batches and forward then: `trainer/stochastic.py`) or off (drawn)
    "gpt2": Family("gpt2", absolute_positions=True),
    "opt": Family("opt"),
    # length-dependent RoPE: refused by the engine's contract (`engine/model/rope_length.py`), trained exactly
    # (`max_position_embeddings` 16: the widths of TRL's batches cross it, where dynamic NTK starts scaling)
    "llama-dynamic": Family("llama", _rope("dynamic", factor=2.0) | {"max_position_embeddings": 16},
                            refused="engine"),
    "phi3-longrope": Family("phi3", {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
        "original_max_position_embeddings": 16}}, refused="engine"),
    # not drawn: `llama4_text` (chunked attention). TRL 1.16's own `GRPOTrainer` cannot train it: its fused LM head
    # (`trl.trainer.utils.add_fused_lm_head`) runs `model.base_model`, which for `Llama4ForCausalLM`
    # (`base_model_prefix="language_model"`, backbone at `.model`) is the causal LM itself, so every loss forward
    # raises `AttributeError: 'MoeCausalLMOutputWithPast' object has no attribute 'last_hidden_state'` -- in
    # `GRPOTrainer` alone as in ours (nothing to compare against). Our packed forward of Llama 4's chunks is
    # checked against the model's own padded forward in tests/trainer/test_shared_prefix.py.
    # refused by the engine's contract: TRL's generation, with a warning
    "mamba": Family("mamba", refused="engine"),
    "jamba": Family("jamba", refused="engine", moe=True),
    "bloom": Family("bloom", refused="engine"),  # attention inside its own modules (refused when the engine is built)
    "gptj": Family("gptj"),
}
WINDOWED = {"mistral", "gemma2", "gemma3_text", "starcoder2", "mixtral", "qwen2"}
WORDS = [str(i) for i in range(20)] + ["the", "answer", "is", "what", "plus", "minus", "times", "a", "b", "knight",
                                       "knave", "true", "false", "add", "sum", "of", "to", "in", "?", "."]


@dataclass
class Case:
    family: str
    model_overrides: dict
    args: dict  # fields of both configs
    ours: dict  # `InfiniteGRPOConfig`-only fields
    prompts: list[str]
    completion_seed: int
    rollout: str  # "fixed" | "engine"
    rewards: tuple[str, ...]
    peft: bool = False
    model_seed: int = 0
    completions: list[list[int]] | None = None  # fixed rollouts: row i gets completions[i % len] (shrunk cases)
    eval_prompts: list[str] | None = None  # an eval set, evaluated after every step (`eval_strategy="steps"`)
    conversational: bool = False  # prompts as chat messages (TRL applies the chat template; rewards get messages)
    tools: bool = False  # TRL's tool loop (`_fuzz_tools.py`): conversational, fixed rollouts


# ---------------------------------------------------------------------------------------------------- strategies
def enabled(gate: str | None) -> bool:
    return gate is None or gate not in PENDING


@st.composite
def cases(draw) -> Case:
    name = draw(st.sampled_from(sorted(n for n, f in FAMILIES.items() if enabled(f.gate))))
    family = FAMILIES[name]
    # (a one-layer Jamba has no attention layer, which transformers' own `generate` cannot run)
    overrides = dict(family.overrides, num_hidden_layers=2 if name == "jamba" else draw(st.integers(1, 2)))
    if name in WINDOWED:
        overrides["sliding_window"] = draw(st.sampled_from([2, 3, 5, 8]))
        if name == "qwen2":
            overrides["use_sliding_window"] = draw(st.booleans())
    # TRL adds the router's auxiliary loss for every MoE config (one with `output_router_logits`) unless
    # `router_aux_loss_coef=0.0`
    aux = family.moe and draw(st.booleans())

    G = draw(st.integers(2, 4))
    groups = draw(st.integers(1, 3))
    spg = draw(st.sampled_from([d for d in (1, 2, 3) if (G * groups) % d == 0]))
    loss = draw(st.sampled_from(LOSSES))
    args = dict(
        loss_type=loss,
        num_generations=G,
        per_device_train_batch_size=G * groups // spg,
        steps_per_generation=spg,
        # several optimizer steps per generation batch too (`gradient_accumulation_steps < steps_per_generation`)
        gradient_accumulation_steps=draw(st.sampled_from([spg, spg, 2 * spg, 1])),
        num_iterations=draw(st.integers(1, 2)),
        max_completion_length=draw(st.integers(1, 10)),
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        epsilon=draw(st.sampled_from([0.2, 0.05, 0.5])),
        temperature=draw(st.sampled_from([1.0, 0.7, 1.3])),
        beta=draw(st.sampled_from([0.0, 0.0, 0.04, 0.5])),
        mask_truncated_completions=draw(st.booleans()),
        scale_rewards=draw(st.sampled_from(["group", "batch", "none"])),
        gradient_checkpointing=draw(st.booleans()),
        max_grad_norm=draw(st.sampled_from([0.0, 1.0])),
        learning_rate=draw(st.sampled_from([0.05, 0.3])),
    )
    if family.moe and not aux:
        args["router_aux_loss_coef"] = 0.0
    # dropout on (TRL's default: our micro batches and forward are then TRL's) or off (`disable_dropout` reaches
    # GPT-2's `nn.Dropout` modules, not OPT's functional dropout: its config's)
    if name == "gpt2":
        args["disable_dropout"] = draw(st.booleans())
    elif name == "opt":
        overrides["dropout"] = draw(st.sampled_from([0.0, 0.1]))
    if draw(st.booleans()):
        args["epsilon_high"] = args["epsilon"] + draw(st.sampled_from([0.05, 0.3]))
    if loss in ("grpo", "bnpo", "dr_grpo", "dapo") and draw(st.booleans()):
        args["delta"] = draw(st.sampled_from([1.05, 2.0]))  # two-sided clipping
    if draw(st.booleans()):
        args["off_policy_mask_threshold"] = draw(st.sampled_from([0.01, 0.5]))
    args["pad_to_multiple_of"] = draw(st.sampled_from(["auto", None, 4]))
    args["use_bias_correction_kl"] = draw(st.booleans())
    # split-dependent loss terms (entropy bonus, top-entropy quantile, MoE aux loss) run on TRL's split (issue 40)
    if draw(st.booleans()):
        args["top_entropy_quantile"] = draw(st.sampled_from([0.2, 0.5]))
    if draw(st.booleans()):
        args["entropy_coef"] = draw(st.sampled_from([0.01, 0.5]))
        args["use_adaptive_entropy"] = draw(st.booleans())
    args["max_steps"] = args["num_iterations"] * draw(st.integers(1, 2)) if args["num_iterations"] == 1 else 2

    refused = family.refused is not None
    rollout = "engine" if refused else draw(st.sampled_from(["fixed", "fixed", "engine"]))
    tools = rollout == "fixed" and name in TOOL_FAMILIES and draw(st.sampled_from([False] * 4 + [True]))
    if tools:  # long enough for a call (some: its result rolled back as overlong)
        args["max_completion_length"] = draw(st.sampled_from(MAX_COMPLETION))
        args["max_tool_calling_iterations"] = draw(st.sampled_from([None, 1, 2]))
        overrides["max_position_embeddings"] = MAX_POSITIONS
    ours = dict(
        shared_prefix_training=draw(st.booleans()),
        backward_token_budget=draw(st.sampled_from([None, 4096, 8, 20, 40])),
        # with `gradient_checkpointing`: no recomputation (1.0), slices cut to fit a few dozen tokens' activations,
        # those over about 20 tokens recomputed selectively (1e-4: `test_trainer_fuzz.py` lowers
        # `recompute.MIN_SLICE_TOKENS` to 8), recomputation as TRL (None)
        activation_memory_gb=draw(st.sampled_from([1.0, 1e-4, None])),
    )
    if rollout == "engine":
        ours["rollout_max_active_sequences"] = draw(st.sampled_from([1, 3, 256]))
        ours["rollout_block_size"] = draw(st.sampled_from([1, 4, 16]))
        args["top_k"] = draw(st.sampled_from([0, 5]))
        args["top_p"] = draw(st.sampled_from([1.0, 0.8]))
        args["repetition_penalty"] = draw(st.sampled_from([1.0, 1.3]))
        args["min_p"] = draw(st.sampled_from([None, None, 0.05]))
        # transformers' other logits processors (run by the engine through `generate`'s own classes); the sampling
        # log-probs handed to TRL stay its convention (the temperature only), checked in `_fuzz_trainer_run.py`
        kwargs = draw(st.sampled_from([None, None, {"no_repeat_ngram_size": 2}, {"suppress_tokens": [5, 6, 7]},
                                       {"min_new_tokens": 2}]))
        if kwargs is not None:
            args["generation_kwargs"] = kwargs
        # "Rollouts from stale weights": the pool and its prefix cache kept across rollouts and optimizer steps,
        # under an optimizer whose step bumps no version counter (`adamw_torch_fused`; a large epsilon keeps Adam's
        # update a smooth function of the gradient, so round-off does not flip signs); checked by comparing the
        # engine's sampling log-probs with the loss forward's at the rollout's weights (`_fuzz_trainer_run.py`)
        ours["rollout_kv_cache_release"] = draw(st.booleans())
        if not ours["rollout_kv_cache_release"]:
            ours["rollout_kv_cache_reuse_across_calls"] = draw(st.booleans())
            if draw(st.booleans()):
                args.update(optim="adamw_torch_fused", adam_epsilon=1.0)
    rewards = ("token_sum",)
    if draw(st.booleans()):
        rewards += ("length",)
        if draw(st.booleans()):
            args["multi_objective_aggregation"] = "normalize_then_sum"
        if draw(st.booleans()):
            args["reward_weights"] = [1.0, draw(st.sampled_from([0.5, -2.0]))]
    if rollout == "engine":
        ours["rollout_reward_chunks"] = draw(st.sampled_from(["groups", "groups", "batch"]))
        if draw(st.booleans()):
            relative = ["group_length_penalty", "group_relative_length", "group_rows_length"]
            if ours["rollout_reward_chunks"] == "batch":  # the trainer-wide setting alone keeps it whole
                relative += ["batch_length_penalty", "batch_length_penalty"]
            rewards += (draw(st.sampled_from(relative)),)
            args.pop("reward_weights", None)
    extra = draw(st.sampled_from([(), (), ("reward_model",), ("text_chars",)]))
    rewards += extra  # a reward model (TRL scores the texts it decodes) or a function of the completions' text
    if extra and "reward_weights" in args:
        args["reward_weights"] = [*args["reward_weights"], 0.7]

    peft = not refused and draw(st.sampled_from([False, False, False, True]))
    if args["beta"] > 0 and not peft and draw(st.booleans()):
        # the reference model synced to the policy (TRL's callback, every step): never the rollout's weights
        args.update(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=draw(st.sampled_from([0.6, 1.0])))

    n_prompts = draw(st.integers(groups, groups + 3))
    prompts = [" ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12))) for _ in range(n_prompts)]
    if draw(st.booleans()):  # two dataset rows with the same prompt text: two TRL groups
        prompts.append(prompts[0])
    eval_prompts = None
    if draw(st.sampled_from([False, False, True])):
        # evaluation after every step: TRL's eval rollout (groups of `num_generations_eval`, the model in eval mode,
        # no optimizer step) and its `eval_*` metrics; the eval batch holds whole groups
        # (`group_rows_length` is made for groups of `num_generations`: with another eval group size it would be
        # relative to rows of two groups, a reward TRL's whole batch and our streamed chunks see apart)
        g_eval = draw(st.sampled_from([None, G] if "group_rows_length" in rewards else [None, 1, 2, 3]))
        args.update(eval_strategy="steps", eval_steps=1, num_generations_eval=g_eval,
                    per_device_eval_batch_size=(g_eval or G) * draw(st.integers(1, 2)))
        eval_prompts = [" ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=8)))
                        for _ in range(draw(st.integers(1, 3)))]
    return Case(
        family=name, model_overrides=overrides, args=args, ours=ours, prompts=prompts,
        completion_seed=draw(st.integers(0, 2**16)), rollout=rollout, rewards=rewards,
        peft=peft,
        model_seed=draw(st.integers(0, 3)), eval_prompts=eval_prompts,
        conversational=tools or draw(st.sampled_from([False, False, False, True])), tools=tools,
    )


# ---------------------------------------------------------------------------------------------------- rewards
def token_sum(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def length(completion_ids, **kwargs):
    return [len(ids) / 4.0 for ids in completion_ids]


def text_chars(completions, **kwargs):
    """A function of the decoded text (a string, or the assistant message of a conversational prompt)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) % 5) for t in texts]


def group_length_penalty(completion_ids, **kwargs):
    """Kimi k1.5's length penalty: relative to the shortest and longest completion of the batch it is given."""
    lens = [len(ids) for ids in completion_ids]
    lo, hi = min(lens), max(lens)
    return [0.0 if hi == lo else 0.5 - (n - lo) / (hi - lo) for n in lens]


def batch_length_penalty(completion_ids, **kwargs):
    """`group_length_penalty` without the attribute: drawn only under `rollout_reward_chunks="batch"`."""
    return group_length_penalty(completion_ids)


group_length_penalty.reward_chunks = "batch"  # relative to the whole batch: scored on it (issue 40)


def group_relative_length(completion_ids, prompts, **kwargs):
    """Relative to the completions of the same prompt text: two dataset rows with the same prompt (two TRL groups)
    are one set here, which only the whole batch holds (streamed chunks hold whole TRL groups): declared below."""
    by_prompt: dict = {}
    for p, ids in zip(prompts, completion_ids):
        by_prompt.setdefault(str(p), []).append(len(ids))
    return [len(ids) - sum(by_prompt[str(p)]) / len(by_prompt[str(p)]) for p, ids in zip(prompts, completion_ids)]


group_relative_length.reward_chunks = "batch"  # groups by prompt text (docs/trainer.md, "reward chunks")


def group_rows_length(num_generations: int):
    """Relative to the completions of the same TRL group (each run of `num_generations` rows of the call, as in
    TRL's call and in every streamed chunk, which holds whole groups in row order): streamed."""

    def group_rows_length(completion_ids, **kwargs):
        lens = [len(ids) for ids in completion_ids]
        G = num_generations
        means = [sum(lens[i - i % G:i - i % G + G]) / G for i in range(len(lens))]
        return [n - m for n, m in zip(lens, means)]

    return group_rows_length


REWARDS = {"token_sum": token_sum, "length": length, "text_chars": text_chars,
           "group_length_penalty": group_length_penalty,
           "group_relative_length": group_relative_length, "batch_length_penalty": batch_length_penalty}


def reward_model() -> torch.nn.Module:
    """A tiny sequence-classification reward model (one label), the same random weights at every call."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        return LlamaForSequenceClassification(config).eval()


def reward_funcs(case: Case) -> list:
    """The case's reward functions (`group_rows_length` made for its group size, a fresh `reward_model`)."""
    G = case.args["num_generations"]
    made = {"group_rows_length": lambda: group_rows_length(G), "reward_model": reward_model}
    return [made[r]() if r in made else REWARDS[r] for r in case.rewards]
