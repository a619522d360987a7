"""Worker of `test_trainer_multiprocess.py`, run as two processes by `accelerate launch` on CPU (gloo): two GRPO
steps of `InfiniteGRPOTrainer`, each process with its own engine on its own prompts; writes what it saw to
`<out>/rank<i>.pt`."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (for _models)

import torch  # noqa: E402
from _models import tiny_model, tiny_tokenizer  # noqa: E402
from datasets import Dataset  # noqa: E402

from trl_infinite.trainer import InfiniteGRPOConfig, InfiniteGRPOTrainer  # noqa: E402

PROMPTS = [f"what is {i} plus {i + 1} ?" for i in range(16)]


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


class RecordingTrainer(InfiniteGRPOTrainer):
    """Records the prompts each process generates for and the local / gathered reward rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = {"prompts": [], "local_rows": [], "gathered_rewards": [], "advantages": []}

    def _generate(self, prompts):
        self.record["prompts"].extend(prompts)
        return super()._generate(prompts)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.record["local_rows"].append(len(prompts))
        self.record["gathered_rewards"].append(rewards[:, 0].tolist())
        return rewards

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.record["advantages"].append(out["advantages"].tolist())  # this process's slice
        return out


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    args = InfiniteGRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", beta=0.0, learning_rate=0.1,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=2, logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0, rollout_max_active_sequences=2, rollout_kv_cache_tokens=512,
    )
    trainer = RecordingTrainer(
        model=tiny_model("qwen3").train(), reward_funcs=token_sum_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tiny_tokenizer(),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(
        {
            **trainer.record,
            "num_processes": trainer.accelerator.num_processes,
            "backend": torch.distributed.get_backend(),
            "engine_built": trainer._engine is not None,
            "engine_steps": [h.get("rollout/decode_steps") for h in trainer.state.log_history if "loss" in h],
            "before": before,
            "after": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1])
