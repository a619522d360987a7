"""How `grpo_step.py`'s workers build a trainer: the model, tokenizer, prompts, reward and `GRPOConfig` of a run.

Nothing here is ours beyond the class swap: `GRPOConfig` / `InfiniteGRPOConfig` with TRL's defaults except the batch
geometry of the size, one log per step, no saving, and on CPU `use_cpu=True` (bf16 per `--bf16`).
"""

from __future__ import annotations

import ast
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from trl_infinite.testing.shared_data import dataset_file


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over `vocab_size` ids built offline ("w0".."w{V-3}", pad, EOS = the last id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 2)} | {"<pad>": vocab_size - 2, "<eos>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def length_reward(completion_ids, **kwargs) -> list[float]:
    """Random-weight models: any reward with a spread (the advantages are then not all zero)."""
    return [float(len(ids) % 5) for ids in completion_ids]


def gsm8k_path(a) -> Path:
    path = Path(a.data) if a.data else dataset_file("gsm8k", "train")
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K train prompts not found at {path}: pass --data or set $TRL_INFINITE_DATA")
    return path


def gsm8k_dataset(path: Path, rows: int):
    from datasets import Dataset

    items = [json.loads(line) for line in path.read_text().splitlines()[:rows]]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": x["question"]}] for x in items],
                              "answer": [x["answer"] for x in items]})


def random_dataset(vocab_size: int, rows: int, prompt_len: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_dict({"prompt": [" ".join(f"w{rng.randrange(vocab_size - 2)}" for _ in range(prompt_len))
                                         for _ in range(rows)]})


def parse_rollout_options(items: list[str], prefix: str = "rollout_") -> dict:
    """`--rollout NAME=VALUE` items as `InfiniteGRPOConfig` keyword arguments (`rollout_NAME`; values read as
    Python literals, else strings); with `prefix=""`, `--option` items (field names as they are)."""
    out = {}
    for item in items:
        name, value = item.split("=", 1)
        key = prefix + name.removeprefix(prefix) if prefix else name
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


CONFIG_KEYS = ("loss_type", "beta", "gradient_checkpointing", "bf16", "use_cpu", "learning_rate", "optim",
               "lr_scheduler_type", "max_grad_norm", "temperature", "top_p", "top_k", "min_p", "num_iterations",
               "epsilon", "scale_rewards", "importance_sampling_level", "mask_truncated_completions",
               "steps_per_generation", "use_transformers_continuous_batching", "seed")


def build_trainer(a, kind: str, size, device: torch.device):
    """The trainer of `kind` on this run's model, data and config (nothing of ours beyond the class swap)."""
    from trl import GRPOConfig, GRPOTrainer

    from trl_infinite import InfiniteGRPOConfig, InfiniteGRPOTrainer

    bf16 = {"on": True, "off": False, "auto": device.type == "cuda"}[a.bf16]
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="grpo_step_"), report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, max_steps=a.steps, per_device_train_batch_size=size.G * size.prompts,
        gradient_accumulation_steps=1, num_generations=size.G, max_completion_length=size.max_len, seed=a.seed,
        bf16=bf16, use_cpu=device.type == "cpu",
    )
    if kind == "trl_cb":
        common["use_transformers_continuous_batching"] = True
        if a.cb_memory_percent is not None:
            common["transformers_continuous_batching_config"] = {"max_memory_percent": a.cb_memory_percent}
    if a.model == "smollm2":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # examples/rewards.py
        from rewards import gsm8k_reward

        from trl_infinite.testing.offline_models import smollm2_path

        model, tokenizer, reward = str(smollm2_path()), None, gsm8k_reward
        dataset = gsm8k_dataset(gsm8k_path(a), a.num_prompts)
        if a.weights_dtype != "float32":
            common["model_init_kwargs"] = {"dtype": a.weights_dtype}
    else:
        from trl_infinite.testing.model_zoo import random_model

        model = random_model(a.model, dtype=getattr(torch, a.weights_dtype), device=device, seed=0)
        vocab = model.config.vocab_size
        tokenizer, reward = word_tokenizer(vocab), length_reward
        dataset = random_dataset(vocab, a.num_prompts, a.prompt_len, seed=0)
    if kind == "infinite":
        args = InfiniteGRPOConfig(**common, **parse_rollout_options(a.rollout),
                                  **parse_rollout_options(a.option, prefix=""))
        cls = InfiniteGRPOTrainer
    else:
        args, cls = GRPOConfig(**common), GRPOTrainer
    return cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer)


def config_summary(args) -> dict:
    out = {k: getattr(args, k, None) for k in CONFIG_KEYS}
    out.update({k: v for k, v in vars(args).items() if k.startswith("rollout_")})
    return {k: (v.value if hasattr(v, "value") else v) for k, v in out.items()}
