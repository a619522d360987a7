"""The differential fuzzer's pieces: strategies over engine configurations, prompts and call sequences; the
references (`model.generate` for greedy, a canonical plain engine for sampling); the invariants.

Outputs are compared token for token. Two forwards that compute the same logits through different kernels (the
paged decode step against `generate`'s cache, a verification forward against a one-token step, batch buckets of
different sizes) agree to float32 rounding, not bit for bit, so a token may flip where the choice is a tie at that
rounding: an argmax between two logits within `TIE_TOLERANCE` of each other, or a draw that the sampler's own
inverse CDF (its uniform) gives either way from logits within rounding of the model's, a uniform at a CDF boundary or
a token at a top-k / top-p / min-p cut (`admissible_rows`, `is_tie`). At the first token where two outputs differ the
check recomputes the choice from the model's own full forward and accepts the rest of that sample only at such a tie;
anything else fails.

Under bf16 autocast (`Case.autocast`: TRL's `bf16=True` on float32 weights; the whole case, references included, in
one CPU autocast region) two paths round differently at bf16's precision: logits of equal inputs through other query
shapes (chunked prefill, a verification forward, other batch sizes) differ by about as much as the model's own bf16
forward differs from its float32 one. There the tolerances scale with that gap (`tolerance_for`), not with float32's
rounding.
"""

from __future__ import annotations

import random
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from unittest.mock import patch

import torch
from _fuzz_edges import COMPATIBLE_DRAFTS, REFUSED_DRAFTS, draft_variant, edge_generation_kwargs
from _models import tiny_model
from hypothesis import strategies as st

from trl_infinite.engine import EngineConfig, RolloutEngine, RolloutResult, SamplingParams
from trl_infinite.engine.config.logits import GenerationProcessors
from trl_infinite.engine.decode.cpu_graphs import emulate_cuda_graphs
from trl_infinite.engine.runner.autocast import uncached_casts
from trl_infinite.engine.runner.sampler import Sampler, categorical, row_keys, seen_mask, uniform64
from trl_infinite.engine.sched.block_manager import blocks_for
from trl_infinite.engine.spec_decode import decoupled
from trl_infinite.engine.spec_decode.plan import COUPLED, DECOUPLED, Plan
from trl_infinite.testing.rounding import autocast_logit_bound
from trl_infinite.testing.weight_routes import FAMILIES, ROUTES, SEEN, lora_model

TIE_TOLERANCE = 1e-5  # relative to the largest logit / the row's total mass
LOGPROB_TOLERANCE = 1e-3  # between log-probs of equal tokens, float32
VOCAB = 96
SCHEDULERS = ("fifo", "sjf", "lfs", "lrf", "lfs_max", "fptas", "infinite", "seer")
PREDICTORS = ("history", "prefix", "group", "none")
FALLBACKS = ("none", "siblings", "prefix", "siblings+prefix")
MODES = ("full_group", "micro_group", "fixed_slot", "dynamic_slot")


@dataclass
class Call:
    """One `generate` call: prompts, G, sampling settings; `fault_at`: the call is first interrupted by an exception
    from its `fault_at`-th decode step (then made again), None: not."""

    prompts: list[list[int]]
    num_generations: int
    sampling: SamplingParams
    fault_at: int | None = None
    change: tuple[str, int] | None = None  # (route, seed): the weights change before the call (`weight_changes`)


@dataclass
class Case:
    """An engine configuration (all but the pool size) and the calls made on one engine built with it.
    `plan_seed`: decoupled speculation's plans (Alg. 1, Alg. 2, the drain plan) drawn at random from this seed
    instead of from wall-clock timings (`scripted_plans`); None: the engine's own."""

    arch: str
    config: dict
    extra_blocks: int  # pool size = the smallest the calls accept + this
    calls: list[Call] = field(default_factory=list)
    plan_seed: int | None = None
    graphs: bool = False  # decode steps captured and replayed (the CPU capture emulation; the pool at fixed addresses)
    draft: str = "same"  # the draft model's variant (`DRAFT_VARIANTS`), for 'draft_model' / 'best_of_n'
    weights: str | None = None  # a family of `weight_routes.FAMILIES`: a fresh model whose weights change; None: not
    autocast: bool = False  # the whole case (engine, calls, weight changes, references) in one CPU bf16 autocast region

    def engine_config(self, draft_model=None) -> EngineConfig:
        bs = self.config["block_size"]
        lookahead = self.config["speculative_num_tokens"] if self.config.get("speculative_method") else 0
        need = max(blocks_for(len(p), bs) + blocks_for(c.sampling.max_new_tokens + lookahead, bs)
                   for c in self.calls for p in c.prompts)
        draft = draft_model if self.config.get("speculative_method") in ("draft_model", "best_of_n") else None
        return EngineConfig(kv_cache_tokens=(need + self.extra_blocks + 1) * bs,  # + the null block
                            speculative_draft_model=draft, **self.config)


