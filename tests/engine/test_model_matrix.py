"""The long tail of `docs/models.md` (`python -m trl_infinite.testing.model_matrix`), kept cheap: every model type the
matrix found token-identical decodes one 17-token prompt (past the tiny configs' sliding window of 6 and chunk of 5)
token-identically to `model.generate` through the engine (fixed_slot, block size 5); every refused one is refused
up front for the same reason. The five named models run the full matrix checks in `test_model_support.py`."""

from __future__ import annotations

import pytest
import torch

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.testing.model_matrix import forward_greedy, prompts, reference
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
REFUSED = {  # model type -> a fragment of its refusal
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
PROMPT = prompts()[3]  # 17 tokens
NEW = 8


def _engine(model) -> RolloutEngine:
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=2, block_size=5, kv_cache_tokens=200,
                       max_prefill_tokens=12)
    return RolloutEngine(model, cfg)


def _greedy(engine: RolloutEngine) -> list[list[int]]:
    return engine.generate([PROMPT], 2, SamplingParams(max_new_tokens=NEW, temperature=0.0)).completion_ids


@pytest.mark.parametrize("model_type", TOKEN_IDENTICAL)
def test_long_tail_token_identical(model_type):
    model = build_tiny_model(model_type)
    want = reference(model, PROMPT, None)[:NEW]
    assert _greedy(_engine(model)) == [want, want]


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_long_tail_refused(model_type):
    model = build_tiny_model(model_type)
    with pytest.raises(ValueError, match=REFUSED[model_type]):
        _engine(model)


def test_moshi_matches_its_forward_where_generate_does_not():
    """Moshi with a 6-token sliding window: transformers' cached `generate` disagrees with Moshi's own forward; the
    engine follows the forward (what training computes log-probabilities with)."""
    model = build_tiny_model("moshi")
    prompt = prompts()[1]
    by_forward = forward_greedy(model, prompt, None)
    with torch.no_grad():
        got = _engine(model).generate([prompt], 1, SamplingParams(max_new_tokens=12, temperature=0.0)).completion_ids
    assert got == [by_forward]
    assert reference(model, prompt, None) != by_forward
