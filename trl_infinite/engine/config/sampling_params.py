"""`SamplingParams`: what the rollout engine samples (the `transformers.GenerationConfig` semantics)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from trl_infinite.engine.config.inputs import eos_list
from trl_infinite.engine.config.validate import boolean, integer, number, positive


@dataclass
class SamplingParams:
    """What to sample; semantics follow `transformers.GenerationConfig` (and so TRL's generation settings).

    `temperature == 0` or `do_sample=False` means greedy decoding. `top_k=0`, `top_p=1`, `min_p=0` and
    `repetition_penalty=1` disable those processors. `seed` (an integer in [0, 2**64)) makes sampling reproducible
    per (prompt, sample, position): the same seed gives the same samples in every mode, schedule and with or without
    speculation. `raw_logprobs_temperature` (None: off): also return, per emitted token, its log-probability under
    `softmax(raw logits / raw_logprobs_temperature)`, the model's own distribution at that temperature before any
    truncation, penalty or other processor (TRL computes its `per_token_logps` this way); `RolloutResult.logprobs`
    stays that of the processed distribution the token was drawn from.
    `generation_kwargs` takes any other `GenerationConfig` key (`no_repeat_ngram_size`, `bad_words_ids`,
    `suppress_tokens`, `min_new_tokens`, `typical_p`, `epsilon_cutoff`, `eta_cutoff`, `top_h`, ...), applied through
    the logits processors `generate` builds (see `engine/config/logits.py`); keys that need another decoding algorithm
    (`num_beams > 1`, assisted decoding, ...) raise `ValueError`. Every field's type is checked (here and again when
    `generate` starts); the token ids in `generation_kwargs` are checked against the model's vocabulary, and their
    processors built, when `generate` starts, before any forward (`generation_checks.py`).
    """

    max_new_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    do_sample: bool = True
    eos_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    generation_kwargs: dict = field(default_factory=dict)
    raw_logprobs_temperature: float | None = None

    def __post_init__(self) -> None:
        integer("max_new_tokens", self.max_new_tokens, allow_none=True)
        positive("temperature", self.temperature, allow_zero=True)
        number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p!r}.")
        integer("top_k", self.top_k, minimum=0)
        number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"`min_p` must be in [0, 1], got {self.min_p!r}.")
        positive("repetition_penalty", self.repetition_penalty)
        boolean("do_sample", self.do_sample)  # a string such as "false" is truthy: refused, not read as True
        self.eos_token_ids = eos_list(self.eos_token_ids)
        if not self.eos_token_ids and self.max_new_tokens is None:
            raise ValueError("`eos_token_ids` is empty and `max_new_tokens` is None: generation would never stop. "
                             "Set `max_new_tokens` to a positive integer or give at least one EOS id.")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**64:
            raise ValueError(f"`seed` must be an integer in [0, 2**64), got {self.seed!r} (the sampler's keys are 64 "
                             "bits: a larger or negative seed would silently repeat another seed's samples).")
        positive("raw_logprobs_temperature", self.raw_logprobs_temperature, allow_none=True)
        self._check_generation_kwargs()

    def _check_generation_kwargs(self) -> None:
        import trl_infinite.engine.config.logits as logits
        from trl_infinite.engine.config.generation_checks import check_generation_values

        if not isinstance(self.generation_kwargs, dict):
            raise ValueError(f"`generation_kwargs` must be a dict, got {type(self.generation_kwargs).__name__}.")
        fields_ = sorted(k for k in self.generation_kwargs if k in logits.COMMON_KEYS or k in logits.RESERVED_KEYS)
        if fields_:
            raise ValueError(f"`generation_kwargs` keys {fields_} are `SamplingParams` fields: set the fields instead "
                             "(`eos_token_ids` for `eos_token_id`, `max_new_tokens` for `max_length`).")
        unknown = sorted(set(self.generation_kwargs) - logits.generation_config_keys())
        if unknown:
            raise ValueError(f"`generation_kwargs` keys {unknown} are not `transformers.GenerationConfig` keys.")
        bad = logits.unsupported_generation_keys(logits.generation_config_of(self))
        if bad:
            raise ValueError(f"`generation_kwargs` keys {bad} need a decoding algorithm other than sampling or greedy "
                             "search (or change what `generate` returns); the rollout engine cannot run them.")
        check_generation_values(self.generation_kwargs, self.eos_token_ids)
        ignored = logits.ignored_generation_keys(self.generation_kwargs)
        if ignored:
            warnings.warn(f"`generation_kwargs` keys {ignored} configure `generate`'s own KV cache, compilation or "
                          "returned extras; the rollout engine has its own (its paged KV pool, `EngineConfig.compile`) "
                          "and ignores them. The sampled tokens are the same as `generate`'s.", UserWarning,
                          stacklevel=4)

    @classmethod
    def of(cls, sampling) -> SamplingParams:
        """`generate`'s `sampling` argument: a `SamplingParams` (None: the defaults). Anything else (a dict, a
        `GenerationConfig`, ...) is refused, as vLLM's `generate` refuses it: build `SamplingParams(**mapping)`.
        Its fields are checked again (one may have been set after construction)."""
        if sampling is None:
            return cls()
        if not isinstance(sampling, cls):
            hint = " (build `SamplingParams(**sampling)` from it)" if isinstance(sampling, dict) else ""
            raise ValueError(f"`sampling` must be a `SamplingParams` or None, got {type(sampling).__name__}{hint}.")
        sampling.__post_init__()  # fields set after construction are checked too
        return sampling

    @property
    def greedy(self) -> bool:
        return (not self.do_sample) or self.temperature == 0.0
