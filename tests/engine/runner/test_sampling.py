"""Sampling is lossless: the engine's first two tokens follow the distribution `model.generate` samples from
(transformers' own logits processors), the returned log-probs are those of that distribution, and the counter-based
RNG is uniform, reproducible and independent of the sampling mode.

Statistical tests use Pearson's chi-square on the joint (first, second) token counts; bins with an expected count
below 5 are pooled into one. Tolerance: the test fails when the p-value is below ALPHA = 1e-3. The RNG is
deterministic, so the outcome is too (no flakes); a negative control shows the same test rejects a wrong
distribution.
"""

from __future__ import annotations

import pytest
import torch
from _models import frequent_token, tiny_model
from transformers import GenerationConfig

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.config.engine_config import SAMPLING_MODES
from trl_infinite.engine.runner.sampler import STREAM_SAMPLE, categorical, row_keys, uniform64, uniforms

ALPHA = 1e-3
NUM_SAMPLES = 12000  # samples of one prompt (the RNG is keyed by sample index, so they are independent draws)
PROMPT = [5, 17, 33, 8, 60]

CASES = {
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_k": dict(temperature=1.0, top_k=6),
    "top_k_top_p": dict(temperature=1.0, top_k=12, top_p=0.9),
    "min_p_rep_temp": dict(temperature=0.7, min_p=0.05, repetition_penalty=1.3),
}
# negative controls: a nearby setting each test must reject (measured p-values are all below 1e-190)
NEARBY = {
    "top_p": dict(temperature=1.0, top_p=0.85),
    "top_k": dict(temperature=1.0, top_k=7),
    "top_k_top_p": dict(temperature=1.0, top_k=12, top_p=0.95),
    "min_p_rep_temp": dict(temperature=0.8, min_p=0.05, repetition_penalty=1.3),
}


@pytest.fixture(scope="module")
def model():
    """A tiny Llama whose output distribution is peaked enough for top-p/min-p to cut (logit std ~2)."""
    m = tiny_model("llama")
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
    return m


@torch.no_grad()
def reference_logprobs(model, contexts: torch.Tensor, params: dict) -> torch.Tensor:
    """[N, L] contexts -> [N, V] log-probs of the next token as `model.generate(do_sample=True, **params)` samples."""
    cfg = GenerationConfig(do_sample=True, **{"top_k": 0, **params})
    processors = model._get_logits_processor(cfg, input_ids_seq_length=contexts.shape[1], device="cpu")
    scores = processors(contexts, model(contexts).logits[:, -1].float())
    return torch.log_softmax(scores, dim=-1)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed `counts` against `probs` (same shape, probs sum to 1)."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.double), stat / 2))


def joint_reference(model, params: dict) -> torch.Tensor:
    """[V, V] probability of (first, second) token: p1(a) * p2(b | a)."""
    p1 = reference_logprobs(model, torch.tensor([PROMPT]), params)[0].exp()
    support = torch.nonzero(p1 > 0)[:, 0]
    contexts = torch.cat([torch.tensor(PROMPT).expand(len(support), -1), support[:, None]], dim=1)
    joint = torch.zeros(p1.shape[0], p1.shape[0], dtype=torch.double)
    joint[support] = p1[support, None].double() * reference_logprobs(model, contexts, params).exp().double()
    return joint


def sample_pairs(model, params: dict, mode: str = "full_group") -> tuple[torch.Tensor, list[list[float]]]:
    engine = RolloutEngine(model, EngineConfig(sampling_mode=mode, max_active_sequences=None if mode in (
        "full_group", "dynamic_slot") else 4000, kv_cache_tokens=4 * (NUM_SAMPLES + 8), block_size=4))
    result = engine.generate([PROMPT], NUM_SAMPLES, SamplingParams(max_new_tokens=2, seed=1234, **params))
    return torch.tensor(result.completion_ids), result.logprobs


