"""Every `transformers.GenerationConfig` sampling key, through the logits processors `generate` itself builds.

`SamplingParams` keeps the common keys (temperature, top-k, top-p, min-p, repetition penalty) as fields: the
`Sampler` runs them on its fast path. Any other key (`no_repeat_ngram_size`, `bad_words_ids`, `suppress_tokens`,
`min_new_tokens`, `typical_p`, `epsilon_cutoff`, `eta_cutoff`, `top_h`, `sequence_bias`, ...) goes in
`SamplingParams.generation_kwargs`; `GenerationProcessors` then asks the model for the processor list `generate`
would use (`GenerationMixin._get_logits_processor`, common keys included, in `generate`'s order) and applies it to
each row on that row's own context (prompt + completion so far, no padding), with the processors that depend on the
prompt length (`min_new_tokens`, `begin_suppress_tokens`, `exponential_decay_length_penalty`, `forced_eos_token_id`)
built for that row's prompt: exactly what `generate` does for that row alone.

Keys that need another decoding algorithm (beam search, assisted / contrastive / DoLa decoding, constrained beams),
extra model passes (classifier-free guidance), cross-step state (SynthID watermarking), prompt rewriting (token
healing), several outputs per prompt or other stopping rules cannot be run exactly by the engine:
`unsupported_generation_keys` names them and `SamplingParams` refuses them.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
from transformers import GenerationConfig
from transformers.generation import logits_process as lp
from transformers.generation.configuration_utils import GenerationMode

from trl_infinite.engine.config.generation_checks import check_generation_ids

# `SamplingParams` fields (the fast path) and the processors `generate` builds from them
COMMON_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "do_sample")
COMMON_PROCESSORS = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
                     lp.RepetitionPenaltyLogitsProcessor)
# set through other `SamplingParams` fields (`eos_token_ids`, `max_new_tokens`) or bookkeeping of the config itself
RESERVED_KEYS = ("eos_token_id", "max_new_tokens", "max_length", "transformers_version", "_from_model_config")
_DECODING_MODES = (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH)
# processors that keep state across decoding steps or run the model themselves: not reproducible row by row
_STATEFUL_PROCESSORS = ("UnbatchedClassifierFreeGuidanceLogitsProcessor", "SynthIDTextWatermarkLogitsProcessor")


# keys that configure `generate`'s own machinery (its KV cache, compilation, what it returns besides the tokens):
# the engine has its own and leaves them without effect; they do not change the sampled tokens. (`disable_compile`
# is left out: TRL sets it on every config it builds.)
IGNORED_KEYS = ("cache_implementation", "cache_config", "max_cache_len", "compile_config", "use_cache",
                "prefill_chunk_size", "low_memory", "continuous_batching_config", "output_attentions",
                "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate")


def ignored_generation_keys(generation_kwargs: dict) -> list[str]:
    """The keys of `generation_kwargs` the engine accepts but does not honour (`IGNORED_KEYS`), where they ask for
    something (not None, not `generate`'s default, not False for the flags asking for extra outputs)."""
    defaults = GenerationConfig._get_default_generation_params()

    def asks(key, value) -> bool:
        return value is not None and not (key in defaults and defaults[key] == value) and not (
            value is False and key != "use_cache")

    return sorted(k for k, v in generation_kwargs.items() if k in IGNORED_KEYS and asks(k, v))


def generation_config_keys() -> frozenset[str]:
    """Every key a `GenerationConfig` knows."""
    return frozenset(k for k in GenerationConfig().__dict__ if not k.startswith("_"))


def unsupported_generation_keys(config: GenerationConfig) -> list[str]:
    """Keys of `config` the engine cannot run exactly (empty when it can): those that select a decoding algorithm
    other than sampling / greedy, and those that change what `generate` returns or when it stops."""
    bad = []
    values = config.to_diff_dict()
    if config.get_generation_mode() not in _DECODING_MODES:
        for key in values:
            if key in COMMON_KEYS:
                continue
            trial = GenerationConfig(**{k: v for k, v in values.items() if k != key and k in generation_config_keys()})
            if trial.get_generation_mode() in _DECODING_MODES:
                bad.append(key)
        bad = bad or [k for k in values if k not in COMMON_KEYS]
    if (config.num_return_sequences or 1) != 1:
        bad.append("num_return_sequences")
    for key in ("stop_strings", "max_time", "token_healing"):
        if getattr(config, key, None):
            bad.append(key)
    if config.guidance_scale is not None and config.guidance_scale != 1:
        bad.append("guidance_scale")
    watermark = config.watermarking_config
    if watermark is not None and type(watermark).__name__.startswith("SynthID"):
        bad.append("watermarking_config")
    return sorted(set(bad))


def split_generation_config(config: GenerationConfig) -> tuple[dict, dict]:
    """(`SamplingParams` fields of the common keys, every other set key of `config` for `generation_kwargs`).

    Unset common keys get the values that disable them (`top_k=0`, `min_p=0`, ...); keys at `generate`'s own
    defaults are left out (they change nothing)."""
    common = {
        "temperature": 1.0 if config.temperature is None else config.temperature,
        "top_k": config.top_k or 0,
        "top_p": 1.0 if config.top_p is None else config.top_p,
        "min_p": config.min_p or 0.0,
        "repetition_penalty": 1.0 if config.repetition_penalty is None else config.repetition_penalty,
        "do_sample": bool(config.do_sample),
    }
    known = generation_config_keys()
    defaults = GenerationConfig._get_default_generation_params()  # what `generate` uses for unset keys: no-ops
    skip = (*COMMON_KEYS, *RESERVED_KEYS)
    extra = {k: v for k, v in config.to_diff_dict().items()
             if k in known and k not in skip and not (k in defaults and defaults[k] == v)}
    return common, extra


def generation_config_of(params) -> GenerationConfig:
    """The `GenerationConfig` `generate` would get for these `SamplingParams` (max length set per prompt later)."""
    kw = dict(params.generation_kwargs)
    kw["do_sample"] = not params.greedy
    kw["repetition_penalty"] = params.repetition_penalty
    kw["eos_token_id"] = list(params.eos_token_ids) or None
    if not params.greedy:  # generate ignores the warpers when greedy; setting them would only warn
        kw.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p or None)
    elif "penalty_alpha" in kw:  # greedy + top_k + penalty_alpha is contrastive search: keep top_k to detect it
        kw["top_k"] = params.top_k
    return GenerationConfig(**kw)


