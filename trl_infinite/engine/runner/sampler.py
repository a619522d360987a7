"""Token sampling with `transformers` generate semantics and counter-based randomness.

Processing order is the one `GenerationMixin` uses: repetition penalty, then temperature, top-k, top-p, min-p (the
warpers are transformers' own classes); with any other `GenerationConfig` key in `SamplingParams.generation_kwargs`
the whole processor list `generate` builds runs instead, row by row (`engine/config/logits.py`). A draw is an inverse-CDF
lookup: with the row's cumulative probabilities `c_v = sum_{w <= v} p_w` and one uniform `U`, the token is the
first `v` with `c_v > U * c_V`, an exact draw from `p` (zero-probability tokens are never hit: their `c_v` does not
rise), in two levels with no host sync and static shapes (`categorical`).

Every uniform is a pure function of (seed, prompt index, sample index, position, stream), a counter-based
generator: the same seed gives the same sample whatever the batch composition, the sampling mode or the scheduler,
and speculative verification recomputes plain sampling's draw at each position from the same uniform, so it emits
the same tokens (`spec_decode/verify.py`). `seed` is an integer in [0, 2**64): distinct seeds give distinct keys.
"""

from __future__ import annotations

import torch
from transformers.generation import logits_process as lp

from trl_infinite.engine.config.engine_config import SamplingParams
from trl_infinite.engine.config.logits import GenerationProcessors
from trl_infinite.engine.sched.batch import INVALID_TOKEN

_MASK = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 64) if v >= 1 << 63 else v


_C1 = 0xFF51AFD7ED558CCD - (1 << 64)  # murmur3 fmix64 constants, as signed int64
_C2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
STREAM_SAMPLE = 0  # the stream of every sampled token (other streams are free for other uses)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix64 finaliser on int64 tensors (wrapping arithmetic)."""
    x = x ^ _shr(x, 33)
    x = x * _C1
    x = x ^ _shr(x, 33)
    x = x * _C2
    return x ^ _shr(x, 33)


def seed_base(seed: int, stream: int = STREAM_SAMPLE) -> int:
    """The per-(seed, stream) start of every key, as a signed int64 (host side: static decode takes it as a tensor,
    so a new seed changes a buffer, not the captured graph)."""
    return _signed(seed * 0x9E3779B97F4A7C15 + stream + 1)


def row_keys(seed, group_ids: torch.Tensor, sample_ids: torch.Tensor, positions: torch.Tensor,
             stream: int = 0) -> torch.Tensor:
    """One int64 key per row from (seed, prompt, sample, position, stream). All inputs [N] int64. `seed` is an int,
    or a 0-d int64 tensor holding `seed_base(seed, stream)` (then `stream` is already folded in)."""
    if isinstance(seed, torch.Tensor):
        k = mix64(seed.expand_as(group_ids))
    else:
        k = mix64(torch.full_like(group_ids, seed_base(seed, stream)))
    for part in (group_ids, sample_ids, positions):
        k = mix64(k ^ (part * _GOLDEN))
    return k


def uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """[N, n] float32 uniforms in (0, 1), the v-th column a function of (key, v) only."""
    cols = torch.arange(n, device=keys.device, dtype=torch.long)
    bits = _shr(mix64(keys[:, None] + cols[None, :] * _GOLDEN), 40)  # 24 random bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def uniform64(keys: torch.Tensor) -> torch.Tensor:
    """[N] float64 uniforms in [0, 1) with 53 random bits, one per key."""
    return _shr(mix64(keys), 11).to(torch.float64) * (1.0 / (1 << 53))


CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF


