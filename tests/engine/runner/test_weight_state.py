"""The cache cannot go stale (issue 40, `engine/runner/weight_state.py`): after the weights change between two calls by any
route (`trl_infinite/testing/weight_routes.py`: fused / foreach AdamW, SGD, `p.data.copy_`, `torch._foreach_add_`,
inference tensors copied into or loaded with `load_state_dict`, a LoRA adapter disabled, switched or disabled for one
call), greedy output equals `model.generate` on the new weights, and nothing computed from the old weights (cached
prefixes, the 16-bit weight copy, captured decode steps) is reused:

- by default (`kv_cache_reuse_across_calls=False`) on every route, with the pool kept (`kv_cache_release=False`);
- where the caller declared it reports weight changes (`kv_cache_reuse_across_calls=True`), after its
  `reset_prefix_cache()`, and without it on the routes the fingerprint sees (versions, addresses, `load_state_dict`,
  adapter state); unchanged weights then reuse the cache across calls.
"""

from __future__ import annotations

import pytest
import torch
from _models import reference_greedy, requires_compile, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.decode.cpu_graphs import emulate_cuda_graphs
from trl_infinite.testing.weight_routes import LORA_ROUTES, ROUTES, SEEN, lora_model

BLOCK = 4
MAX_NEW = 8
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[])
PROMPTS = [torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (11, 6)]
HITS = sum(len(p) - 1 for p in PROMPTS)  # a call repeating the last one: all but each prompt's last token


def _model(route: str):
    model = tiny_model("llama", seed=3)
    return lora_model(model) if route in LORA_ROUTES else model


def _engine(model, **kw) -> RolloutEngine:
    cfg = dict(block_size=BLOCK, max_active_sequences=4, scheduler="fifo", kv_cache_tokens=4096,
               kv_cache_release=False)
    return RolloutEngine(model, EngineConfig(**{**cfg, **kw}))


def _refs(model) -> list[list[int]]:
    return [reference_greedy(model, p, MAX_NEW, []) for p in PROMPTS]


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_route_is_caught_by_default(route):
    model = _model(route)
    engine = _engine(model)
    before = engine.generate(PROMPTS, 1, GREEDY)
    assert before.completion_ids == _refs(model)
    assert engine.generate(PROMPTS, 1, GREEDY).stats.prefix_cache_hit_tokens == 0  # not reused across calls
    ROUTES[route](model, 1)
    refs = _refs(model)
    assert refs != before.completion_ids  # the route changed what the model computes
    after = engine.generate(PROMPTS, 1, GREEDY)
    assert after.completion_ids == refs and after.stats.prefix_cache_hit_tokens == 0


@pytest.mark.parametrize("route", list(ROUTES))
def test_declared_reuse_with_reset_or_fingerprint(route):
    """Reuse declared: unchanged weights hit the cache; a route the fingerprint sees drops it by itself, any route
    after `reset_prefix_cache()`."""
    model = _model(route)
    engine = _engine(model, kv_cache_reuse_across_calls=True)
    engine.generate(PROMPTS, 1, GREEDY)
    again = engine.generate(PROMPTS, 1, GREEDY)
    assert again.stats.prefix_cache_hit_tokens == HITS
    ROUTES[route](model, 2)
    if not SEEN[route]:
        engine.reset_prefix_cache()
    after = engine.generate(PROMPTS, 1, GREEDY)
    assert after.completion_ids == _refs(model) and after.stats.prefix_cache_hit_tokens == 0
    assert engine.generate(PROMPTS, 1, GREEDY).stats.prefix_cache_hit_tokens == HITS  # reused again


def test_reset_alone_drops_the_cache():
    model = tiny_model("llama", seed=3)
    engine = _engine(model, kv_cache_reuse_across_calls=True)
    engine.generate(PROMPTS, 1, GREEDY)
    engine.reset_prefix_cache()
    assert engine.generate(PROMPTS, 1, GREEDY).stats.prefix_cache_hit_tokens == 0


def test_a_keep_pool_run_shares_the_cache_and_its_end_drops_it():
    """The turns of one run (`keep_pool=True`) reuse the cache whatever the setting; after `release_pool()` the kept
    pool's cache is not reused by the next call unless reuse is declared."""
    model = tiny_model("llama", seed=3)
    for reuse in (False, True):
        engine = _engine(model, kv_cache_reuse_across_calls=reuse)
        engine.generate(PROMPTS, 1, GREEDY, keep_pool=True)
        assert engine.generate(PROMPTS, 1, GREEDY, keep_pool=True).stats.prefix_cache_hit_tokens == HITS
        engine.release_pool()
        assert engine.pool.allocated
        assert engine.generate(PROMPTS, 1, GREEDY).stats.prefix_cache_hit_tokens == (HITS if reuse else 0)


