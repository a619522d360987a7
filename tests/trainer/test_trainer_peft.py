"""PEFT: adapter methods (LoRA, DoRA, IA3) decode through the engine, on the adapted weights; prompt learning (prompt
and prefix tuning, which prepend virtual tokens) trains through TRL's own generation path, with one warning."""

import pytest
import torch
from _models import reference_greedy, tiny_model
from trainer_helpers import PROMPTS, cpu_args, token_sum_reward

from trl_infinite.trainer import InfiniteGRPOTrainer

peft = pytest.importorskip("peft")

ADAPTERS = {
    "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                    lora_dropout=0.0),
    "dora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
    "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
}
PROMPT_LEARNING = {
    "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "prefix_tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
}


def peft_trainer(tmp_path, tokenizer, dataset, peft_config, **overrides):
    args = cpu_args(tmp_path, rollout_max_active_sequences=2, **overrides)
    return InfiniteGRPOTrainer(model=tiny_model("qwen3").train(), reward_funcs=token_sum_reward, args=args,
                               train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)


@pytest.mark.parametrize("method", list(ADAPTERS))
def test_adapters_generate_through_the_engine(tmp_path, tokenizer, dataset, method):
    trainer = peft_trainer(tmp_path, tokenizer, dataset, ADAPTERS[method](), generation_kwargs={"do_sample": False},
                           max_completion_length=10)
    assert trainer.uses_engine
    torch.manual_seed(1)
    with torch.no_grad():  # fresh adapters are the identity: make them change the output
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name or "ia3_l" in name:
                p.normal_(0, 0.5) if "lora_B" in name else p.uniform_(0.0, 3.0)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    rows = [p for p in prompts for _ in range(2)]
    completions, _ = trainer._generate_single_turn(rows, None, {}, 2)
    peft_model = trainer.model.eval()
    eos = trainer.eos_token_ids
    with peft_model.disable_adapter():
        base = [reference_greedy(peft_model, p, 10, eos) for p in prompts]
    adapted = [reference_greedy(peft_model, p, 10, eos) for p in prompts]
    assert base != adapted  # the adapters matter
    assert completions == [adapted[0], adapted[0], adapted[1], adapted[1]]


@pytest.mark.parametrize("method", list(PROMPT_LEARNING))
def test_prompt_learning_trains_through_trls_generation(tmp_path, tokenizer, dataset, method):
    # prefix tuning's past key values fail under gradient checkpointing in TRL's own trainer too: turned off there
    overrides = {"gradient_checkpointing": False} if method == "prefix_tuning" else {}
    with pytest.warns(UserWarning, match="virtual tokens") as record:
        trainer = peft_trainer(tmp_path, tokenizer, dataset, PROMPT_LEARNING[method](), **overrides)
    assert len([w for w in record if "TRL's own path" in str(w.message)]) == 1
    assert not trainer.uses_engine
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
    for name, p in trainer.model.named_parameters():
        if name in trainable:
            assert not torch.equal(trainable[name], p), f"{name} did not change"


def test_engine_refuses_prompt_learning_models_clearly():
    from trl_infinite import EngineConfig, RolloutEngine

    model = peft.get_peft_model(tiny_model("qwen3"), PROMPT_LEARNING["prompt_tuning"]())
    with pytest.raises(ValueError, match="virtual tokens"):
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256))


@pytest.mark.parametrize("method", list(ADAPTERS))
def test_adapters_train_with_the_shared_prefix_forward(tmp_path, tokenizer, dataset, method):
    """The loss's forward of an adapted model is the shared-prefix one, through the adapters: its log-probs equal the
    PEFT model's own padded forward (adapters made non-trivial first)."""
    trainer = peft_trainer(tmp_path, tokenizer, dataset, ADAPTERS[method]())
    assert trainer.shared_prefix is not None, trainer.shared_prefix_reason
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name or "ia3_l" in name:
                p.normal_(0, 0.5) if "lora_B" in name else p.uniform_(0.0, 3.0)
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    ids = torch.tensor([prompt + [5, 6, 7], prompt + [8, 9, 0]])
    mask = torch.ones_like(ids)
    mask[1, -1] = 0
    got, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3)
    logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, -4:-1].float() / trainer.temperature
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, -3:, None])[..., 0] * mask[:, -3:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

