"""A draft model is checked like the target (`spec_decode/draft_check.py`): its own config objects (no attention
switch shared with the drafter thread), a compatible vocabulary, its support contract, its KV pool inside the
engine's budget."""

import threading

import pytest
import torch
from _models import reference_greedy, tiny_model, tiny_tokenizer
from transformers import Qwen3ForCausalLM

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.model.guard import model_guard
from trl_infinite.engine.spec_decode import draft_model as draft_module
from trl_infinite.engine.spec_decode.draft_check import check_vocabulary

PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 5, 3, 4, 5, 30]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def _engine(model, draft, **kw):
    if "kv_cache_gb" not in kw:
        kw.setdefault("kv_cache_tokens", 4096)
    return RolloutEngine(model, EngineConfig(speculative_method="draft_model", speculative_draft_model=draft, **kw))


def _greedy_ok(model, result, prompts=PROMPTS, g=2):
    expected = [reference_greedy(model, p, GREEDY.max_new_tokens, []) for p in prompts for _ in range(g)]
    assert result.completion_ids == expected


def test_draft_on_the_targets_config_gets_its_own_and_leaves_the_target_routed_normally(model):
    """Regression: a draft built on the target's config object, decoupled (drafter thread beside the verifier):
    before, both switched and restored the one config at once and the target was left with the paged attention
    (the next forward raised, 10 calls of 10 here)."""
    torch.manual_seed(5)
    draft = Qwen3ForCausalLM(model.config).eval()
    assert draft.config is model.config
    impl = model.config._attn_implementation
    engine = _engine(model, draft, speculative_decoupled=True, speculative_draft_window=2)
    assert draft.config is not model.config and draft.config.to_dict() == model.config.to_dict()
    assert all(getattr(m, "config", None) is not model.config for m in draft.modules())
    for _ in range(10):
        result = engine.generate(PROMPTS, 2, GREEDY)
        assert model.config._attn_implementation == impl
        model(torch.tensor([[1, 2, 3]]))  # the model's own attention: raised before
    _greedy_ok(model, result)
    assert result.stats.extra["spec_ahead_tokens"] > 0  # the drafter thread did draft


def test_a_draft_sharing_the_targets_attention_modules_is_refused(model):
    draft = tiny_model("qwen3", seed=4)
    draft.model.layers[0] = model.model.layers[0]
    with pytest.raises(ValueError, match="speculative_draft_model.*shares"):
        _engine(model, draft)


def test_a_draft_proposing_ids_beyond_the_target_vocabulary_is_refused(model):
    with pytest.raises(ValueError, match=r"speculative_draft_model.*can propose 128 .* reads 96"):
        _engine(model, tiny_model("llama", seed=3, vocab_size=128))


def test_a_draft_with_other_special_ids_is_refused():
    target = tiny_model("llama")
    draft = tiny_model("llama", seed=3, eos_token_id=7)
    with pytest.raises(ValueError, match=r"speculative_draft_model.*eos_token_id.* 7 .* 2"):
        _engine(target, draft)


def test_tokenizers_that_map_an_id_to_another_token_are_refused():
    target, draft = tiny_model("llama"), tiny_model("llama", seed=3)
    tok_a, tok_b = tiny_tokenizer(), tiny_tokenizer()
    check_vocabulary(draft, target, tok_a, tok_b)  # the same tokenizer: fine
    vocab = tok_b.get_vocab()
    a, b = sorted(vocab, key=vocab.get)[5:7]  # two words swapped: the same ids, other tokens
    swapped = type("Swapped", (), {"get_vocab": lambda self: {**vocab, a: vocab[b], b: vocab[a]}})()
    with pytest.raises(ValueError, match="tokenizer maps id"):
        check_vocabulary(draft, target, swapped, tok_a)


def test_a_draft_reading_fewer_ids_than_the_target_drafts_only_where_it_can(model):
    """A draft with fewer rows (Qwen2.5-0.5B for Qwen2.5-7B): rows whose context holds an id it cannot read get no
    drafts; the output is the target's."""
    draft = tiny_model("llama", seed=3, vocab_size=95)
    prompts = [[5, 6, 7, 8, 9], [3, 4, 95, 3, 4, 5]]  # 95: beyond the draft's vocabulary
    result = _engine(model, draft, speculative_adaptive=False).generate(prompts, 2, GREEDY)
    _greedy_ok(model, result, prompts)
    assert result.stats.draft_tokens > 0


def test_an_unsupported_draft_is_refused_naming_the_field(model):
    draft = tiny_model("llama", seed=3)
    draft.model.layers[0].self_attn.forward = lambda *a, **k: (torch.zeros(1), None)  # bypasses the attention
    with pytest.raises(ValueError, match="speculative_draft_model"):
        _engine(model, draft)


def _draft_pools(monkeypatch) -> list:
    pools = []
    init = draft_module.DraftModelDrafter.__init__

    def spy(self, config, context):
        init(self, config, context)
        pools.append(self.pool)

    monkeypatch.setattr(draft_module.DraftModelDrafter, "__init__", spy)
    return pools


@pytest.mark.parametrize("budget", [dict(kv_cache_gb=0.0002), dict(kv_cache_tokens=256)])
def test_the_draft_pool_is_inside_the_engines_budget(model, draft, monkeypatch, budget):
    """Regression: the draft's pool held 65,536 tokens (16.8 MB) under a 0.2 MB `kv_cache_gb`. It mirrors the target
    pool's blocks; a byte budget pays for both."""
    pools = _draft_pools(monkeypatch)
    engine = _engine(model, draft, **budget)
    target = []  # (blocks, bytes) of the target's pool during the call
    result = engine.generate(PROMPTS, 2, GREEDY, on_decode_step=lambda b, s: target.append(
        (engine.pool.num_blocks, engine.pool.allocated_bytes)))
    _greedy_ok(model, result)
    (pool,) = pools
    target_blocks, target_bytes = max(target)
    assert pool.num_blocks == target_blocks
    if "kv_cache_gb" in budget:
        assert target_bytes + pool.allocated_bytes <= budget["kv_cache_gb"] * 1e9
    else:
        assert pool.num_blocks * pool.block_size <= budget["kv_cache_tokens"]


def test_a_budget_too_small_for_both_pools_is_refused(model, draft):
    one = RolloutEngine(model, EngineConfig(kv_cache_tokens=64)).pool.block_bytes  # target bytes per block
    with pytest.raises(ValueError, match=r"kv_cache_gb.*draft model's pool"):
        _engine(model, draft, kv_cache_gb=2.5 * one / 1e9)
    RolloutEngine(model, EngineConfig(kv_cache_gb=2.5 * one / 1e9))  # the target alone fits


def test_the_draft_model_is_held_with_the_target_for_each_call(model, draft):
    """Another engine's call on the draft model waits while this engine drafts with it (`model_guard`)."""
    engine = _engine(model, draft)
    started, release = threading.Event(), threading.Event()

    def hold():
        with model_guard(draft):
            started.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    started.wait(30)
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.generate(PROMPTS, 1, GREEDY)))
    worker.start()
    worker.join(0.5)
    assert not done  # waits for the draft model
    release.set()
    worker.join(60)
    t.join(30)
    assert done
