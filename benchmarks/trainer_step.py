"""GRPO steps, `InfiniteGRPOTrainer` vs TRL's `GRPOTrainer`: step time and peak memory side by side.

Random weights of a given architecture (default Qwen3-1.7B's config, built offline), G samples of one prompt with
forced completion lengths drawn from a log-normal (the long tail of real rollouts): the engine stops each sample at
its length (`forced_lengths`); TRL's `generate` has no per-sample stop, so it decodes until the longest one (EOS
suppressed) and its completions are then cut to the same lengths, so both backward passes see identical lengths.

Each trainer runs `--steps` optimizer steps (one generation of G samples each), timed one by one with a
`TrainerCallback` (synchronised): `step_s` is the last step (warm: the engine's CUDA graphs were captured in the
first, as in a real run), `first_step_s` the first; `peak_GB` is the CUDA peak of the last step, weights and
optimizer states included; `gen_s` the engine's rollout wall time (`rollout/wall_time_s`, InfiniteGRPOTrainer only).

    python benchmarks/trainer_step.py                      # GPU: Qwen3-1.7B shape, G=32, 1024 tokens
    python benchmarks/trainer_step.py --tiny --device cpu  # a smoke run
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from common import Table, run_header, write_results  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, TrainerCallback  # noqa: E402
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


class StepClock(TrainerCallback):
    """Wall time of every optimizer step (device synchronised at both ends); resets the CUDA peak before the last."""

    def __init__(self, cuda: bool, steps: int):
        self.cuda, self.steps = cuda, steps
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
            if len(self.seconds) == self.steps - 1:
                torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def run(kind: str, a, lengths: list[int]) -> dict:
    cfg = TINY if a.tiny else QWEN3_1_7B
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).to(a.device, dtype=getattr(torch, a.dtype))
    tok = byte_tokenizer(cfg["vocab_size"])
    prompt = " ".join(f"w{i % 100}" for i in range(a.prompt_len))
    ds = Dataset.from_dict({"prompt": [prompt] * 4})
    common = dict(
        output_dir=tempfile.mkdtemp(), report_to="none", save_strategy="no", max_steps=a.steps, beta=0.0,
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
    clock = StepClock(a.device == "cuda", a.steps)
    trainer.add_callback(clock)
    trainer.train()
    log = [h for h in trainer.state.log_history if "loss" in h][-1]
    out = {"trainer": kind, "step_s": clock.seconds[-1], "first_step_s": clock.seconds[0],
           "peak_GB": torch.cuda.max_memory_allocated() / 1e9 if a.device == "cuda" else None,
           "gen_s": log.get("rollout/wall_time_s"), "mean_len": log["completions/mean_length"]}
    del trainer, model
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return out


def parse_args(argv=None) -> argparse.Namespace:
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
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per trainer (the last one is reported)")
    p.add_argument("--json", default=None, help="write the rows as JSON (and the table as .md) here")
    a = p.parse_args(argv)
    if a.steps < 1 or a.G % a.micro_batch:
        p.error("--steps must be >= 1 and --G a multiple of --micro-batch")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    lengths = forced_lengths(a.G, a.max_len, seed=0)
    header = run_header(torch.device(a.device), "python " + " ".join(shlex.quote(x) for x in sys.argv))
    header.update({"model": "tiny qwen3" if a.tiny else "qwen3-1.7b (random weights)", "dtype": a.dtype, "G": a.G,
                   "lengths": f"mean {sum(lengths) / len(lengths):.0f}, max {max(lengths)} (log-normal, seed 0)",
                   "engine": f"{a.mode}, {a.g} slots, {a.kv_gb} GB pool", "micro_batch": a.micro_batch})
    table = Table(["trainer", "step_s", "first_step_s", "peak_GB", "gen_s", "mean_len"])
    for kind in ("infinite", "trl"):
        if a.only in (None, kind):
            table.add(**run(kind, a, lengths))
    write_results(a.json, header, table, {"lengths": lengths})


if __name__ == "__main__":
    main()
