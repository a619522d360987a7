"""Tiny random-weight configurations of every causal-LM model type in `transformers` (no Hub access).

`tiny_config(model_type)` starts from the config class's own defaults and passes small values for the size fields
the class accepts (2 layers, hidden 32, 4 query heads, 2 KV heads, vocabulary 96, 4 experts, small MLA ranks, ...),
so the class's own `__post_init__` derives the rest (layer types, rope settings). `OVERRIDES` holds the few fields a
model type needs on top. `build_tiny_model` refuses configurations above `max_params` (measured on the meta device
before any memory is allocated). Used by the model matrix (`python -m trl_infinite.testing.model_matrix`) and tests.
"""

from __future__ import annotations

import inspect

import torch

from trl_infinite.engine.model.replica import REPLICA_VOCAB, shrink_config

VOCAB = REPLICA_VOCAB
# size fields by name, passed when the config class accepts them
SIZES: dict[str, object] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_kv_heads=2, head_dim=8, max_position_embeddings=512,
    # GPT-2 / BLOOM / OPT / BART style names
    n_embd=32, n_layer=2, n_head=4, n_positions=512, n_inner=64, d_model=32, ffn_dim=64, decoder_layers=2,
    decoder_attention_heads=4, decoder_ffn_dim=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
    num_layers=2, num_heads=4, ffn_hidden_size=64, word_embed_proj_dim=32, rotary_dim=4, d_ff=64, dff=64,
    n_positions_max=512,
    # mixture of experts
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, moe_topk=2,
    top_k_experts=2, num_shared_experts=1, expert_intermediate_size=32,
    # multi-head latent attention (K is nope + rope = 12 wide, V 8 wide)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
    # state-space / linear-attention mixers
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_expand=2, state_size=8,
    expand=2, conv_kernel=4, time_step_rank=4, mamba_dt_rank=4,
    # small windows and chunks, so that 3..29-token sequences exercise them
    sliding_window=6, attention_chunk_size=5,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
)
_MLA_HEADS = dict(num_key_value_heads=4)  # MLA expands K and V to every query head
_HYBRID = dict(layer_types=["linear_attention", "full_attention"])  # one linear-attention and one attention layer
# per model type, on top of SIZES
OVERRIDES: dict[str, dict] = {
    **{t: _MLA_HEADS for t in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa",
                               "minicpm3", "youtu", "axk1", "axk2", "longcat_flash", "dots3_note", "dots3_note_text",
                               "sarvam_mla")},
    **{t: _HYBRID for t in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")},
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False),  # 5.0 raises on CPU where the kernels are asked for
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "falcon_h1": dict(mamba_d_ssm=64),
    **{t: dict(layers_block_type=["mamba", "hybrid"]) for t in ("zamba", "zamba2")},
    "zaya": dict(num_experts_per_tok=1),
    "mamba2": dict(num_heads=8),
    "musicgen": dict(num_codebooks=1), "musicgen_melody": dict(num_codebooks=1),  # one token stream per sequence
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    **{t: dict(num_kv_shared_layers=0, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)
       for t in ("gemma3n_text", "gemma4_text", "gemma4")},
    "longcat_flash": dict(**_MLA_HEADS, expert_ffn_hidden_size=32, qk_rope_head_dim=8),
    "roc_bert": dict(is_decoder=True, pronunciation_vocab_size=VOCAB, shape_vocab_size=VOCAB),
    "xlm": dict(emb_dim=32),
    "dbrx": dict(d_model=32, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "kimi_linear": dict(**_HYBRID, **_MLA_HEADS, qk_rope_head_dim=8, linear_head_dim=8, linear_num_heads=4),
    **{t: dict(**_HYBRID, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
               indexer_compress_ratio=1, ple_embed_dim=8, ngram_vocab_size_base=VOCAB)
       for t in ("qwen4_exp", "qwen4_exp_text")},
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[16, 16], axial_pos_shape=[16, 32]),
    **{t: dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  image_size=28, patch_size=14), mm_tokens_per_image=4) for t in ("gemma3",)},
    "xmod": dict(is_decoder=True, default_language="en_XX"),
    **{t: dict(is_decoder=True) for t in ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text",
                                          "electra", "ernie", "megatron-bert", "rembert", "roberta",
                                          "roberta-prelayernorm", "roformer", "xlm-roberta", "xlm-roberta-xl")},
}


