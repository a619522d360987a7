"""Edge inputs of the engine fuzzer (issue 40): generation kwargs at their edges that `generate` runs, bad inputs
the engine must refuse before the call naming the field, draft models that differ from the target. Pure strategies
and builders (no engine state); `_fuzz_engine.py` draws from them."""

from __future__ import annotations

import torch
from _models import tiny_model
from hypothesis import strategies as st

from trl_infinite.engine import RolloutEngine, SamplingParams

VOCAB = 96  # tests/_models.py

# Generation kwargs at their edges that `generate` runs (ids 0 and vocab-1, empty lists, `min_new_tokens` above
# `max_new_tokens`, ...): the engine must give `generate`'s tokens (greedy) / the canonical engine's (sampled).
EDGE_KWARGS = (
    {"suppress_tokens": []}, {"suppress_tokens": [0, VOCAB - 1]}, {"begin_suppress_tokens": [0, VOCAB - 1]},
    {"bad_words_ids": [[0], [VOCAB - 1]]}, {"bad_words_ids": [[5, 6], [VOCAB - 1, 0]]},
    {"forced_eos_token_id": VOCAB - 1}, {"forced_eos_token_id": 0}, {"forced_bos_token_id": 0},
    {"forced_bos_token_id": VOCAB - 1}, {"sequence_bias": [[[0], 4.0], [[VOCAB - 1, 0], -3.0]]},
    {"no_repeat_ngram_size": 1}, {"min_new_tokens": 0}, {"no_repeat_ngram_size": 2}, {"suppress_tokens": [1, 2, 3]},
)


@st.composite
def edge_generation_kwargs(draw, has_eos: bool, max_new: int) -> dict:
    """One or two keys from `EDGE_KWARGS`, `min_new_tokens` at / above `max_new_tokens` (generate warns and
    suppresses EOS throughout), `exponential_decay_length_penalty` where an EOS id is given."""
    pool = [*EDGE_KWARGS, {"min_new_tokens": max_new}, {"min_new_tokens": max_new + draw(st.integers(1, 5))}]
    if has_eos:
        pool.append({"exponential_decay_length_penalty": (draw(st.integers(0, 4)), 1.5)})
    out: dict = {}
    for kw in draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2)):
        out.update(kw)
    # `generate` refuses a forced id that is also suppressed (forced EOS; forced BOS since transformers 5.24)
    if ("forced_eos_token_id" in out or "forced_bos_token_id" in out) and out.get("suppress_tokens"):
        out.pop("suppress_tokens")
    return out


# Inputs the engine must refuse before the call starts (no forward), naming the field, where `generate` raises
# mid-call or runs silently differently.
BAD_KWARGS = (
    ("forced_eos_token_id", VOCAB), ("forced_bos_token_id", VOCAB + 1000), ("suppress_tokens", [0, VOCAB]),
    ("begin_suppress_tokens", [VOCAB]), ("bad_words_ids", [[3], [VOCAB]]), ("sequence_bias", [[[VOCAB], 1.0]]),
    ("bad_words_ids", []), ("suppress_tokens", [-1]), ("forced_eos_token_id", True), ("suppress_tokens", [2.0]),
    ("bad_words_ids", [4]), ("typical_p", 0.0), ("exponential_decay_length_penalty", (1, 1.5)),
)
BAD_FIELDS = (("do_sample", "false"), ("do_sample", 1), ("top_k", -1), ("top_k", 2.0), ("temperature", -1.0),
              ("min_p", 1.5), ("top_p", 0.0), ("max_new_tokens", 0), ("seed", -1), ("repetition_penalty", 0.0))


@st.composite
def bad_inputs(draw) -> tuple[str, dict]:
    """(the name the error must give, `SamplingParams` keywords): one bad value among valid edge ones."""
    base = dict(max_new_tokens=draw(st.integers(1, 8)), temperature=draw(st.sampled_from([0.0, 1.0])),
                generation_kwargs=dict(draw(st.sampled_from(EDGE_KWARGS))))
    if draw(st.booleans()):
        key, value = draw(st.sampled_from(BAD_KWARGS))
        base["generation_kwargs"].pop("suppress_tokens" if key == "forced_eos_token_id" else key, None)
        base["generation_kwargs"][key] = value
        if key == "typical_p":  # a sampling warper: greedy `generate` does not build it (nor does the engine)
            base["temperature"] = 1.0
        return key, base
    key, value = draw(st.sampled_from(BAD_FIELDS))
    base[key] = value
    return key, base


def check_refused_before_the_call(engine: RolloutEngine, prompts: list[list[int]], name: str, kw: dict) -> None:
    """Building `SamplingParams(**kw)` or calling `generate` with it raises `ValueError` naming `name`, before the
    model runs."""
    calls = []
    hook = engine.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        try:
            sp = SamplingParams(**kw)
            engine.generate(prompts, 1, sp)
        except ValueError as e:
            assert name in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name}={kw!r} was accepted")
    finally:
        hook.remove()
    assert not calls, "the model ran before the input was refused"


# Draft models that do not match the target. Compatible ones (other depth, heads, width, family, the target's
# config object, fewer input rows, 16-bit weights) must be lossless; the others (more proposable ids than the target
# reads, other special ids) refused with a `ValueError` naming `speculative_draft_model` when the engine is built.
COMPATIBLE_DRAFTS = ("layers1", "layers3", "heads2", "heads8", "qwen2", "mistral", "shared_config", "vocab80",
                     "bfloat16")
REFUSED_DRAFTS = ("vocab128", "eos7")


def draft_variant(name: str, target) -> torch.nn.Module:
    """A fresh draft model of variant `name` for `target` (built anew each time: the engine gives a draft on the
    target's config object its own)."""
    if name == "shared_config":
        torch.manual_seed(11)
        # the class of the model the weights live in: a LoRA target (a `PeftModel`) is built from its config alone
        base = target.get_base_model() if hasattr(target, "get_base_model") else target
        return type(base)(target.config).eval()
    over = {"layers1": dict(num_hidden_layers=1), "layers3": dict(num_hidden_layers=3),
            "heads2": dict(num_attention_heads=2, num_key_value_heads=1),
            "heads8": dict(num_attention_heads=8, num_key_value_heads=8, hidden_size=64),
            "vocab80": dict(vocab_size=80), "vocab128": dict(vocab_size=128), "eos7": dict(eos_token_id=7)}
    arch = name if name in ("qwen2", "mistral") else "llama"
    model = tiny_model(arch, seed=7, **over.get(name, {}))
    return model.to(torch.bfloat16) if name == "bfloat16" else model
