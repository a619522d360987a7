"""The long tail of `docs/models.md` (`python -m trl_infinite.testing.model_matrix`), judged by the support contract
whatever the installed transformers release: building the engine either refuses the model up front with the clear
`ValueError` (naming the model type and `use_vllm=True`), or the engine decodes one 17-token prompt (past the tiny
configs' sliding window of 6 and chunk of 5) token-identically to `model.generate` (fixed_slot, block size 5).

`TOKEN_IDENTICAL` / `REFUSED` record the matrix's verdicts (and refusal reasons) on the transformers release that
`docs/models.md` was made with; a later release may move a model onto transformers' `AttentionInterface` (CodeGen
and GPT-J in 5.24) or add model types (Inkling2 in 5.24), so the lists are the set of types judged, not the verdict
expected. Model types of the installed transformers that the lists do not know are judged the same way. The five
named models run the full matrix checks in `test_model_support.py`."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from packaging.version import Version

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.testing.model_matrix import (
    causal_lm_types,
    forward_greedy,
    judge,
    prompts,
    refusal_pattern,
)
from trl_infinite.testing.routing import kwargs_reach_attention
from trl_infinite.testing.tiny_configs import build_tiny_model

TOKEN_IDENTICAL = (
    "afmoe", "apertus", "arcee", "aria_text", "axk1", "beam", "bert", "bert-generation", "biogpt", "bitnet",
    "cohere", "cohere2", "cohere2_moe", "ctrl", "cwm", "dbrx", "deepseek_v2", "dots1", "electra", "emu3", "ernie",
    "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "flex_olmo", "flint", "gemma", "gemma3", "gemma3_text",
    "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "glm", "glm4", "glm4_moe",
    "glm4_moe_lite", "gpt-sw3", "gpt2", "gpt_neox", "granite", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3",
    "iquestcoder", "jais2", "jetmoe", "kolibri1", "laguna", "lfm2", "llama", "llama4", "longcat_flash", "mellum",
    "mimo_v2_flash", "minicpm3", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral",
    "mixtral", "mllama", "modernbert-decoder", "nanochat", "olmo", "olmo2", "olmo3", "olmoe", "opt", "persimmon",
    "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "roc_bert", "seed_oss", "smollm3",
    "solar_open", "starcoder2", "vaultgemma", "whisper", "youtu"
)
REFUSED = {  # model type -> a fragment of its refusal on the matrix's transformers release (informative only)
    **dict.fromkeys(['axk2', 'deepseek_v32', 'dots3_note', 'dots3_note_text', 'glm_moe_dsa', 'hy_v4'], 'indexed_attention'),
    **dict.fromkeys(['bailing_hybrid', 'bamba', 'falcon_mamba', 'granitemoehybrid', 'jamba', 'kimi_linear', 'mamba', 'mamba2', 'minimax', 'nemotron_h', 'olmo_hybrid', 'qwen3_5', 'qwen3_5_moe', 'qwen3_5_moe_text', 'qwen3_5_text', 'qwen3_next', 'qwen4_exp', 'qwen4_exp_text', 'recurrent_gemma', 'zamba2'], 'linear_attention'),
    **dict.fromkeys(['bart', 'bigbird_pegasus', 'blenderbot', 'blenderbot-small', 'marian', 'mbart', 'pegasus', 'plbart'], 'ignores `position_ids`'),
    **dict.fromkeys(['big_bird', 'bloom', 'codegen', 'cpmant', 'falcon', 'gpt_neo', 'gpt_neox_japanese', 'gptj', 'megatron-bert', 'mpt', 'mvp', 'openai-gpt', 'prophetnet', 'reformer', 'rembert', 'roformer', 'trocr', 'xglm', 'xlm', 'xlnet'], 'AttentionInterface'),
    **dict.fromkeys(['camembert', 'data2vec-text', 'roberta', 'roberta-prelayernorm', 'xlm-roberta', 'xlm-roberta-xl', 'xmod'], 'does not number positions'),
    **dict.fromkeys(['deepseek_v4'], 'heavily_compressed_attention'),
    **dict.fromkeys(['diffllama', 'hrm_text'], 'times per forward'),
    **dict.fromkeys(['doge'], 'additive bias'),
    **dict.fromkeys(['falcon_h1', 'zaya'], 'hybrid'),
    **dict.fromkeys(['inkling2_text', 'inkling_text'], 'hybrid_sliding'),
    **dict.fromkeys(['lfm2_moe', 'lfm3'], 'conv'),
    **dict.fromkeys(['nemotron', 'stablelm'], 'paged_ctx'),
    **dict.fromkeys(['rwkv', 'xlstm'], 'stateful non-attention mixers'),
}
# Mainstream architectures the engine promises to serve on any transformers release: a refusal of these is an engine
# regression, not a transformers change.
MUST_SERVE = ("gemma", "gpt2", "gpt_neox", "llama", "mistral", "mixtral", "olmo2", "opt", "phi3", "qwen2", "qwen3")
# Model types other tests judge (the named models and Moshi in `test_model_support.py` / below).
ELSEWHERE = ("deepseek_v3", "gemma2", "gpt_bigcode", "gpt_oss", "llama4_text", "moshi")
KNOWN = frozenset(TOKEN_IDENTICAL) | frozenset(REFUSED) | frozenset(ELSEWHERE)
PROMPT = prompts()[3]  # 17 tokens
NEW = 8


def _config() -> EngineConfig:
    return EngineConfig(sampling_mode="fixed_slot", max_active_sequences=2, block_size=5, kv_cache_tokens=200,
                        max_prefill_tokens=12)


def _engine(model) -> RolloutEngine:
    return RolloutEngine(model, _config())


def _installed() -> frozenset[str]:
    return frozenset(causal_lm_types())


def assert_meets_the_contract(model) -> str:
    """Refused up front with the clear refusal, or greedy output token-identical to `model.generate`. Returns the
    verdict ("refused" / "token-identical")."""
    verdict = judge(model, _config(), [PROMPT], 2, NEW)
    if verdict.refusal is not None:
        assert re.search(refusal_pattern(model.config.model_type), verdict.refusal), verdict.refusal
        return "refused"
    assert verdict.got == verdict.want, f"served, but engine {verdict.got} != generate {verdict.want}"
    return "token-identical"


# the newest release the lists were checked on: there and after, every listed type must build tiny; an older one may
# lack what a tiny config needs (5.0: Apertus initialises on the meta device, DBRX's sub-configs refuse the shared
# config keys)
LISTED_ON = (5, 24)


def build_or_skip(model_type: str) -> torch.nn.Module:
    try:
        return build_tiny_model(model_type)
    except (ValueError, NotImplementedError) as exc:
        if Version(transformers.__version__).release[:2] >= LISTED_ON:
            raise
        pytest.skip(f"transformers {transformers.__version__} cannot build a tiny `{model_type}`: {exc}"[:300])


@pytest.mark.parametrize("model_type", sorted(set(TOKEN_IDENTICAL) | set(REFUSED)))
def test_long_tail_meets_the_contract(model_type):
    """Every type of the matrix lists, on the installed release: refused clearly or token-identical (the mainstream
    `MUST_SERVE` types served wherever the release routes their attention kwargs, `testing/routing.py`; refused
    where it does not); skipped, named, where the release does not have the type or cannot build its tiny model."""
    if model_type not in _installed():
        pytest.skip(f"`{model_type}` is not a causal-LM type of transformers {transformers.__version__}")
    model = build_or_skip(model_type)
    verdict = assert_meets_the_contract(model)
    if model_type in MUST_SERVE:
        routed = kwargs_reach_attention(model)
        assert verdict == ("token-identical" if routed else "refused"), (
            f"`{model_type}` must be served where transformers routes its attention kwargs (routed here: {routed})")


def test_mainstream_models_are_listed_as_token_identical():
    """`MUST_SERVE` only names types the matrix found token-identical (so the floor above is checked on them)."""
    assert set(MUST_SERVE) <= set(TOKEN_IDENTICAL)


def test_the_contract_check_fails_a_silent_difference_and_an_unclear_refusal(monkeypatch):
    """The check above is not vacuous: a served model whose reference differs in one token fails it, and refusals
    that do not name the model type or the vLLM fallback do not match the clear refusal's pattern."""
    model = build_tiny_model("llama")
    generate = model.generate

    def off_by_one(input_ids, **kwargs):  # the first new token
        out = generate(input_ids, **kwargs)
        first = input_ids.shape[1]
        out[:, first] = (out[:, first] + 1) % model.config.vocab_size
        return out

    monkeypatch.setattr(model, "generate", off_by_one)
    with pytest.raises(AssertionError, match="served, but engine"):
        assert_meets_the_contract(model)
    pattern = refusal_pattern("llama")
    clear = ("The rollout engine cannot run `llama` (LlamaForCausalLM) exactly: it has a mixer. Generate with vLLM "
             "instead (`use_vllm=True` in the trainer) or with `model.generate`.")
    assert re.search(pattern, clear)
    assert not re.search(pattern, clear.replace("`llama`", "`gpt2`"))
    assert not re.search(pattern, clear.replace("(`use_vllm=True` in the trainer) ", ""))
    assert not re.search(pattern, "Unsupported model.")


