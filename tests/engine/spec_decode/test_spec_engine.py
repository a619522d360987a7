"""Speculative rollouts through `RolloutEngine`: greedy identity, exact sampled distribution, wrong drafters."""

import math

import pytest
import torch
from _models import reference_greedy
from scipy.stats import chi2

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.runner.sampler import Sampler
from trl_infinite.engine.spec_decode import Drafter, Proposal, register_drafter

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [3, 4, 5, 3, 4, 5, 3, 4, 30, 31]]
MAX_NEW = 32


class _ModelOracle(Drafter):
    """Test drafter, a deterministic function of the context through the target model itself: `pick` chooses each
    draft token from the target's raw next-token logits ('argmax' = often right, 'argmin' = always wrong for greedy).
    Samples with equal context lengths share one batched forward."""

    pick = "argmax"

    def __init__(self, config, context):
        super().__init__()
        self.model, self.ctx = context.draft_model, {}  # the target model itself, given as the draft model

    def _start(self, seq):
        self.ctx[seq.seq_id] = seq.group.prompt_ids + seq.output_ids

    def update(self, seq, tokens):
        self.ctx[seq.seq_id] = self.ctx[seq.seq_id] + list(tokens)

    def propose(self, seqs, ks):
        ctxs = [list(self.ctx[s.seq_id]) for s in seqs]
        for r in range(max(ks, default=0)):
            by_len = {}
            for i, k in enumerate(ks):
                if k > r:
                    by_len.setdefault(len(ctxs[i]), []).append(i)
            for rows in by_len.values():
                logits = self.model(torch.tensor([ctxs[i] for i in rows])).logits[:, -1]
                for i, t in zip(rows, getattr(logits, self.pick)(-1).tolist()):
                    ctxs[i].append(t)
        return [Proposal(c[len(self.ctx[s.seq_id]):]) for s, c in zip(seqs, ctxs)]


@register_drafter("test_oracle")
class _Oracle(_ModelOracle):
    pick = "argmax"


@register_drafter("test_always_wrong")
class _AlwaysWrong(_ModelOracle):
    pick = "argmin"


def _engine(model, method=None, draft=None, **kw):
    if method is not None and method.startswith("test_"):
        draft = model  # the test drafters draft with the target model itself
    cfg = EngineConfig(kv_cache_tokens=16384, speculative_method=method, speculative_draft_model=draft, **kw)
    return RolloutEngine(model, cfg)


@pytest.fixture(scope="module")
def greedy_base(model):
    """The plain engine's greedy rollout (2 samples per prompt) and `model.generate`'s greedy completions."""
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    return _engine(model).generate(PROMPTS, 2, sp), [reference_greedy(model, p, MAX_NEW, []) for p in PROMPTS]


@pytest.mark.parametrize("method", ["suffix", "ngram", "best_of_n", "draft_model", "test_oracle"])
def test_greedy_identical_to_plain_engine_and_generate(model, draft, greedy_base, method):
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    base, reference = greedy_base
    spec = _engine(model, method, draft if method == "draft_model" else None, speculative_num_tokens=4)
    out = spec.generate(PROMPTS, 2, sp)
    assert out.completion_ids == base.completion_ids
    for i in range(len(PROMPTS)):
        assert out.completion_ids[2 * i] == reference[i]
    for a, b in zip(out.logprobs, base.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
    s = out.stats
    assert s.verify_steps > 0 and s.draft_tokens > 0 and s.decode_steps <= base.stats.decode_steps
    assert 1.0 <= s.mean_acceptance_length <= 5.0
    assert (s.accepted_tokens > 0) == (s.mean_acceptance_length > 1.0)


def test_greedy_with_repetition_penalty_and_eos(model):
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.3, eos_token_ids=[17])
    base = _engine(model).generate(PROMPTS, 2, sp)
    out = _engine(model, "suffix").generate(PROMPTS, 2, sp)
    assert out.completion_ids == base.completion_ids and out.finish_reasons == base.finish_reasons


def _exact_triples(model, prompt, sampling):
    """Exact law of the first 3 completion tokens under the processed target distribution: {(t1,t2,t3): prob}."""
    sampler = Sampler(sampling)
    law = {(): 1.0}
    for _ in range(3):
        keys = list(law)
        logits = model(torch.tensor([prompt + list(k) for k in keys])).logits[:, -1]
        probs = sampler.process(logits).exp()
        support = [probs[i].nonzero()[:, 0].tolist() for i in range(len(keys))]
        law = {k + (t,): law[k] * probs[i, t].item() for i, k in enumerate(keys) for t in support[i]}
    return law


