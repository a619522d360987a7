"""Greedy decoding through the engine is token-identical to `model.generate(do_sample=False)` in every sampling mode,
and the returned log-probabilities are those of the model's own logits."""

from __future__ import annotations

import pytest
import torch
from _models import ARCHS, frequent_token, reference_greedy, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.config.engine_config import SAMPLING_MODES

G = 4
MAX_NEW = 12
BLOCK = 4
MAX_PREFILL = 12  # the 17-token prompt is prefilled in two chunks
PROMPT_LENS = (3, 8, 9, 17)  # 8 is a multiple of the block size, the others are not


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 96, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    """(model, prompts, eos, references) per architecture; eos is a token greedy decoding emits often."""
    model = tiny_model(request.param)
    prompts = _prompts()
    eos = frequent_token(model, prompts)
    refs = [reference_greedy(model, p, MAX_NEW, [eos]) for p in prompts]
    return model, prompts, eos, refs


def _engine(model, mode: str, **kw) -> RolloutEngine:
    cfg = dict(sampling_mode=mode, max_active_sequences=3, kv_cache_tokens=512, block_size=BLOCK,
               max_prefill_tokens=MAX_PREFILL)
    return RolloutEngine(model, EngineConfig(**{**cfg, **kw}))


def _greedy(eos: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[eos])


def test_references_cover_early_eos_and_length_limit(case):
    """The case is meaningful: some prompts stop at EOS before MAX_NEW, some run to the length limit."""
    _, _, eos, refs = case
    assert any(len(r) < MAX_NEW and r[-1] == eos for r in refs)
    assert any(len(r) == MAX_NEW for r in refs)


@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_greedy_matches_generate(case, mode):
    model, prompts, eos, refs = case
    result = _engine(model, mode).generate(prompts, num_generations=G, sampling=_greedy(eos))
    assert len(result.completion_ids) == len(prompts) * G
    for i, ref in enumerate(refs):
        for j in range(G):
            assert result.completion_ids[i * G + j] == ref, f"prompt {i} sample {j}"
            want = "stop" if ref[-1] == eos else "length"
            assert result.finish_reasons[i * G + j] == want
    assert [len(lp) for lp in result.logprobs] == [len(c) for c in result.completion_ids]
    s = result.stats
    assert s.generated_tokens == sum(len(c) for c in result.completion_ids)
    assert s.preemptions == 0 and s.prompt_evictions == 0
    # each prompt is prefilled once, not once per sample
    assert s.prefill_tokens == sum(PROMPT_LENS)
    assert s.decode_steps > 0 and s.peak_kv_blocks <= s.num_kv_blocks
    assert s.peak_memory_bytes == 0  # CPU


@pytest.mark.parametrize("mode", ["fixed_slot", "full_group"])
def test_greedy_logprobs_are_model_log_softmax(case, mode):
    """Greedy log-probs equal log_softmax of a plain (non-paged) forward of the model at the chosen tokens."""
    model, prompts, eos, _ = case
    result = _engine(model, mode).generate(prompts, num_generations=G, sampling=_greedy(eos))
    for i, prompt in enumerate(prompts):
        comp = result.completion_ids[i * G]
        logits = model(torch.tensor([prompt + comp])).logits[0].float()  # [P + C, V]
        ref_lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # rows predicting each completion token
        ref = ref_lp.gather(1, torch.tensor(comp)[:, None])[:, 0]
        for j in range(G):
            got = torch.tensor(result.logprobs[i * G + j])
            assert got.shape == (len(comp),)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        # greedy picked the argmax of the model's distribution
        assert ref_lp.argmax(-1).tolist() == comp


def test_engine_is_reusable_and_frees_every_block(case):
    """Two calls on one engine give the same output; after a call no KV block is still in use."""
    model, prompts, eos, refs = case
    engine = _engine(model, "fixed_slot")
    first = engine.generate(prompts, num_generations=G, sampling=_greedy(eos))
    assert engine.pool.allocator.num_used == 0
    second = engine.generate(prompts[::-1], num_generations=2, sampling=_greedy(eos))
    assert engine.pool.allocator.num_used == 0
    assert second.completion_ids == [r for r in refs[::-1] for _ in range(2)]
    assert first.completion_ids == [r for r in refs for _ in range(G)]


def test_sliding_window_model_matches_generate():
    """Mistral with a sliding window shorter than the sequences: the window reaches the paged backend."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        sliding_window=6, tie_word_embeddings=False)
    model = MistralForCausalLM(cfg).eval()
    prompts = _prompts(1)
    refs = [reference_greedy(model, p, MAX_NEW, []) for p in prompts]
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    result = _engine(model, "fixed_slot").generate(prompts, num_generations=2, sampling=sampling)
    assert result.completion_ids == [r for r in refs for _ in range(2)]


def test_model_zoo_tiny_matches_generate():
    """`random_model("tiny")` (the benchmark's default) runs through the engine like any HF model."""
    from trl_infinite.testing.model_zoo import random_model

    model = random_model("tiny", torch.float32, "cpu")
    prompts = _prompts(2)
    refs = [reference_greedy(model, p, MAX_NEW, []) for p in prompts]
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    result = _engine(model, "dynamic_slot").generate(prompts, num_generations=2, sampling=sampling)
    assert result.completion_ids == [r for r in refs for _ in range(2)]


@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_greedy_edge_cases_match_generate(mode):
    """Greedy with a repetition penalty (applied by generate even without sampling), max_new_tokens=1, and an EOS
    that is some prompt's very first token (that sample ends before its first decode forward)."""
    model = tiny_model("mistral")
    prompts = _prompts()
    engine = _engine(model, mode, max_prefill_tokens=5)

    def ref(prompt, n, eos, penalty=1.0):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos or None,
                             pad_token_id=0, repetition_penalty=penalty)[0, len(prompt):].tolist()
        return next((out[: i + 1] for i, t in enumerate(out) if t in eos), out)

    cases = [(SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.3), MAX_NEW, [], 1.3),
             (SamplingParams(max_new_tokens=1, temperature=0.0), 1, [], 1.0)]
    first = ref(prompts[1], 1, [])[0]
    cases.append((SamplingParams(max_new_tokens=6, temperature=0.0, eos_token_ids=[first]), 6, [first], 1.0))
    for sampling, n, eos, penalty in cases:
        result = engine.generate(prompts, 3, sampling)
        assert result.completion_ids == [ref(p, n, eos, penalty) for p in prompts for _ in range(3)], sampling
    assert [len(c) for c in result.completion_ids][3:6] == [1, 1, 1]