# ---------------------------------------------------------------------------------------------------- strategies
@st.composite
def prompt_sets(draw) -> list[list[int]]:
    """1-4 prompts of 1-40 tokens, some sharing a prefix with an earlier one, some repeated whole."""
    tokens = st.integers(0, VOCAB - 1)
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["fresh", "fresh", "shared_prefix", "repeat"])) if prompts else "fresh"
        if kind == "fresh":
            prompts.append(draw(st.lists(tokens, min_size=1, max_size=40)))
        elif kind == "repeat":
            prompts.append(list(draw(st.sampled_from(prompts))))
        else:
            base = draw(st.sampled_from(prompts))
            cut = draw(st.integers(1, len(base)))
            prompts.append(base[:cut] + draw(st.lists(tokens, min_size=0, max_size=12)))
    return prompts


@st.composite
def sampling_params(draw, eos_pool: list[int]) -> SamplingParams:
    greedy = draw(st.booleans())
    eos = draw(st.lists(st.sampled_from(eos_pool), max_size=2, unique=True))
    kw = dict(max_new_tokens=draw(st.integers(1, 24)), eos_token_ids=eos, seed=draw(st.integers(0, 2**64 - 1)),
              repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
              raw_logprobs_temperature=draw(st.sampled_from([None, None, 1.0, 0.7])))
    if draw(st.integers(0, 7)) == 0:  # a key beyond the fast path: the eager decode path with `generate`'s processors
        kw["generation_kwargs"] = draw(edge_generation_kwargs(bool(eos), kw["max_new_tokens"]))
    if greedy:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=draw(st.sampled_from([0.7, 1.0, 1.3])),
                  top_k=draw(st.sampled_from([0, 0, 5, 20, 1, VOCAB, VOCAB + 50])),  # edges: 1, the vocabulary, above
                  top_p=draw(st.sampled_from([1.0, 1.0, 0.9])), min_p=draw(st.sampled_from([0.0, 0.0, 0.05])))
    return SamplingParams(**kw)


@st.composite
def engine_settings(draw, allow_compile: bool) -> dict:
    """Every `EngineConfig` choice that may not change the output (all of them but the model's weights)."""
    cfg = dict(
        sampling_mode=draw(st.sampled_from(MODES)),
        max_active_sequences=draw(st.integers(1, 8)),
        block_size=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        max_prefill_tokens=draw(st.sampled_from([1, 5, 16, 4096])),
        scheduler=draw(st.sampled_from(SCHEDULERS)),
        length_predictor=draw(st.sampled_from(PREDICTORS)),
        history_fallback=draw(st.sampled_from(FALLBACKS)),
        prefix_predictor_k=draw(st.integers(1, 4)),
        prefix_predictor_min_train=draw(st.sampled_from([2, 8])),
        batch_policy=draw(st.sampled_from(["static", "static", "memory", "sla"])),
        chunk_tokens=draw(st.one_of(st.none(), st.integers(1, 8))),
        cpu_decode_kernel=draw(st.booleans()),
        kv_cache_release=draw(st.booleans()),
        prefix_cache=draw(st.booleans()),
        history_max_prompts=draw(st.sampled_from([0, 2, 4096])),
        history_max_visits=draw(st.integers(1, 3)),
        history_max_tokens=draw(st.sampled_from([0, 50, 2_000_000])),
        compile=allow_compile and draw(st.integers(0, 19)) == 0,  # slow on CPU: one case in twenty
    )
    if cfg["compile"]:  # Dynamo's capture and the guard-free dispatch with either backend; inductor's codegen too
        cfg["compile_backend"] = draw(st.sampled_from(["eager", "inductor"]))
    if cfg["batch_policy"] == "sla":  # decided from wall-clock step times: any outcome must give the same tokens
        cfg.update(sla_decode_ms=draw(st.sampled_from([0.01, 5.0, 1000.0])), sla_window=draw(st.integers(1, 4)))
    if cfg["batch_policy"] == "memory":
        cfg["memory_min_observations"] = draw(st.integers(1, 4))
    method = draw(st.sampled_from([None, None, "suffix", "ngram", "best_of_n", "draft_model"]))
    cfg.update(speculative_method=method, speculative_num_tokens=draw(st.integers(1, 5)))
    if method is not None:
        cfg.update(speculative_adaptive=draw(st.booleans()),
                   speculative_suffix_sources=draw(st.sampled_from(["siblings+history", "siblings", "history"])),
                   speculative_suffix_min_confidence=draw(st.sampled_from([0.0, 0.1])),
                   speculative_ngram_min_n=1, speculative_ngram_max_n=draw(st.integers(1, 4)),
                   speculative_best_of_n_tail_batch=draw(st.sampled_from([0, 4, 64])),
                   speculative_decoupled=draw(st.booleans()))
        if cfg["speculative_decoupled"]:  # the window: planned from wall-clock timings (any outcome), or fixed
            cfg.update(speculative_draft_window=draw(st.sampled_from([None, 1, cfg["speculative_num_tokens"]])),
                       speculative_reconfigure_every=draw(st.sampled_from([0, 1, 16])))
    return cfg