@pytest.mark.parametrize("name", list(CASES))
def test_first_two_tokens_follow_processed_distribution(model, name):
    params = CASES[name]
    joint = joint_reference(model, params)
    pairs, logprobs = sample_pairs(model, params)
    counts = torch.zeros_like(joint)
    counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs), dtype=torch.double), accumulate=True)
    assert counts[joint == 0].sum() == 0, "a token outside the processed support was sampled"
    assert (joint > 0).sum() < joint.numel() / 4  # the processors really truncate (36..170 of 9216 pairs remain)
    pvalue = chi_square_pvalue(counts, joint)
    assert pvalue > ALPHA, f"{name}: chi-square p={pvalue:.2e}"
    # negative controls: a slightly different setting and the unprocessed distribution are both rejected
    assert chi_square_pvalue(counts, joint_reference(model, NEARBY[name])) < ALPHA
    assert chi_square_pvalue(counts, joint_reference(model, {"temperature": 1.0})) < ALPHA
    # returned log-probs are those of the processed distribution the tokens were drawn from
    p1 = reference_logprobs(model, torch.tensor([PROMPT]), params)[0]
    first = torch.tensor([lp[0] for lp in logprobs[:200]])
    torch.testing.assert_close(first, p1[pairs[:200, 0]].float(), atol=1e-4, rtol=0)
    ctx = torch.cat([torch.tensor(PROMPT).expand(200, -1), pairs[:200, :1]], dim=1)
    second = reference_logprobs(model, ctx, params).gather(1, pairs[:200, 1:])[:, 0]
    torch.testing.assert_close(torch.tensor([lp[1] for lp in logprobs[:200]]), second, atol=1e-4, rtol=0)


