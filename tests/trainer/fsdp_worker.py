"""Worker of `test_trainer_fsdp.py`, run as two processes by `accelerate launch` on CPU (gloo): two GRPO steps of
`InfiniteGRPOTrainer` under the accelerate setup given as the second argument (`ddp`, `fsdp1`, `fsdp2`; `+lora`
adds a LoRA adapter); writes what it saw to `<out>/rank<i>.pt`.

accelerate runs FSDP on accelerators only: on CPU its state is `MULTI_CPU` and the FSDP plugin built from the launch
flags (`--use_fsdp --fsdp_version N ...`) is dropped. `cpu_fsdp` puts it back (the state's distributed type and
plugin, as `AcceleratorState` sets them on a GPU), so `accelerator.prepare` wraps the model with accelerate's own
FSDP code (`fully_shard` / `FullyShardedDataParallel`) over the gloo process group."""

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


def cpu_fsdp() -> None:
    """accelerate's FSDP on CPU processes (module docstring)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    init = AcceleratorState.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.fsdp_plugin = kwargs.get("fsdp_plugin") or getattr(self, "fsdp_plugin", None) or \
                FullyShardedDataParallelPlugin()
            self.distributed_type = DistributedType.FSDP

    AcceleratorState.__init__ = patched


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def full_state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (FSDP2 DTensors gathered, FSDP1 flat parameters summoned), by its name in
    the unwrapped model."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    with trainer._dist.summon_full_params(trainer.model_wrapped, recurse=True, writeback=False):
        out = {}
        for name, p in model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
    return out


class RecordingTrainer(InfiniteGRPOTrainer):
    """Records the rollouts' engine greedy check and the parameters' storage after each rollout."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = {"after_rollout_local": [], "steps": [], "greedy": []}

    def _generate(self, prompts):
        out = super()._generate(prompts)
        model = self.accelerator.unwrap_model(self.model_wrapped)
        self.record["after_rollout_local"].append(
            {n: (type(p).__name__, tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape),
                 p.untyped_storage().size() if not hasattr(p, "to_local") else p.to_local().untyped_storage().size())
             for n, p in model.named_parameters()})
        return out

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        return out


def main(out_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    if mode.startswith("fsdp"):
        cpu_fsdp()
    args = InfiniteGRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", beta=0.0, learning_rate=0.1,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=2, logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0, rollout_max_active_sequences=2, rollout_kv_cache_tokens=512,
    )
    trainer = RecordingTrainer(
        model=tiny_model("qwen3").train(), reward_funcs=token_sum_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tiny_tokenizer(),
    )
    from trl_infinite.trainer.trainer import InfiniteGRPOTrainer as T  # noqa
    steps = []

    class Snap:
        pass

    from transformers import TrainerCallback

    class StepSnapshots(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            steps.append(full_state(trainer))

    trainer.add_callback(StepSnapshots())
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(
        {
            **trainer.record,
            "steps": steps,
            "uses_engine": trainer.uses_engine,
            "fallback": trainer.engine_fallback_reasons,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "fsdp_version": trainer._dist.fsdp_version,
            "wrapped": type(trainer.model_wrapped).__name__,
            "engine_steps": [h.get("rollout/decode_steps") for h in trainer.state.log_history if "loss" in h],
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