@st.composite
def cases(draw, eos_pool: list[int], allow_compile: bool = False) -> Case:
    case = Case(arch=draw(st.sampled_from(["qwen3", "llama"])), config=draw(engine_settings(allow_compile)),
                extra_blocks=draw(st.sampled_from([0, 0, 1, 3, 8, 64])), graphs=draw(st.integers(0, 5)) == 0)
    if case.config.get("speculative_method") in ("draft_model", "best_of_n"):
        case.draft = draw(st.sampled_from(["same", "same", *COMPATIBLE_DRAFTS]))
    if case.config.get("speculative_decoupled") and case.config.get("speculative_draft_window") is None:
        case.plan_seed = draw(st.one_of(st.none(), st.integers(0, 2**32 - 1)))
    for _ in range(draw(st.integers(1, 3))):  # several calls on one engine: history, predictors, pool reuse
        fault = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(1, 6)))
        case.calls.append(Call(draw(prompt_sets()), draw(st.integers(1, 6)), draw(sampling_params(eos_pool)), fault))
    draw(weight_changes(case, eos_pool))
    if draw(st.integers(0, 5)) == 0:  # TRL's bf16=True on float32 weights; the rollout copy of the weights or not
        case.autocast = True
        case.config["weight_copy"] = draw(st.sampled_from(["auto", "auto", "off"]))
    return case


# ---------------------------------------------------------------------------------------------------- tolerances
@dataclass(frozen=True)
class Tolerance:
    """How far two computations of the same tokens may differ. float32 (the default): log-probs of equal tokens by
    `LOGPROB_TOLERANCE`, a tie within `TIE_TOLERANCE` relative. Under bf16 autocast: `bf16`, in logit units
    (`tolerance_for`, `testing/rounding.py`), over the temperature for log-probs."""

    bf16: float | None = None

    def logprob(self, temperature: float) -> float:
        return LOGPROB_TOLERANCE if self.bf16 is None else max(LOGPROB_TOLERANCE, self.bf16 / temperature)


