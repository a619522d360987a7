"""Tool calling (`tools=[...]`) and `rollout_func` with the engine: a tiny model forced to emit a tool call."""

import pytest
import torch
from _models import tiny_model
from datasets import Dataset
from trainer_helpers import cpu_args, token_sum_reward
from trl.chat_template_utils import qwen3_chat_template

from trl_infinite.testing.offline_models import byte_tokenizer
from trl_infinite.testing.tools import multiply
from trl_infinite.trainer import InfiniteGRPOTrainer

pytest.importorskip("jmespath")  # TRL's tool-call parsing on this transformers version

TOOL_CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]


def force_script(model, prompt_len: int, script: list[int], after: int) -> None:
    """In eval mode (rollouts), the token at absolute position `prompt_len + k` is forced to `script[k]`, and to
    `after` beyond the script: the model 'calls the tool', then ends every later turn at once."""

    def capture(module, args, kwargs):
        if module.training:  # the loss's forward (e.g. the shared-prefix one, with its own inputs): not biased
            return
        positions = kwargs.get("position_ids")
        if positions is None:  # a plain forward (the engine's exactness check): positions 0 .. T-1
            ids = kwargs.get("input_ids", args[0] if args else None)
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
        module._positions = (positions, kwargs.get("logits_to_keep", 0))

    def bias(module, args, kwargs, output):
        if module.training:
            return output
        positions, keep = module._positions
        logits = output.logits[0]  # [R, V]
        if isinstance(keep, torch.Tensor):
            pos = positions[0, keep.to(positions.device)]
        else:
            pos = positions[0, positions.shape[1] - logits.shape[0]:]
        # the logits at position p predict the token at p + 1
        targets = [script[p + 1 - prompt_len] if 0 <= p + 1 - prompt_len < len(script) else after for p in pos.tolist()]
        logits[torch.arange(len(targets)), torch.tensor(targets)] += 1e4
        return output

    model.register_forward_pre_hook(capture, with_kwargs=True)
    model.register_forward_hook(bias, with_kwargs=True)


def script_tool_call(trainer, tokenizer) -> None:
    """Forces the tool call right after the prompt as TRL renders it (chat template with the tools' schema)."""
    prompt_len = len(trainer._tokenize_prompts([QUESTION])[0][0])
    script = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"]
    force_script(trainer.model, prompt_len, script, tokenizer.eos_token_id)


def test_forced_tool_call_runs_through_the_engine(tmp_path, monkeypatch):
    tokenizer = byte_tokenizer(qwen3_chat_template)
    calls, turns = [], []

    def multiply(a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        calls.append((a, b))
        return a * b

    original = InfiniteGRPOTrainer._generate_single_turn

    def recording(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = original(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        turns.append((len(prompt_ids), num_generations, [list(c) for c in out[0]]))
        return out

    monkeypatch.setattr(InfiniteGRPOTrainer, "_generate_single_turn", recording)

    def result_reward(completions, **kwargs):  # 1 when the tool's answer came back into the conversation
        return [float(any(m.get("role") == "tool" and m.get("content") == "12" for m in c)) for c in completions]

    args = cpu_args(tmp_path, max_completion_length=160, per_device_train_batch_size=2, num_generations=2,
                    rollout_max_active_sequences=2)
    trainer = InfiniteGRPOTrainer(
        model=tiny_model("qwen3", vocab_size=len(tokenizer), max_position_embeddings=2048).train(),
        reward_funcs=result_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": [QUESTION] * 4}), processing_class=tokenizer, tools=[multiply],
    )
    script_tool_call(trainer, tokenizer)
    assert trainer.uses_engine
    trainer.train()
    log = trainer.state.log_history[0]
    assert calls == [(3, 4), (3, 4)]  # both samples called the tool
    assert log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.0
    assert log["reward"] == 1.0 and "rollout/decode_steps" in log
    first, second = turns[0], turns[1]
    assert first[:2] == (2, 2) and second[:2] == (2, 1)  # the tool loop re-entered the engine, one row per sample
    assert tokenizer.decode(first[2][0]) == TOOL_CALL and second[2] == [[tokenizer.eos_token_id]] * 2


def test_rollout_func_can_use_the_engine(tmp_path):
    tokenizer = byte_tokenizer(qwen3_chat_template)
    seen = []

    def rollout_func(prompts, trainer):
        ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
               ["input_ids"] for p in prompts]
        completions, logprobs = trainer._generate_single_turn(ids, None, {}, trainer.num_generations)
        seen.append(len(completions))
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": logprobs}

    args = cpu_args(tmp_path, max_completion_length=8, per_device_train_batch_size=4, num_generations=2,
                    rollout_max_active_sequences=2)
    trainer = InfiniteGRPOTrainer(
        model=tiny_model("qwen3", vocab_size=len(tokenizer)).train(), reward_funcs=token_sum_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": [QUESTION] * 4}), processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert seen == [4] and "rollout/decode_steps" in trainer.state.log_history[0]
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def _tool_run(tmp_path, prefix_cache: bool):
    tokenizer = byte_tokenizer(qwen3_chat_template)

    turns = []
    original = InfiniteGRPOTrainer._generate_single_turn

    def recording(self, prompt_ids, *args, **kwargs):
        out = original(self, prompt_ids, *args, **kwargs)
        turns.append(([list(p) for p in prompt_ids], [list(c) for c in out[0]]))
        return out

    args = cpu_args(tmp_path, max_completion_length=160, per_device_train_batch_size=2, num_generations=2,
                    rollout_max_active_sequences=2, rollout_prefix_cache=prefix_cache, rollout_block_size=8)
    trainer = InfiniteGRPOTrainer(
        model=tiny_model("qwen3", vocab_size=len(tokenizer), max_position_embeddings=2048).train(),
        reward_funcs=token_sum_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": [QUESTION] * 4}), processing_class=tokenizer, tools=[multiply],
    )
    script_tool_call(trainer, tokenizer)
    trainer._generate_single_turn = recording.__get__(trainer)
    trainer.train()
    return turns, trainer.state.log_history[0]


def test_tool_turns_prefill_only_new_tokens_with_the_prefix_cache(tmp_path):
    """The second turn (prompt + tool call + tool result) finds the first turn's prompt and completion in the
    prefix cache: it prefills only the tool result and the first turn's last token per row, with TRL's outputs
    unchanged."""
    on_turns, on = _tool_run(tmp_path / "on", True)
    off_turns, off = _tool_run(tmp_path / "off", False)
    assert on_turns == off_turns and len(on_turns) == 2
    (first_prompts, first_completions), (second_prompts, _) = on_turns
    for turn in (0, 1):
        assert on[f"rollout/turn_{turn}/prefill_tokens"] + on[f"rollout/turn_{turn}/prefix_cache_hit_tokens"] == \
            off[f"rollout/turn_{turn}/prefill_tokens"]
    new = [len(p) - len(first_prompts[i]) - len(first_completions[i]) for i, p in enumerate(second_prompts)]
    assert on["rollout/turn_1/prefix_cache_hit_tokens"] > 0
    # each row: its tool result (and template tokens) plus the first turn's last token (no KV written), at most
    assert on["rollout/turn_1/prefill_tokens"] <= sum(n + 1 for n in new)
    assert off["rollout/turn_1/prefill_tokens"] == sum(len(p) for p in second_prompts)
