"""One GRPO step, `InfiniteGRPOTrainer` vs TRL's `GRPOTrainer`: step time and peak memory side by side.

Random weights of a given architecture (default Qwen3-1.7B's config, built offline), G samples of one prompt with
forced completion lengths drawn from a log-normal (the long tail of real rollouts): the engine stops each sample at
its length (`forced_lengths`); TRL's `generate` has no per-sample stop, so it decodes until the longest one (EOS
suppressed) and its completions are then cut to the same lengths, so both backward passes see identical lengths.

    python benchmarks/trainer_step.py                      # GPU: Qwen3-1.7B shape, G=32, 1024 tokens
    python benchmarks/trainer_step.py --tiny --device cpu  # a smoke run
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_infinite import InfiniteGRPOConfig, InfiniteGRPOTrainer  # noqa: E402

QWEN3_1_7B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)


def byte_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocab_size` ids built offline; EOS is the last id (never sampled in practice)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 2)} | {"<pad>": vocab_size - 2, "<eos>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def forced_lengths(num: int, max_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(num, generator=g) * 0.6) * max_len / 3
    return x.clamp(1, max_len).round().long().tolist()


def run(kind: str, a, lengths: list[int]) -> dict:
    cfg = TINY if a.tiny else QWEN3_1_7B
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).to(a.device, dtype=getattr(torch, a.dtype))
    tok = byte_tokenizer(cfg["vocab_size"])
    prompt = " ".join(f"w{i % 100}" for i in range(a.prompt_len))
    ds = Dataset.from_dict({"prompt": [prompt] * 4})
    common = dict(
        output_dir=tempfile.mkdtemp(), report_to="none", save_strategy="no", max_steps=1, beta=0.0,
        per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=a.G // a.micro_batch,
        num_generations=a.G, max_completion_length=a.max_len, bf16=a.dtype == "bfloat16", use_cpu=a.device == "cpu",
        gradient_checkpointing=a.gradient_checkpointing, disable_tqdm=True, learning_rate=1e-6, logging_steps=1,
    )
    reward = lambda completion_ids, **kw: [float(len(c) % 5) for c in completion_ids]  # noqa: E731
    if kind == "trl":
        # random weights do sample EOS now and then (1 / vocab per token): ban it so every row reaches its length
        trl_args = GRPOConfig(**common, generation_kwargs={"suppress_tokens": [tok.eos_token_id]})
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_args, train_dataset=ds, processing_class=tok)
        original = trainer._generate_single_turn

        def cut(*args, **kwargs):
            ids, lps = original(*args, **kwargs)
            return [c[:n] for c, n in zip(ids, lengths)], lps

        trainer._generate_single_turn = cut
        trainer.generation_config.max_new_tokens = max(lengths)  # EOS is never sampled: decode until the longest
    else:
        args = InfiniteGRPOConfig(**common, rollout_sampling_mode=a.mode, rollout_max_active_sequences=a.g,
                                  rollout_kv_cache_gb=a.kv_gb)
        trainer = InfiniteGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                                      processing_class=tok)
        original = trainer._get_engine

        def engine_with_lengths(m):
            engine = original(m)
            if not isinstance(engine.generate, functools.partial):
                engine.generate = functools.partial(engine.generate, forced_lengths=[lengths])
            return engine

        trainer._get_engine = engine_with_lengths
        # the KV pool is allocated once per training run, not per step: build it before the timed step
        engine_with_lengths(trainer.accelerator.unwrap_model(trainer.model))
    if a.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    if a.device == "cuda":
        torch.cuda.synchronize()
    out = {"trainer": kind, "step_s": time.perf_counter() - start,
           "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if a.device == "cuda" else float("nan")}
    log = next(h for h in trainer.state.log_history if "loss" in h)
    out["mean_len"] = log["completions/mean_length"]
    out["gen_s"] = log.get("rollout/wall_time_s", float("nan"))
    del trainer, model
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--G", type=int, default=32)
    p.add_argument("--g", type=int, default=32, help="engine slots")
    p.add_argument("--mode", default="fixed_slot")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--kv-gb", type=float, default=4.0)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--only", choices=["trl", "infinite"], default=None)
    a = p.parse_args()
    lengths = forced_lengths(a.G, a.max_len, seed=0)
    print(f"G={a.G} lengths: mean {sum(lengths) / len(lengths):.0f}, max {max(lengths)}")
    rows = [run(k, a, lengths) for k in ("infinite", "trl") if a.only in (None, k)]
    print(f"{'trainer':>9} {'step s':>8} {'peak GB':>8} {'mean len':>8}")
    for r in rows:
        print(f"{r['trainer']:>9} {r['step_s']:>8.2f} {r['peak_gb']:>8.2f} {r['mean_len']:>8.1f}")


if __name__ == "__main__":
    main()