def tolerance_for(model, call: Call, ref_ids: list[list[int]]) -> Tolerance:
    """float32's, or under CPU autocast the bf16 bound (`testing.rounding.autocast_logit_bound`) over the call's prompts
    and reference completions (the model's own full forward in the region and without autocast), scaled by the
    repetition penalty (which multiplies negative logits)."""
    if not torch.is_autocast_enabled("cpu"):
        return Tolerance()
    g = call.num_generations
    sequences = {tuple(call.prompts[i // g] + list(ids)) for i, ids in enumerate(ref_ids)}
    return Tolerance(autocast_logit_bound(model, sequences, call.sampling.repetition_penalty))


def _temperatures(sampling: SamplingParams) -> tuple[float, float | None]:
    """The temperature of the processed log-probs (1 for greedy) and of the raw ones (None: not returned)."""
    return (sampling.temperature if not sampling.greedy else 1.0), sampling.raw_logprobs_temperature


# ---------------------------------------------------------------------------------------------------- references
def greedy_reference(model, prompt: list[int], sampling: SamplingParams) -> list[int]:
    """`model.generate(do_sample=False)` with the same repetition penalty, cut after the first EOS (kept)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sampling.max_new_tokens,
                         do_sample=False, repetition_penalty=sampling.repetition_penalty,
                         eos_token_id=sampling.eos_token_ids or None, pad_token_id=0,
                         **sampling.generation_kwargs)[0, len(prompt):].tolist()
    for i, t in enumerate(out):
        if t in sampling.eos_token_ids:
            return out[: i + 1]
    return out


def canonical_engine(model) -> RolloutEngine:
    """The sampled reference: every sample at once, a pool that never preempts, no chunks, no speculation."""
    return RolloutEngine(model, EngineConfig(sampling_mode="full_group", kv_cache_tokens=1 << 15, block_size=16,
                                             scheduler="fifo", history_max_prompts=0))


def _model_logits(model, context: list[int]) -> torch.Tensor:
    """[1, V] float32 logits of the next token after `context`, from the model's own full forward."""
    with torch.no_grad():
        return model(torch.tensor([context]), use_cache=False).logits[0, -1:].float()


def _process(model, logits: torch.Tensor, context: list[int], prompt_len: int, sampling: SamplingParams
             ) -> torch.Tensor:
    """[N, V] raw logits after `context` -> [N, V] processed log-probs (the sampler's, `generate`'s processors too)."""
    history = torch.tensor([context]).expand(len(logits), -1)
    if sampling.generation_kwargs:
        sampler = Sampler(sampling, GenerationProcessors(model, sampling, logits.device))
        if sampler.has_extra_processors:
            return sampler.process(logits, None, history, [prompt_len] * len(logits))
    return Sampler(sampling).process(logits, seen_mask(history, logits.shape[-1]))


def _logit_bound(logits: torch.Tensor, tol: Tolerance) -> float:
    """How far (in logit units) the same logits may lie from another path's: float32 rounding, or `tol.bf16`."""
    return TIE_TOLERANCE * max(1.0, logits.abs().max().item()) if tol.bf16 is None else tol.bf16


def admissible_rows(model, context: list[int], prompt_len: int, sampling: SamplingParams,
                    tol: Tolerance) -> torch.Tensor:
    """[1 + 4V + 30, V] processed log-probs after `context`: the model's own row, then rows of logits moved by at most the
    rounding bound, at the extremes that decide a draw. Top-k, top-p and min-p cut the distribution where the logits
    rank and where the sorted mass reaches a level, and the inverse-CDF draw where the mass in vocabulary order
    reaches the uniform; a path whose logits lie within rounding of the model's may cut or draw elsewhere, which also
    renormalizes every other token's probability. The rows: each token raised and lowered alone (its rank), and the
    first m tokens in rank order, then in vocabulary order, raised with the rest lowered and the reverse (the mass
    before a cut or a draw at its largest and smallest), and the logits on grids (ties). Each is a row some path
    within rounding may have seen."""
    logits = _model_logits(model, context)
    vocab, delta = logits.shape[-1], _logit_bound(logits, tol)
    eye = torch.eye(vocab)
    first = torch.tril(torch.ones(vocab, vocab))  # row m: the first m + 1 tokens
    by_rank = torch.zeros(vocab, vocab)
    by_rank[:, logits[0].argsort(descending=True)] = first
    split = 2 * torch.cat([by_rank, first]) - 1  # +1 on the first m + 1, -1 on the rest
    bumps = delta * torch.cat([torch.zeros(1, vocab), eye, -eye, split, -split])
    # logits rounded to a grid (each moves by at most half a step): close logits become equal, as a 16-bit output's
    # do, and top-k keeps every token tied with its k-th
    grids = [torch.round((logits - off) / q) * q + off - logits
             for q in (delta * 2.0**-j for j in range(-1, 9)) for off in (0.0, q / 3, 2 * q / 3)]
    return _process(model, logits + torch.cat([bumps, *grids]), context, prompt_len, sampling).double()


def _uncut(sampling: SamplingParams) -> bool:
    """No top-k / top-p / min-p cut and no extra processor: each token's processed log-prob is a continuous function
    of the logits."""
    return sampling.top_k == 0 and sampling.top_p == 1.0 and sampling.min_p == 0.0 and not sampling.generation_kwargs


def _drawn_somewhere(model, context: list[int], prompt_len: int, sampling: SamplingParams, tol: Tolerance,
                     token: int, u: float) -> bool:
    """Whether the inverse-CDF draw at uniform `u` gives `token` from some logits within the bound of the model's
    (`sampling` `_uncut`). The draw gives `token` where CDF(token - 1) <= u < CDF(token). Over the bound's box of
    logits the least CDF(token - 1) is at the tokens before it lowered and the rest raised, the most CDF(token) at the
    tokens up to it raised and the rest lowered; along the segment between the two (inside the box) both ends of the
    token's interval move continuously and the interval is never empty, so every `u` from that least to that most is
    drawn as `token` at some point of it. The extreme rows alone (`admissible_rows`) draw a rare token only where `u`
    falls in its own narrow interval there, so a path whose logits lie between them could draw it unseen."""
    logits = _model_logits(model, context)
    delta, ids = _logit_bound(logits, tol), torch.arange(logits.shape[-1])
    low = logits + delta * torch.where(ids < token, -1.0, 1.0)
    high = logits + delta * torch.where(ids <= token, 1.0, -1.0)
    probs = _process(model, torch.cat([low, high]), context, prompt_len, sampling).double().exp()
    probs = probs / probs.sum(-1, keepdim=True)
    return probs[0, :token].sum().item() <= u < probs[1, : token + 1].sum().item()


def is_tie(model, prompt: list[int], done: list[int], a: int, b: int, sampling: SamplingParams, group: int,
           sample: int, tol: Tolerance = Tolerance()) -> bool:
    """Whether tokens `a` and `b` are both the right choice after `prompt + done` up to rounding (float32, or under
    autocast `tol.bf16`): an argmax between logits within rounding, or the sampler's own draw (its uniform) giving `a`
    from one admissible row and `b` from another (`admissible_rows`: a uniform at a CDF boundary, a token at a cut),
    or, without a cut, from logits between the rows (`_drawn_somewhere`)."""
    rows = admissible_rows(model, prompt + done, len(prompt), sampling, tol)
    row = rows[0]
    if sampling.greedy:
        bound = TIE_TOLERANCE * max(1.0, row.abs().max().item()) if tol.bf16 is None else tol.bf16
        return abs(row[a] - row[b]).item() <= bound
    key = row_keys(sampling.seed, torch.tensor([group]), torch.tensor([sample]),
                   torch.tensor([len(prompt) + len(done)]))
    choices = set(categorical(rows.float(), key.expand(len(rows))).tolist())  # the sampler's own draw, each row
    if a in choices and b in choices:
        return True
    if _uncut(sampling) and all(_drawn_somewhere(model, prompt + done, len(prompt), sampling, tol, token,
                                                 uniform64(key).item()) for token in (a, b)):
        return True
    # a cut and a draw both moved: each support, with the draw's extremes on the untruncated rows
    uncut, supports = _supports(model, prompt + done, len(prompt), sampling, tol, rows)
    for support in supports:
        masked = uncut.masked_fill(~support, -torch.inf)
        choices |= set(categorical(masked.float(), key.expand(len(masked))).tolist())
    return a in choices and b in choices


def _supports(model, context: list[int], prompt_len: int, sampling: SamplingParams, tol: Tolerance,
              rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The admissible rows without the cuts, and the supports a cut may keep: those of the admissible `rows`, and
    every prefix of the ranking between their sizes (a cut keeps a prefix; the extremes may skip one)."""
    uncut = admissible_rows(model, context, prompt_len, replace(sampling, top_k=0, top_p=1.0, min_p=0.0), tol)
    seen = torch.unique(rows > -torch.inf, dim=0)
    sizes = seen.sum(-1)
    prefixes = torch.zeros(int(sizes.max() - sizes.min()) + 1, rows.shape[-1], dtype=torch.bool)
    order = uncut[0].argsort(descending=True)
    for i, n in enumerate(range(int(sizes.min()), int(sizes.max()) + 1)):
        prefixes[i, order[:n]] = True
    return uncut, torch.cat([seen, prefixes])


def equal_up_to_the_cut(model, prompt: list[int], done: list[int], token: int, got: float, ref: float,
                        sampling: SamplingParams, tol: Tolerance) -> bool:
    """Two processed log-probs of the same `token` after `prompt + done` that differ beyond rounding: each is that
    token's log-prob in some admissible row or under some support a cut may keep (`_supports`: a token at a top-k /
    top-p / min-p cut in on one path, out on the other)."""
    rows = admissible_rows(model, prompt + done, len(prompt), sampling, tol)
    uncut, supports = _supports(model, prompt + done, len(prompt), sampling, tol, rows)
    kept = torch.log_softmax(uncut[:1].masked_fill(~supports, -torch.inf), dim=-1)  # the model's row, each support
    values = torch.cat([rows[:, token], kept[:, token]])
    bound = tol.logprob(sampling.temperature if not sampling.greedy else 1.0)
    return all(bool(((values - x).abs() <= bound).any()) for x in (got, ref))


# ---------------------------------------------------------------------------------------------------- invariants
def check_completions_end_properly(result: RolloutResult, sampling: SamplingParams) -> None:
    """Every sample runs to its first EOS (kept, nothing after it) or to exactly `max_new_tokens`."""
    eos = set(sampling.eos_token_ids)
    for i, (ids, reason) in enumerate(zip(result.completion_ids, result.finish_reasons)):
        assert 1 <= len(ids) <= sampling.max_new_tokens, (i, ids)
        assert not eos.intersection(ids[:-1]), f"row {i} continues after an EOS: {ids}"
        if ids[-1] in eos:
            assert reason == "stop", (i, reason)
        else:
            assert len(ids) == sampling.max_new_tokens and reason == "length", (i, ids, reason)


def check_same_tokens(model, call: Call, got: RolloutResult, ref: RolloutResult | list[list[int]]) -> None:
    """`got` equals `ref` (a canonical result, or greedy token lists) row by row, except after a first difference that
    is a tie (module docstring); where the tokens are equal, so are the log-probs (raw ones too) up to rounding."""
    g = call.num_generations
    ref_ids = ref.completion_ids if isinstance(ref, RolloutResult) else ref
    tol = tolerance_for(model, call, ref_ids)
    assert (got.raw_logprobs is not None) == (call.sampling.raw_logprobs_temperature is not None)
    for row, (a, b) in enumerate(zip(got.completion_ids, ref_ids)):
        if a == b:
            if isinstance(ref, RolloutResult):
                t, t_raw = _temperatures(call.sampling)
                pairs = [(got.logprobs, ref.logprobs, t)] + ([(got.raw_logprobs, ref.raw_logprobs, t_raw)]
                                                             if got.raw_logprobs is not None else [])
                prompt = call.prompts[row // g]
                for i, (x, y, temperature) in enumerate(pairs):
                    assert len(x[row]) == len(a), row
                    for k, (u, v) in enumerate(zip(x[row], y[row])):
                        # a processed (not raw) log-prob may differ by a token at the cut's mass
                        assert abs(u - v) < tol.logprob(temperature) or (
                            i == 0 and equal_up_to_the_cut(model, prompt, a[:k], a[k], u, v, call.sampling, tol)
                        ), f"row {row}: log-probs of equal tokens at {k}: {u:.6g} vs {v:.6g}"
            continue
        k = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), None)
        assert k is not None, f"row {row}: one output is a prefix of the other: {a} vs {b}"
        prompt = call.prompts[row // g]
        tie = is_tie(model, prompt, b[:k], a[k], b[k], call.sampling, row // g, row % g, tol)
        assert tie, f"row {row} differs at token {k} without a tie: got {a}, expected {b}"


def check_call(model, engine: RolloutEngine, call: Call, result: RolloutResult, reference) -> None:
    check_completions_end_properly(result, call.sampling)
    s = result.stats
    assert s.peak_kv_blocks <= s.num_kv_blocks <= engine.pool.budget_blocks()  # the call's pool, within the budget
    assert engine.pool.allocator.num_used == 0  # nothing held after the call
    assert (engine.pool.allocated_bytes == 0) == engine.config.kv_cache.release  # released, or kept on request
    assert len(result.completion_ids) == len(call.prompts) * call.num_generations
    check_same_tokens(model, call, result, reference)


# ---------------------------------------------------------------------------------------------------- running
class World:
    """Models, draft model and references shared by every example (references cached per input)."""

    def __init__(self):
        self.models = {arch: tiny_model(arch) for arch in ("qwen3", "llama")}
        self.draft = tiny_model("llama", seed=3)
        self.canonical = {arch: canonical_engine(m) for arch, m in self.models.items()}
        self._greedy: dict = {}
        self._sampled: dict = {}
        # EOS candidates: tokens the models emit often (samples then end at varied lengths), and rare ones
        counts: dict[int, int] = {}
        for m in self.models.values():
            out = m.generate(torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                             max_new_tokens=24, do_sample=True, top_k=8, num_return_sequences=4, pad_token_id=0)
            for t in out[:, 4:].flatten().tolist():
                counts[t] = counts.get(t, 0) + 1
        self.eos_pool = sorted(counts, key=counts.get, reverse=True)[:4] + [0, 95]

    def reference(self, arch: str, call) -> list[list[int]]:
        model, sp = self.models[arch], call.sampling
        if sp.greedy:
            out = []
            for p in call.prompts:
                key = (arch, tuple(p), sp.max_new_tokens, tuple(sp.eos_token_ids), sp.repetition_penalty,
                       repr(sorted(sp.generation_kwargs.items())))
                if key not in self._greedy:
                    self._greedy[key] = greedy_reference(model, p, sp)
                out.extend([self._greedy[key]] * call.num_generations)
            return out
        key = (arch, tuple(map(tuple, call.prompts)), call.num_generations, repr(sp))
        if key not in self._sampled:
            self._sampled[key] = self.canonical[arch].generate(call.prompts, call.num_generations, sp)
        return self._sampled[key]


_WORLD: list[World] = []


def world() -> World:
    if not _WORLD:
        _WORLD.append(World())
    return _WORLD[0]


@contextmanager
def scripted_plans(seed: int | None):
    """Decoupled speculation's plans drawn at random (`seed`): every plan (Alg. 1's, each drain plan) a random mode
    and window, and a random subset of the rows their own (Alg. 2's reconfiguration, the drain plan's per-row
    windows). The plans decide drafts only, so any sequence of them must give the same tokens; the timings-driven
    plans of a tiny model on a shared CPU reach few of these sequences (a plan of no speculation followed by one
    that drafts, in a call that drains, wrote drafts past the reserved KV slots)."""
    if seed is None:
        yield
        return
    rng = random.Random(seed)

    def one(w_max: int) -> Plan:
        return Plan(rng.choice([COUPLED, DECOUPLED]), rng.choice([0, 0, rng.randint(1, w_max)]), 1.0)

    def some_rows(keys, w_max: int) -> dict:
        return {k: one(w_max) for k in keys if rng.random() < 0.5}

    def drain_rows(times, rows, w_max):
        base = one(w_max)  # the drain plan: every row its own window up to the batch plan's, in its mode
        return base, {k: Plan(base.mode, rng.randint(0, base.window), 1.0) for k in rows}

    with patch.object(decoupled, "plan", lambda times, p, b, w_max: one(w_max)), \
            patch.object(decoupled, "reconfigure", lambda times, base, acc, w_max, b: some_rows(acc, w_max)), \
            patch.object(decoupled, "drain_rows", drain_rows):
        yield


def run_case(case, model=None) -> None:
    """Build the engine of `case`, make its calls, check every invariant after each. `model`: the model to run
    instead of the world's (a fresh `tiny_model(case.arch)` has the same weights, so the same references). A case
    under autocast runs whole in one CPU bf16 region, on a fresh model with its own references (`WeightChanges`)."""
    if case.autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _run_case(case, model, fresh=True)
    else:
        _run_case(case, model)


def _run_case(case, model=None, fresh: bool = False) -> None:
    w = world()
    changing = WeightChanges(case) if case.weights is not None or fresh else None
    model = changing.model if changing is not None else w.models[case.arch] if model is None else model
    config = case.engine_config(w.draft if case.draft == "same" else draft_variant(case.draft, model))
    with emulate_cuda_graphs() if case.graphs else nullcontext():
        engine = RolloutEngine(model, config)
    for call in case.calls:
        if changing is not None:
            changing.apply(engine, call)
        with scripted_plans(case.plan_seed):
            if call.fault_at is not None:
                interrupted(model, engine, call)
            result = engine.generate(call.prompts, call.num_generations, call.sampling)
        # the references' and checks' forwards cast the weights as they are now: in a region that spans an in-place
        # update, autocast's cast cache would serve the casts of the old weights (the engine's own forwards too, which
        # is why they run with the cache off; a user's region, accelerate's, wraps one forward)
        with uncached_casts("cpu"):
            reference = changing.reference(call) if changing is not None else w.reference(case.arch, call)
            check_call(model, engine, call, result, reference)


class _Fault(Exception):
    pass


def interrupted(model, engine: RolloutEngine, call: Call) -> None:
    """The call, interrupted by an exception from its `fault_at`-th decode step: the exception reaches the caller,
    and the engine holds nothing afterwards, with the model as it was."""
    state = (model.training, model.config._attn_implementation)
    steps = []

    def fault(batch, seconds):
        steps.append(1)
        if len(steps) == call.fault_at:
            raise _Fault

    try:
        engine.generate(call.prompts, call.num_generations, call.sampling, on_decode_step=fault)
    except _Fault:
        pass
    assert engine.pool.allocator.num_used == 0
    assert (engine.pool.allocated_bytes == 0) == engine.config.kv_cache.release
    assert engine.predictor.predictions == {}
    assert (model.training, model.config._attn_implementation) == state


# ---------------------------------------------------------------------------------- issue 40: mismatched drafts
@st.composite
def draft_cases(draw) -> tuple[str, str, dict, Call]:
    """(target arch, draft variant, speculative settings, one call)."""
    spec = dict(speculative_method=draw(st.sampled_from(["draft_model", "best_of_n"])),
                speculative_num_tokens=draw(st.integers(1, 4)), speculative_adaptive=draw(st.booleans()),
                speculative_decoupled=draw(st.booleans()))
    if spec["speculative_decoupled"]:
        spec["speculative_draft_window"] = draw(st.integers(1, spec["speculative_num_tokens"]))
    sampling = SamplingParams(max_new_tokens=draw(st.integers(4, 16)), temperature=draw(st.sampled_from([0.0, 1.0])),
                              seed=draw(st.integers(0, 2**32)))
    call = Call(draw(prompt_sets()), draw(st.integers(1, 3)), sampling)
    return (draw(st.sampled_from(["qwen3", "llama"])), draw(st.sampled_from([*COMPATIBLE_DRAFTS, *REFUSED_DRAFTS])),
            spec, call)


def run_draft_case(arch: str, variant: str, spec: dict, call: Call) -> None:
    """Refused at build time naming `speculative_draft_model`, or every token the reference's."""
    w = world()
    model = w.models[arch]
    draft = draft_variant(variant, model)
    try:
        engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=4096, speculative_draft_model=draft, **spec))
    except ValueError as e:
        assert "speculative_draft_model" in str(e), str(e)
        assert variant in REFUSED_DRAFTS, f"compatible draft {variant} refused: {e}"
        return
    assert model.config is not draft.config
    result = engine.generate(call.prompts, call.num_generations, call.sampling)
    check_call(model, engine, call, result, w.reference(arch, call))
    model(torch.tensor([[1, 2, 3]]))  # the target's own attention is its own again