def _chi2_pvalue(samples, law):
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= set(law), "a sample outside the support of the processed distribution"
    big = [c for c in law if law[c] * n >= 5]
    obs = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    exp = [law[c] * n for c in big] + [n - sum(law[c] * n for c in big)]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return chi2.sf(stat, len(obs) - 1)


@pytest.mark.parametrize("method", ["test_oracle", "draft_model"])
def test_sampled_distribution_matches_target(model, draft, method):
    """T=1, top_k=6, top_p=0.9: 1500 samples of the first 3 tokens with speculation (point drafts that are often
    accepted, and a draft model with q != p) pass a chi-square goodness-of-fit test against the exact law at
    significance 0.001 (deterministic seeds, so not flaky); the plain engine passes the same test."""
    prompt, g = PROMPTS[0], 1500
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=6, top_p=0.9, seed=11)
    law = _exact_triples(model, prompt, sp)
    cfg = dict(max_active_sequences=g, speculative_num_tokens=2, speculative_adaptive=False)
    out = _engine(model, method, draft if method == "draft_model" else None, **cfg).generate([prompt], g, sp)
    base = _engine(model, max_active_sequences=g).generate([prompt], g, sp)
    s = out.stats
    assert 0 < s.accepted_tokens < s.draft_tokens  # both acceptance and rejection paths were exercised
    assert _chi2_pvalue([tuple(c[:3]) for c in out.completion_ids], law) > 1e-3
    assert _chi2_pvalue([tuple(c[:3]) for c in base.completion_ids], law) > 1e-3
    marginal = {}
    for (t1, t2, _), pr in law.items():
        marginal[(t1,)] = marginal.get((t1,), 0.0) + pr
        marginal[(t1, t2)] = marginal.get((t1, t2), 0.0) + pr
    for c, lp in zip(out.completion_ids[:100], out.logprobs[:100]):  # logprobs are those of the processed target p
        assert lp[1] == pytest.approx(math.log(marginal[tuple(c[:2])] / marginal[tuple(c[:1])]), abs=1e-4)


def test_greedy_history_drafts_identical_and_accepted(model, greedy_base):
    """The second visit of the same prompts drafts from the first visit's completions (history only): greedy
    output identical, and the repeated greedy text is accepted almost whole."""
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    base = greedy_base[0]
    eng = _engine(model, "suffix", speculative_num_tokens=4, speculative_adaptive=False,
                  speculative_suffix_sources="history")
    first = eng.generate(PROMPTS, 2, sp)  # no earlier visit yet: drafts from the prompt text only
    second = eng.generate(PROMPTS, 2, sp)
    assert first.completion_ids == second.completion_ids == base.completion_ids
    s = second.stats
    assert s.accepted_tokens >= 0.9 * s.draft_tokens > 0 and first.stats.accepted_tokens < 0.1 * s.accepted_tokens
    assert s.decode_steps < 0.5 * base.stats.decode_steps


def test_history_drafts_keep_the_sampled_distribution(model):
    """T=1, top_k=6, top_p=0.9: 1500 samples whose drafts come only from an earlier visit's 1500 completions pass
    the same chi-square goodness-of-fit test (significance 0.001, deterministic seeds) against the exact law."""
    prompt, g = PROMPTS[0], 1500
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=6, top_p=0.9, seed=11)
    law = _exact_triples(model, prompt, sp)
    eng = _engine(model, "suffix", max_active_sequences=g, speculative_num_tokens=2, speculative_adaptive=False,
                  speculative_suffix_sources="history")
    eng.generate([prompt], g, SamplingParams(max_new_tokens=4, temperature=1.0, top_k=6, top_p=0.9, seed=5))
    out = eng.generate([prompt], g, sp)
    s = out.stats
    assert 0 < s.accepted_tokens < s.draft_tokens  # both acceptance and rejection paths were exercised
    assert _chi2_pvalue([tuple(c[:3]) for c in out.completion_ids], law) > 1e-3


def test_always_wrong_drafter_is_correct_and_adaptive_not_slower(model, greedy_base):
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    base = greedy_base[0]
    fixed = _engine(model, "test_always_wrong", speculative_adaptive=False).generate(PROMPTS, 2, sp)
    adaptive = _engine(model, "test_always_wrong").generate(PROMPTS, 2, sp)
    for out in (fixed, adaptive):
        assert out.completion_ids == base.completion_ids
        assert out.stats.accepted_tokens == 0
    assert adaptive.stats.decode_steps <= base.stats.decode_steps
    assert adaptive.stats.draft_tokens < 0.25 * fixed.stats.draft_tokens  # it stopped drafting after a few misses
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=3)
    plain = _engine(model).generate(PROMPTS, 2, sampled)
    wrong = _engine(model, "test_always_wrong").generate(PROMPTS, 2, sampled)
    assert wrong.stats.decode_steps <= plain.stats.decode_steps