class GenerationProcessors:
    """`generate`'s logits processors for the call's `SamplingParams`, applied to each row on its own context.

    `active` is False when the list holds only the common processors (the `Sampler`'s fast path then runs instead).
    """

    def __init__(self, model: torch.nn.Module, params, device: torch.device, max_new: int | None = None):
        """`max_new`: the call's completion limit (`params.max_new_tokens`, resolved from the model's
        `max_position_embeddings` where that is None), which `forced_eos_token_id` and the length processors use."""
        self.model, self.params, self.device = model, params, device
        self.max_new = params.max_new_tokens if max_new is None else max_new
        self.config = generation_config_of(params)
        self._by_prompt_len: dict[int, lp.LogitsProcessorList] = {}
        probe = self.for_prompt(1)
        stateful = [type(p).__name__ for p in probe if type(p).__name__ in _STATEFUL_PROCESSORS]
        if stateful:
            raise ValueError(f"logits processors {stateful} keep state across steps; the engine cannot run them.")
        self.active = any(not isinstance(p, COMMON_PROCESSORS) for p in probe)

    @classmethod
    def for_call(cls, model: torch.nn.Module, params, device: torch.device, max_new: int, prompt_lens: list[int],
                 vocab_size: int) -> GenerationProcessors | None:
        """The processors of `params.generation_kwargs` (None without any), built for every prompt length of the call
        before it starts: their ids checked against the vocabulary and their own argument checks run now, not at the
        step that first uses them (`generation_checks.py`)."""
        if not params.generation_kwargs:
            return None
        check_generation_ids(params.generation_kwargs, vocab_size)
        processors = cls(model, params, device, max_new)
        for n in sorted(set(prompt_lens)):
            processors.for_prompt(n)
        return processors

    def for_prompt(self, prompt_len: int) -> lp.LogitsProcessorList:
        """The processors `generate` builds for one prompt of `prompt_len` tokens (cached per length)."""
        procs = self._by_prompt_len.get(prompt_len)
        if procs is None:
            config = copy.deepcopy(self.config)
            if self.max_new is not None:
                config.max_length = prompt_len + self.max_new
            if config.min_new_tokens is not None:  # as `generate`'s `_prepare_generated_length`
                config.min_length = config.min_new_tokens + prompt_len
            self.model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=self.device)
            procs = self.model._get_logits_processor(config, input_ids_seq_length=prompt_len, device=self.device)
            self._by_prompt_len[prompt_len] = procs
        return procs

    def __call__(self, scores: torch.Tensor, history: torch.Tensor, prompt_lens: list[int]) -> torch.Tensor:
        """[N, V] float32 raw scores -> [N, V] processed scores. `history` [N, L] is each row's context (prompt and
        completion so far, -1 padded on the right); rows sharing (prompt length, context length) run together."""
        lengths = (history >= 0).sum(1).tolist()
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for row, (p, n) in enumerate(zip(prompt_lens, lengths)):
            groups[(p, n)].append(row)
        out = torch.empty_like(scores)
        for (p, n), rows in groups.items():
            idx = torch.tensor(rows, device=scores.device)
            ids = history[idx, :n].to(self.device)  # [r, n]
            out[idx] = self.for_prompt(p)(ids, scores[idx].to(self.device)).to(out.device)
        return out