def categorical(logprobs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exact sample from softmax(logprobs) per row ([N, V] -> [N]) by inverse CDF with one uniform per row.

    Two levels of `CDF_BLOCK` tokens, so the whole row is read only twice (exp, block sums): the target
    `t = U * sum_j b_j` (block sums `b_j`, cumulated in float64) falls in the first block whose cumulative sum
    exceeds it; inside that block, the token is the first whose float64 running sum exceeds what is left of `t`
    (no running sum over the whole vocabulary: in float32 it would misplace rare tokens). Rounding between the two
    levels (a block sum in float32 is exact to ~1e-7 of the block's mass) can only move such a sliver of mass onto
    the block's last token of nonzero probability: a zero-probability token is never drawn."""
    n, vocab = logprobs.shape
    probs = logprobs.float().exp()  # [N, V]
    full = vocab // CDF_BLOCK * CDF_BLOCK
    sums = [probs[:, :full].view(n, -1, CDF_BLOCK).sum(-1)] if full else []
    if full < vocab:
        sums.append(probs[:, full:].sum(-1, keepdim=True))
    block_cdf = torch.cat(sums, -1).double().cumsum(-1)  # [N, J]
    total = block_cdf[:, -1:]
    target = torch.minimum(uniform64(keys)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True).clamp_max(block_cdf.shape[1] - 1)  # [N, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), torch.zeros_like(target))
    cols = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)  # [N, B] token ids of the block
    inner = torch.where(cols < vocab, probs.gather(1, cols.clamp_max(vocab - 1)), 0.0)
    idx = torch.searchsorted(inner.double().cumsum(-1), target - before, right=True)  # [N, 1]
    last = CDF_BLOCK - 1 - torch.argmax((inner.flip(-1) > 0).int(), -1, keepdim=True)  # last nonzero in the block
    return (block * CDF_BLOCK + torch.minimum(idx, last))[:, 0]


def seen_mask(history: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, L] token ids padded with -1 -> [N, V] bool: which ids occur in each row's context."""
    # padding (-1) goes to a spare column V: scattering it onto id 0 would race with real occurrences of token 0
    seen = torch.zeros(history.shape[0], vocab + 1, dtype=torch.bool, device=history.device)
    seen.scatter_(1, torch.where(history >= 0, history, vocab), True)
    return seen[:, :vocab]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' rule on every token already in the context (`seen` [N, V] bool): negative logits * penalty,
    positive ones / penalty."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


class Sampler:
    """Processes logits and samples one token per row with the call's `SamplingParams`.

    `processors` (built by the engine, which has the model) carries `generate`'s processor list when
    `params.generation_kwargs` asks for more than the common keys; it is used only when `active`, and then
    `has_extra_processors` is True: processing runs eagerly, row by row, on each row's context (`history`,
    `prompt_lens`), and the static decode path is not used.
    """

    def __init__(self, params: SamplingParams, processors: GenerationProcessors | None = None):
        self.params = params
        self.processors = processors if processors is not None and processors.active else None
        warpers = []
        if not params.greedy:
            if params.temperature != 1.0:
                warpers.append(lp.TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                warpers.append(lp.TopKLogitsWarper(top_k=params.top_k))
            if params.top_p < 1.0:
                warpers.append(lp.TopPLogitsWarper(top_p=params.top_p))
            if params.min_p > 0.0:
                warpers.append(lp.MinPLogitsWarper(min_p=params.min_p))
        self.warpers = lp.LogitsProcessorList(warpers)
        self.raw_temperature = params.raw_logprobs_temperature
        # the raw log-probs are the processed ones when nothing but the same temperature processes the logits
        self._raw_is_processed = (
            self.processors is None and not params.greedy and params.temperature == self.raw_temperature
            and not params.top_k and params.top_p >= 1.0 and params.min_p <= 0.0 and params.repetition_penalty == 1.0
        )

    @property
    def params_key(self) -> tuple:
        """What processing and sampling depend on (not the seed, EOS ids or lengths): static decode is keyed on it."""
        p = self.params
        return (p.greedy, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                repr(sorted(p.generation_kwargs.items())), self.processors is not None, p.raw_logprobs_temperature)

    @property
    def has_extra_processors(self) -> bool:
        """True when processors beyond the built-in fast path run (eager, row by row; no static decode)."""
        return self.processors is not None

    @property
    def uses_context(self) -> bool:
        """Whether processing needs the ids already in each row's context (the repetition penalty, or any extra
        processor)."""
        return self.processors is not None or self.params.repetition_penalty != 1.0

    def process(self, logits: torch.Tensor, seen: torch.Tensor | None = None, history: torch.Tensor | None = None,
                prompt_lens: list[int] | None = None) -> torch.Tensor:
        """[N, V] raw logits -> [N, V] float32 log-probabilities of the distribution actually sampled from.
        `seen` [N, V] bool marks the ids in each row's context, for the repetition penalty (`uses_context`); a
        drafter, whose distribution only has to be known, may leave it out. With extra processors, `history`
        [N, L] (each row's context, -1 padded) and `prompt_lens` [N] are needed instead."""
        scores = logits.float()
        if self.processors is not None:
            if history is None or prompt_lens is None:
                raise ValueError("`history` and `prompt_lens` are needed with extra logits processors.")
            return torch.log_softmax(self.processors(scores, history, prompt_lens), dim=-1)
        if self.uses_context and seen is not None:
            scores = apply_repetition_penalty(scores, seen, self.params.repetition_penalty)
        scores = self.warpers(None, scores)
        return torch.log_softmax(scores, dim=-1)

    @property
    def returns_raw(self) -> bool:
        """Whether `sample` also returns raw log-probs (`SamplingParams.raw_logprobs_temperature` is set)."""
        return self.raw_temperature is not None

    def sample(self, logprobs: torch.Tensor, keys: torch.Tensor, logits: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [N] and their log-probabilities from processed `logprobs` [N, V]: [N] processed log-probs, or, when
        `returns_raw`, [N, 2] (processed, raw), the raw one under `log_softmax(logits / raw_logprobs_temperature)`
        of the raw `logits` [N, V] (needed then).

        A row whose logits are not finite gets token `INVALID_TOKEN` (-1): its processed row is NaN in every column
        (`log_softmax` of a row holding NaN or +inf, or only -inf, is NaN throughout), so one column is checked.
        The flag travels with the tokens (no host sync here); whoever reads them back raises
        `NonFiniteLogitsError` (`Scheduler.postprocess`)."""
        tokens = logprobs.argmax(-1) if self.params.greedy else categorical(logprobs, keys)
        bad = logprobs[:, 0].isnan()  # [N]
        tokens = tokens.clamp_max(logprobs.shape[-1] - 1)  # a NaN row's draw may point past the vocabulary
        out = logprobs.gather(1, tokens[:, None])[:, 0]
        if self.raw_temperature is not None:
            if self._raw_is_processed:
                raw = out
            else:
                if logits is None:
                    raise ValueError("`logits` are needed to return raw log-probs (`raw_logprobs_temperature`).")
                raw = torch.log_softmax(logits.float() / self.raw_temperature, -1).gather(1, tokens[:, None])[:, 0]
            out = torch.stack([out, raw], 1)  # [N, 2]
        return torch.where(bad, INVALID_TOKEN, tokens), out
