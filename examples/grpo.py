"""GRPO with `InfiniteGRPOTrainer`, in the style of TRL's `trl grpo` script.

    python examples/grpo.py --config recipes/qwen3_1.7b_gsm8k_g32.yaml
    accelerate launch --config_file recipes/accelerate/ddp.yaml examples/grpo.py \\
        --config recipes/qwen3_1.7b_gsm8k_g32.yaml
    python examples/grpo.py --model_name_or_path Qwen/Qwen3-0.6B --dataset_name openai/gsm8k --dataset_config main \\
        --reward_funcs gsm8k --num_generations 16 --rollout_max_active_sequences 8 --rollout_kv_cache_gb 8 \\
        --output_dir runs/qwen3-gsm8k

`--dataset_name` is a Hub id or a local `.jsonl`/`.json` file. The prompt comes from the `prompt` column, or is built
from `question` (GSM8K) / `problem` (MATH) as a chat message; the other columns reach the reward functions as keyword
arguments (`answer`, `solution`, ...). `--reward_funcs` takes names from `examples/rewards.py` (`REWARDS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from rewards import REWARDS  # examples/rewards.py, beside this script
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_infinite import InfiniteGRPOConfig, InfiniteGRPOTrainer

SYSTEM_PROMPT = "Solve the problem step by step, then give the final answer in \\boxed{}."


@dataclass
class GRPOScriptArguments(ScriptArguments):
    reward_funcs: list[str] = field(
        default_factory=lambda: ["gsm8k"], metadata={"help": f"Reward functions, from {sorted(REWARDS)}."}
    )
    system_prompt: str | None = field(default=SYSTEM_PROMPT, metadata={"help": "System message; empty for none."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training rows."})


def load_train_dataset(script_args: GRPOScriptArguments):
    name = script_args.dataset_name
    if name.endswith((".jsonl", ".json")):
        ds = load_dataset("json", data_files=name, split="train")
    else:
        ds = load_dataset(name, script_args.dataset_config, split=script_args.dataset_train_split)
    if script_args.max_train_samples is not None:
        ds = ds.select(range(min(script_args.max_train_samples, len(ds))))
    if "prompt" in ds.column_names:
        return ds
    source = "question" if "question" in ds.column_names else "problem"
    system = [{"role": "system", "content": script_args.system_prompt}] if script_args.system_prompt else []
    return ds.map(lambda row: {"prompt": system + [{"role": "user", "content": row[source]}]})


def main(script_args: GRPOScriptArguments, training_args: InfiniteGRPOConfig, model_args: ModelConfig) -> None:
    unknown = [r for r in script_args.reward_funcs if r not in REWARDS]
    if unknown:
        raise ValueError(f"`reward_funcs` {unknown} unknown; choose from {sorted(REWARDS)}.")
    if model_args.model_name_or_path is None:
        raise ValueError("`model_name_or_path` is required.")
    if training_args.model_init_kwargs is None:
        training_args.model_init_kwargs = {}
    training_args.model_init_kwargs.setdefault("dtype", model_args.dtype)
    if model_args.attn_implementation is not None:
        training_args.model_init_kwargs.setdefault("attn_implementation", model_args.attn_implementation)
    trainer = InfiniteGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[REWARDS[r] for r in script_args.reward_funcs],
        args=training_args,
        train_dataset=load_train_dataset(script_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    parser = TrlParser((GRPOScriptArguments, InfiniteGRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())
