"""Tiny random-weight models and an offline tokenizer for tests (no Hub access)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
_COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_model(arch: str = "qwen3", seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 random-weight causal LM of the given architecture (GQA 4:2 heads)."""
    torch.manual_seed(seed)
    kw = {**_COMMON, **overrides}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **kw))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **kw))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    return model.eval()


def frequent_token(model: torch.nn.Module, prompts: list[list[int]], steps: int = 8) -> int:
    """A token greedy decoding emits often on these prompts: a good EOS id to make some samples stop early."""
    counts: dict[int, int] = {}
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False, pad_token_id=0)[0, len(p):]
        for t in out.tolist()[1:]:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    """`model.generate(do_sample=False)` cut after the first EOS (kept). The attention mask is passed: without it
    `generate` would mask every prompt token equal to `pad_token_id`."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos or None, pad_token_id=0,
    )[0, len(prompt):].tolist()
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built offline with the `tokenizers` library, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    words = [str(i) for i in range(20)] + [
        "the", "answer", "is", "what", "plus", "minus", "times", "a", "b", "c", "user", "assistant", "system",
        "knight", "knave", "true", "false", "yes", "no", "think", "so", "and", "or", "not", "=", "+", "-", "?", ".",
        ":", ",", "<", ">", "/", "#", "step", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
        "ten", "add", "sum", "total", "then", "we", "get", "hello", "world", "ok", "final", "boxed", "{", "}",
        "(", ")", "x", "y", "z", "of", "to", "in",
    ]
    vocab = {t: i for i, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit()])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    return fast


def _requires_compile():
    import pytest

    from trl_infinite.engine.config.engine_config import COMPILE_MIN_TORCH, compile_supported

    return pytest.mark.skipif(not compile_supported(),
                              reason=f"compile=True needs torch >= {'.'.join(map(str, COMPILE_MIN_TORCH))}")


# a test (or `pytest.param`) of `compile=True`: skipped on a torch older than it needs (`COMPILE_MIN_TORCH`)
requires_compile = _requires_compile()