def test_a_route_inside_a_keep_pool_run_is_seen_by_reset():
    model = tiny_model("llama", seed=3)
    engine = _engine(model)
    engine.generate(PROMPTS, 1, GREEDY, keep_pool=True)
    ROUTES["adamw_fused"](model, 3)
    engine.reset_prefix_cache()
    out = engine.generate(PROMPTS, 1, GREEDY, keep_pool=True)
    assert out.completion_ids == _refs(model) and out.stats.prefix_cache_hit_tokens == 0


def test_disable_adapter_for_one_call():
    """`with model.disable_adapter():` around one call: the base model's output, then the adapter's again."""
    model = lora_model(tiny_model("llama", seed=3))
    engine = _engine(model, kv_cache_reuse_across_calls=True)
    adapted = engine.generate(PROMPTS, 1, GREEDY).completion_ids
    with model.disable_adapter():
        base = engine.generate(PROMPTS, 1, GREEDY)
        assert base.completion_ids == _refs(model) != adapted and base.stats.prefix_cache_hit_tokens == 0
    out = engine.generate(PROMPTS, 1, GREEDY)
    assert out.completion_ids == adapted == _refs(model) and out.stats.prefix_cache_hit_tokens == 0


@pytest.mark.parametrize("route", ["lora_toggle", "lora_switch"])
def test_captured_decode_steps_follow_an_adapter_switch(route):
    """Decode steps captured and replayed (the CPU capture emulation replays the recorded ops without Python): a
    disabled or switched adapter is a different step, captured again."""
    model = lora_model(tiny_model("llama", seed=3))
    with emulate_cuda_graphs():
        engine = _engine(model, kv_cache_reuse_across_calls=True, cuda_graphs=True)
        engine.generate(PROMPTS, 1, GREEDY)
        ROUTES[route](model, 0)
        out = engine.generate(PROMPTS, 1, GREEDY)
    assert engine.decoder.use_graphs and out.stats.graph_captures > 0
    assert out.completion_ids == _refs(model)


@requires_compile
def test_a_compiled_step_follows_an_adapter_switch():
    """The compiled step skips Dynamo's guards after a bucket's first call: a disabled adapter re-arms them."""
    model = lora_model(tiny_model("llama", seed=3))
    engine = _engine(model, kv_cache_reuse_across_calls=True, compile=True, compile_backend="eager")
    engine.generate(PROMPTS, 1, GREEDY)
    ROUTES["lora_toggle"](model, 0)
    assert engine.generate(PROMPTS, 1, GREEDY).completion_ids == _refs(model)


def test_a_load_state_dict_is_seen():
    """`load_state_dict` into inference tensors (no version counter) under declared reuse, without a reset."""
    model = tiny_model("llama", seed=3)
    engine = _engine(model, kv_cache_reuse_across_calls=True)
    engine.generate(PROMPTS, 1, GREEDY)
    ROUTES["inference_load"](model, 4)
    assert engine.weights.stale
    out = engine.generate(PROMPTS, 1, GREEDY)
    assert out.completion_ids == _refs(model) and out.stats.prefix_cache_hit_tokens == 0


@pytest.mark.parametrize("declared", [False, True])
@pytest.mark.parametrize("route", ["adamw_fused", "data_copy"])
def test_the_weight_copy_is_refreshed_after_an_unseen_route(route, declared):
    """Float32 weights under CPU bf16 autocast run on a 16-bit copy kept with the pool: after a fused AdamW step or a
    `p.data.copy_` it is copied again (by default, or after the declared caller's reset): tokens and log-probs equal
    a fresh engine's on the float32 weights."""
    model = tiny_model("llama", seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine = _engine(model, kv_cache_reuse_across_calls=declared)
        copy = engine.weight_copy
        assert copy is not None
        engine.generate(PROMPTS, 2, GREEDY)
        made = copy.refreshes
        ROUTES[route](model, 5)
        if declared:
            engine.reset_prefix_cache()
        got = engine.generate(PROMPTS, 2, GREEDY)
        assert copy.refreshes == made + 1
        assert torch.equal(copy._copies[id(model.lm_head.weight)], model.lm_head.weight.to(torch.bfloat16))
        fresh = _engine(model, weight_copy="off").generate(PROMPTS, 2, GREEDY)
    assert got.completion_ids == fresh.completion_ids and got.logprobs == fresh.logprobs


def test_the_address_fingerprint_ignores_values_and_sees_moved_storage():
    # `versions=False` is what a captured / compiled step depends on (`decode/static.py`): addresses, not values
    from trl_infinite.engine.runner.weight_state import weights_fingerprint

    model = tiny_model("llama")
    extra = torch.zeros(4)
    before, by_version = weights_fingerprint(model, extra, versions=False), weights_fingerprint(model, extra)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # in place: same address, a new version
    assert weights_fingerprint(model, extra, versions=False) == before
    assert weights_fingerprint(model, extra) != by_version
    assert weights_fingerprint(model, torch.zeros(4), versions=False) != before  # an extra tensor moved (a new pool)
    next(model.parameters()).data = next(model.parameters()).data.clone()  # moved storage (ZeRO-3 gather)
    assert weights_fingerprint(model, extra, versions=False) != before