# ---------------------------------------------------------------------------------------------------- weight changes
@st.composite
def weight_changes(draw, case: Case, eos_pool: list[int]) -> None:
    """Cross-call reuse declared or not (`kv_cache_reuse_across_calls`; the world's weights never change, so any
    case may declare it) and, in one case in four, weight changes between its calls by the routes of one family of
    `weight_routes` (optimizer steps fused or not, `p.data.copy_`, `torch._foreach_add_`, inference tensors copied
    into or loaded, LoRA adapters disabled or switched) or the explicit `reset_prefix_cache()` alone, on a fresh
    model: the references are recomputed on the changed weights (`WeightChanges`)."""
    case.config["kv_cache_reuse_across_calls"] = draw(st.booleans())
    if draw(st.integers(0, 3)) != 0:
        return
    case.weights = draw(st.sampled_from(sorted(FAMILIES)))
    # mostly a kept pool with its cache, and calls repeating the first one's prompts: a stale entry would be hit
    case.config.update(kv_cache_release=draw(st.sampled_from([False, False, True])),
                       prefix_cache=draw(st.sampled_from([True, True, False])))
    if len(case.calls) < 2:
        case.calls.append(Call(draw(prompt_sets()), draw(st.integers(1, 6)), draw(sampling_params(eos_pool))))
    routes = [*FAMILIES[case.weights], "reset"]
    for call in case.calls[1:]:
        if draw(st.integers(0, 3)) != 0:
            call.prompts = [list(p) for p in case.calls[0].prompts]
        if draw(st.integers(0, 3)) != 0:
            call.change = (draw(st.sampled_from(routes)), draw(st.integers(0, 2**16)))
    # a header shared by every prompt of every call, over a block: the next call finds it in a kept cache
    bs = case.config["block_size"]
    header = draw(st.lists(st.integers(0, VOCAB - 1), min_size=bs + 1, max_size=2 * bs + 4))
    for call in case.calls:
        call.prompts = [header + p for p in call.prompts]