def sizes(head_dim: int = SIZES["head_dim"]) -> dict[str, object]:
    """`SIZES` with attention heads `head_dim` wide: 4 query heads, hidden size 4 x, feed-forward 8 x, rotary 1/2 x
    the head dim (`sizes(8) == SIZES`). A head dim of 16 or more (a multiple of the vector width) makes the engine's
    CPU decode steps run the C++ kernel (`engine/attention/cpu_decode.py`); 8 keeps the torch path. Multi-head
    latent attention keeps its own widths."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"`head_dim` must be an even integer >= 2 (the rotary dim is half of it), got {head_dim!r}.")
    hidden, ffn = 4 * head_dim, 8 * head_dim
    return {**SIZES, "hidden_size": hidden, "n_embd": hidden, "d_model": hidden, "word_embed_proj_dim": hidden,
            "head_dim": head_dim, "rotary_dim": head_dim // 2, "intermediate_size": ffn, "n_inner": ffn,
            "ffn_dim": ffn, "d_ff": ffn, "dff": ffn, "decoder_ffn_dim": ffn, "encoder_ffn_dim": ffn,
            "ffn_hidden_size": ffn, "mamba_d_head": 2 * head_dim}


def _kwargs_for(config_cls, model_type: str, size: dict | None = None) -> dict:
    accepted = set(inspect.signature(config_cls.__init__).parameters)
    kwargs = {k: v for k, v in (size or SIZES).items() if k in accepted}
    kwargs.update(OVERRIDES.get(model_type, {}))
    return kwargs


def tiny_config(model_type: str, size: dict | None = None, **overrides):
    """A small config for `model_type`'s causal-LM class (the text config where that class takes one); `size`: the
    size fields (default `SIZES`, see `sizes`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = getattr(causal_lm_class(model_type), "config_class", None) or CONFIG_MAPPING[model_type]
    kwargs = {**_kwargs_for(config_cls, model_type, size), **overrides}
    accepted = set(inspect.signature(config_cls.__init__).parameters)
    if "text_config" in accepted:
        sub_cls = getattr(config_cls, "sub_configs", {}).get("text_config")
        if sub_cls is not None and isinstance(sub_cls, type) and not getattr(sub_cls, "model_type", ""):
            # `AutoConfig`: the text config class is the one the config builds by default (its `model_type` key)
            try:
                sub_cls = type(config_cls().get_text_config())
            except Exception:  # noqa: BLE001 -- no default to learn it from: pass no sizes
                sub_cls = None
            if sub_cls is not None:
                kwargs["text_config"] = {**_kwargs_for(sub_cls, sub_cls.model_type, size),
                                         "model_type": sub_cls.model_type}
        elif sub_cls is not None and isinstance(sub_cls, type):
            kwargs["text_config"] = _kwargs_for(sub_cls, getattr(sub_cls, "model_type", model_type), size)
    config = config_cls(**kwargs)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # transformers 5.0: some configs (Phi, StableLM,
        if not hasattr(config, key):  # JetMoe, EXAONE 4) no longer take them, while their models still read them
            setattr(config, key, SIZES[key])
    return config


def causal_lm_class(model_type: str):
    """The `AutoModelForCausalLM` class of a model type."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def count_params(model_cls, config) -> int:
    """Parameters of `model_cls(config)`, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


def build_tiny_model(model_type: str, seed: int = 0, max_params: int = 6_000_000, size: dict | None = None,
                     **overrides) -> torch.nn.Module:
    """A float32 random-weight causal LM of `model_type` in eval mode. A config over `max_params` after `SIZES` is
    shrunk generically (the float32 replica's `shrink_config`, for fields `SIZES` does not name, e.g. Inkling2's
    `swa_num_attention_heads`; then `overrides` again); ValueError if it is still over."""
    config = tiny_config(model_type, size, **overrides)
    model_cls = causal_lm_class(model_type)
    n = count_params(model_cls, config)
    if n > max_params:
        shrunk = shrink_config(config)
        for key, value in overrides.items():
            setattr(shrunk, key, value)
        m = count_params(model_cls, shrunk)
        if m > max_params:
            raise ValueError(f"tiny {model_type} has {n} parameters, {m} after shrinking its size fields "
                             f"(> max_params={max_params}).")
        config = shrunk
    torch.manual_seed(seed)
    return model_cls(config).float().eval()