def test_same_seed_same_output_in_every_mode():
    """The RNG is keyed by (seed, prompt, sample, position): batch composition and mode do not change samples."""
    model = tiny_model("qwen2")
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (n,), generator=gen).tolist() for n in (4, 7, 11)]
    eos = frequent_token(model, prompts)
    sampling = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95, top_k=20, repetition_penalty=1.1,
                              eos_token_ids=[eos], seed=7)
    outs = {}
    for mode in SAMPLING_MODES:
        engine = RolloutEngine(model, EngineConfig(sampling_mode=mode, max_active_sequences=3, kv_cache_tokens=256,
                                                   block_size=4))
        outs[mode] = engine.generate(prompts, 5, sampling)
    base = outs["full_group"]
    assert len({tuple(c) for c in base.completion_ids}) > 3, "samples of a prompt should differ"
    assert any(len(c) < 10 for c in base.completion_ids)  # some stop at EOS
    for mode, res in outs.items():
        assert res.completion_ids == base.completion_ids, mode
        for a, b in zip(res.logprobs, base.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    engine = RolloutEngine(model, EngineConfig(sampling_mode="fixed_slot", max_active_sequences=2,
                                               kv_cache_tokens=256, block_size=4))
    again = engine.generate(prompts, 5, sampling)
    assert again.completion_ids == base.completion_ids
    other = engine.generate(prompts, 5, SamplingParams(**{**sampling.__dict__, "seed": 8}))
    assert other.completion_ids != base.completion_ids


def _grid_keys(seed: int = 3, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    g, s, p = torch.meshgrid(torch.arange(16), torch.arange(16), torch.arange(16), indexing="ij")
    return row_keys(seed, g.flatten(), s.flatten(), p.flatten(), stream)  # [4096]


def test_row_keys_are_distinct_per_component():
    keys = _grid_keys()
    assert keys.unique().numel() == keys.numel()
    assert not torch.equal(keys, _grid_keys(seed=4))
    assert (keys != _grid_keys(stream=STREAM_SAMPLE + 1)).all()


def test_uniforms_are_uniform_and_pure():
    """4096 keys x 64 columns = 262144 draws. Tolerances: mean within 5 sigma (sigma = sqrt(1/12/M)), variance
    within 1e-3 of 1/12 (~6 sigma), Kolmogorov-Smirnov distance below 1.95/sqrt(M) (alpha = 0.001), and lag-1
    correlations (along columns and along positions) below 5/sqrt(M)."""
    keys = _grid_keys()
    u = uniforms(keys, 64).double()  # [4096, 64]
    m = u.numel()
    assert u.dtype == torch.double and (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / m) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 1e-3
    x = u.flatten().sort().values
    ecdf_hi = torch.arange(1, m + 1, dtype=torch.double) / m
    ks = torch.maximum(ecdf_hi - x, x - (ecdf_hi - 1 / m)).max().item()
    assert ks < 1.95 / m**0.5
    z = (u - 0.5) / (1 / 12) ** 0.5
    col_corr = (z[:, 1:] * z[:, :-1]).mean().item()
    pos = z.view(16, 16, 16, 64)
    pos_corr = (pos[:, :, 1:] * pos[:, :, :-1]).mean().item()  # neighbouring positions of one sample
    assert abs(col_corr) < 5 / m**0.5 and abs(pos_corr) < 5 / m**0.5
    # a pure function of (key, column): independent of the batch it is drawn in and of the width asked for
    perm = torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(0))
    assert torch.equal(uniforms(keys[perm], 64), uniforms(keys, 64)[perm])
    assert torch.equal(uniforms(keys, 10), uniforms(keys, 64)[:, :10])


def test_categorical_across_cdf_blocks():
    """The two-level inverse CDF over a 600-token vocabulary (three 256-token blocks, the last padded): mass on the
    first and last token of blocks, a block with no mass at all, zeros everywhere else. Chi-square, alpha 1e-3."""
    from trl_infinite.engine.runner.sampler import CDF_BLOCK

    assert CDF_BLOCK == 256
    probs = torch.zeros(600)
    support = torch.tensor([0, 255, 256, 300, 511, 599])
    probs[support] = torch.tensor([0.3, 0.1, 0.2, 0.15, 0.05, 0.2])
    probs[512:599] = 0.0
    n = 100000
    keys = row_keys(5, torch.zeros(n, dtype=torch.long), torch.arange(n), torch.zeros(n, dtype=torch.long))
    draws = categorical(probs.log().expand(n, -1), keys)
    counts = torch.bincount(draws, minlength=600)
    assert counts.sum() == n and counts[support].sum() == n  # never a zero-probability token
    assert chi_square_pvalue(counts[support], probs[support]) > ALPHA
    empty_block = torch.zeros(600)
    empty_block[[3, 590]] = 0.5  # block 1 (256..511) has no mass at all
    draws = categorical(empty_block.log().expand(2000, -1), keys[:2000])
    assert set(draws.tolist()) == {3, 590}


def test_uniform64_is_uniform():
    """One 53-bit uniform per key (the categorical draw): mean and variance within 5 sigma / 1e-3, KS alpha 0.001."""
    u = uniform64(_grid_keys())
    m = u.numel()
    assert (u >= 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / m) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 1e-3
    x = u.sort().values
    ecdf_hi = torch.arange(1, m + 1, dtype=torch.double) / m
    assert torch.maximum(ecdf_hi - x, x - (ecdf_hi - 1 / m)).max().item() < 1.95 / m**0.5


def test_categorical_is_an_exact_sampler():
    """Chi-square (alpha 1e-3) of 100000 draws from a fixed 6-way distribution with zero-probability entries first,
    inside and last (the inverse CDF must step over flat stretches)."""
    probs = torch.tensor([0.0, 0.5, 0.3, 0.0, 0.15, 0.05, 0.0])
    n = 100000
    keys = row_keys(11, torch.zeros(n, dtype=torch.long), torch.arange(n), torch.zeros(n, dtype=torch.long))
    draws = categorical(probs.log().expand(n, -1), keys)
    counts = torch.bincount(draws, minlength=7)
    assert counts[[0, 3, 6]].sum() == 0
    probs, counts = probs[[1, 2, 4, 5]], counts[[1, 2, 4, 5]]
    assert chi_square_pvalue(counts, probs) > ALPHA
    assert chi_square_pvalue(counts, torch.tensor([0.49, 0.31, 0.15, 0.05])) < ALPHA  # power: 1% shift


def test_repetition_penalty_matches_transformers_whatever_the_padding():
    """Rows of different history lengths (padded with -1), token id 0 included: equal to transformers' processor
    row by row, and independent of how much padding the batch adds (regression: padding used to race with id 0)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from trl_infinite.engine.runner.sampler import apply_repetition_penalty, seen_mask

    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    rows = [[0, 4], [3, 0, 7, 7, 1], [9]]
    for width in (5, 64):
        history = torch.full((3, width), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            history[i, : len(r)] = torch.tensor(r)
        got = apply_repetition_penalty(logits, seen_mask(history, 10), 1.3)
        for i, r in enumerate(rows):
            want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([r]), logits[i : i + 1].clone())[0]
            torch.testing.assert_close(got[i], want, atol=0, rtol=0)


def test_first_token_over_many_seeds(model):
    """One sample per call, 400 seeds: the first token follows the processed top-k distribution (chi-square,
    alpha 1e-3), so seeds (not only sample indices) give independent draws."""
    params = CASES["top_k"]
    engine = RolloutEngine(model, EngineConfig(sampling_mode="fixed_slot", max_active_sequences=1,
                                               kv_cache_tokens=64, block_size=4))
    firsts = [engine.generate([PROMPT], 1, SamplingParams(max_new_tokens=1, seed=s, **params)).completion_ids[0][0]
              for s in range(400)]
    p1 = reference_logprobs(model, torch.tensor([PROMPT]), params)[0].exp()
    counts = torch.bincount(torch.tensor(firsts), minlength=p1.shape[0])
    assert counts[p1 == 0].sum() == 0
    assert chi_square_pvalue(counts, p1) > ALPHA