class WeightChanges:
    """A fresh model for a case whose weights change (`Case.weights`), the changes between its calls, and references
    on the weights as they are at each call (greedy: `generate`; sampled: a plain engine on this model, which keeps
    nothing across calls)."""

    def __init__(self, case: Case):
        model = tiny_model(case.arch)
        self.model = lora_model(model) if case.weights == "lora" else model
        self.reuse = case.config.get("kv_cache_reuse_across_calls", False)
        self._canonical: RolloutEngine | None = None

    def apply(self, engine: RolloutEngine, call: Call) -> None:
        """The call's change; where reuse is declared, reported as the contract asks (`reset_prefix_cache()` after
        a route the fingerprint cannot see; "reset": the call alone)."""
        if call.change is None:
            return
        route, seed = call.change
        if route != "reset":
            ROUTES[route](self.model, seed)
        if route == "reset" or (self.reuse and not SEEN[route]):
            engine.reset_prefix_cache()

    def reference(self, call: Call):
        if call.sampling.greedy:
            refs = [greedy_reference(self.model, p, call.sampling) for p in call.prompts]
            return [r for r in refs for _ in range(call.num_generations)]
        if self._canonical is None:
            self._canonical = canonical_engine(self.model)
        return self._canonical.generate(call.prompts, call.num_generations, call.sampling)