def _unknown_types() -> list[str]:
    return sorted(t for t in causal_lm_types() if t not in KNOWN)


@pytest.mark.parametrize("model_type", _unknown_types() or ["(none)"])
def test_a_model_type_unknown_to_the_matrix_is_judged_by_the_contract(model_type):
    """A causal-LM type of the installed transformers that the matrix lists do not know (new in a release) is built
    from a tiny config (`SIZES`, then the generic shrinker) and judged like the others: exact or refused, not failed
    for being new. Skipped, with the reason, only where no tiny model of it can be run at all."""
    if model_type == "(none)":
        pytest.skip(f"transformers {transformers.__version__} has no causal-LM type the matrix does not know")
    try:
        model = build_tiny_model(model_type)
    except ImportError as exc:
        pytest.skip(f"`{model_type}` needs extra packages: {_short(exc)}")
    except ValueError as exc:
        if "after shrinking" in str(exc):
            pytest.skip(f"`{model_type}` stays over the size cap after shrinking: {_short(exc)}")
        pytest.skip(f"cannot build a tiny config of `{model_type}`: {type(exc).__name__}: {_short(exc)}")
    except Exception as exc:  # noqa: BLE001 -- any failure of transformers' own config / model classes
        pytest.skip(f"cannot build a tiny config of `{model_type}`: {type(exc).__name__}: {_short(exc)}")
    try:
        with torch.no_grad():
            model(torch.tensor([PROMPT]), use_cache=False)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the tiny `{model_type}`'s own forward fails: {type(exc).__name__}: {_short(exc)}")
    assert_meets_the_contract(model)


def _short(exc: BaseException, n: int = 160) -> str:
    return " ".join(str(exc).split())[:n]


def test_moshi_matches_its_forward_where_generate_does_not():
    """Moshi with a 6-token sliding window: transformers' cached `generate` disagrees with Moshi's own forward; the
    engine follows the forward (what training computes log-probabilities with). A release whose Moshi layers do not
    pass the attention kwargs on is refused clearly instead."""
    model = build_tiny_model("moshi")
    prompt = prompts()[1]
    by_forward = forward_greedy(model, prompt, None)
    try:
        engine = _engine(model)
    except ValueError as exc:
        assert re.search(refusal_pattern("moshi"), str(exc)), str(exc)
        return
    with torch.no_grad():
        got = engine.generate([prompt], 1, SamplingParams(max_new_tokens=12, temperature=0.0)).completion_ids
    assert got == [by_forward]
