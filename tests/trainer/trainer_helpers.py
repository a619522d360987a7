"""Helpers of the trainer tests (imported by name: a `conftest` module name is shared by every conftest.py)."""

from __future__ import annotations

from transformers import TrainerCallback

PROMPTS = [
    "what is 1 plus 2 ?",
    "is a knight a knave ?",
    "what is 3 times 4 ?",
    "the sum of 5 and 6 ?",
    "what is 7 minus 2 ?",
    "is b a knave or a knight ?",
    "what is 8 plus 9 ?",
    "add 10 and 11 .",
]


def cpu_args(tmp_path, cls=None, **overrides):
    """A GRPO config that trains on CPU in float32, without reporting, under `tmp_path`."""
    from trl_infinite.trainer import InfiniteGRPOConfig

    cls = cls or InfiniteGRPOConfig
    kw = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        beta=0.0,
        learning_rate=0.1,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=1,
        max_completion_length=8,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    kw.update(overrides)
    if cls.__name__ != "InfiniteGRPOConfig":
        kw = {k: v for k, v in kw.items() if not k.startswith("rollout_")}
    return cls(**kw)


def token_sum_reward(completion_ids, **kwargs):
    """A reward that varies between samples of a random model: the token-id sum modulo 7."""
    return [float(sum(ids) % 7) for ids in completion_ids]


class GradCapture(TrainerCallback):
    """Copies the accumulated gradients right before the (first) optimizer step."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
