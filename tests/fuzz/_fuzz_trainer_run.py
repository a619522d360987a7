"""One case of the trainer fuzzer (drawn by `_fuzz_trainer.py`): `InfiniteGRPOTrainer` and vanilla `GRPOTrainer`
trained from the same initial weights and seed on the same completions, and compared.

Completions: `fixed` rollouts patch `_generate_single_turn` on both trainers with one deterministic function of the
prompt and the row (a tool case's: `_fuzz_tools.py`, with TRL's tool loop); `engine` rollouts let
`InfiniteGRPOTrainer` sample with its engine (streamed rewards included) and replay the recorded completions and
sampling log-probs through `GRPOTrainer`.

Checked, for every optimizer step: the per-token log-probs (and entropies) of every completion in the loss's forward
(rows matched by their prompt and completion tokens, whatever micro batch and padding they ran in), every
parameter's accumulated gradient, the weights after the last step (SGD) and every logged metric (the loss
included; with a drawn eval set, evaluated after every step, its `eval_*` metrics and its rollouts too). Tolerance: float32 round-off of different reduction orders and paddings, `REL` of the largest entry of
the step's gradients / of the weights (a real difference is of order 1e-2 and more on these models); metrics
relative `REL_METRIC`. Engine rollouts: every sampled completion's sampling log-probs equal the loss forward's at
the weights of its rollout (a prefix cache or weight copy kept across a weight change breaks it). A model refused by the engine's contract must fall back with a warning
(`engine_fallback_reasons`), one refused by the shared-prefix contract with a warning (`shared_prefix_reason`), and
both must still train exactly as `GRPOTrainer`.
"""

from __future__ import annotations

import copy
import math
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import torch
from _fuzz_tools import TOOLS, tool_completions, tool_tokenizer
from _fuzz_trainer import EOS, FAMILIES, Case, reward_funcs
from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_infinite.testing.routing import kwargs_reach_attention
from trl_infinite.testing.tiny_configs import build_tiny_model
from trl_infinite.trainer import InfiniteGRPOConfig, InfiniteGRPOTrainer

REL = 3e-4  # of the largest entry (gradients of a step, weights)
REL_METRIC = 1e-3  # metrics: relative, plus `ABS_METRIC`
ABS_METRIC = 1e-5
TIMING_KEYS = ("runtime", "per_second", "total_flos", "step_time", "train_loss")  # wall-clock metrics


def fixed_completions(seed: int, max_len: int, given: list[list[int]] | None = None):
    """`_generate_single_turn` returning completions that are a function of the prompt and the row only: 1 to
    `max_len` tokens, some ending in EOS (or `given`, row i getting `given[i % len(given)]`)."""

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if given is not None:
            return [list(given[i % len(given)]) for i in range(len(prompt_ids))], None
        out = []
        for i, p in enumerate(prompt_ids):
            rng = random.Random(hash((seed, tuple(p), i % num_generations)))
            ids = [rng.randrange(4, 90) for _ in range(rng.randint(1, max_len))]
            if rng.random() < 0.4:
                ids[-1] = EOS
            out.append(ids)
        return out, None

    return generate


class Capture(TrainerCallback):
    """The accumulated gradient of each optimizer step (right before the step)."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def record_logps(trainer, capture: Capture, seen: dict, old: dict):
    """Wraps the trainer's log-prob forward: per optimizer step, each row's log-probs (and entropies) at its
    completion tokens, keyed by (step, prompt tokens, completion tokens): of the loss forwards into `seen`, of the
    policy's forwards without gradients (TRL's `old_per_token_logps`, taken right after the rollout where an optimizer
    step comes between the rollout and a row's loss forward) into `old`."""
    forward = trainer._get_per_token_logps_and_entropies

    def wrapped(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        logps, ent, *rest = forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        # (not the reference's: the reference model, or the policy with its PEFT adapters off, TRL's reference under
        # PEFT; an eval step's first forward of the policy without gradients is that reference forward)
        policy = model is trainer.model and not _adapters_off(model)
        into = seen if torch.is_grad_enabled() else old if policy else None
        if into is not None:
            C = logits_to_keep
            for b in range(input_ids.shape[0]):
                pmask, cmask = attention_mask[b, :-C].bool(), attention_mask[b, -C:].bool()
                if not cmask.any():
                    continue
                key = (len(capture.grads), tuple(input_ids[b, :-C][pmask].tolist()),
                       tuple(input_ids[b, -C:][cmask].tolist()))
                into.setdefault(key, (logps[b][cmask].detach().clone(),
                                      None if ent is None else ent[b][cmask].detach().clone()))
        return (logps, ent, *rest)

    trainer._get_per_token_logps_and_entropies = wrapped


def _adapters_off(model) -> bool:
    """PEFT's adapters are disabled (`disable_adapter()`, TRL's `use_adapter(model, None)`)."""
    return any(getattr(m, "disable_adapters", False) is True for m in model.modules())


@dataclass
class Run:
    trainer: GRPOTrainer
    capture: Capture
    logps: dict
    warnings: list[str]
    old_logps: dict


def build_model(case: Case, tmp: Path) -> torch.nn.Module:
    family = FAMILIES[case.family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vocab = {"vocab_size": len(tool_tokenizer())} if case.tools else {}
        model = build_tiny_model(family.model_type, seed=case.model_seed, **case.model_overrides, **vocab)
    if case.args["beta"] > 0 and not case.peft:  # TRL builds the reference model from the policy's path
        path = tmp / "init"
        model.save_pretrained(path)
        model.config._name_or_path = str(path)
    return model.train()


def prompt_dataset(prompts: list[str], conversational: bool) -> Dataset:
    """TRL's standard format (text prompts) or its conversational one (one user message each)."""
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts] if conversational
                              else prompts})


def run_trainer(case: Case, cls, model, tmp: Path, tokenizer, generate) -> Run:
    ours = cls is InfiniteGRPOTrainer
    kw = dict(output_dir=str(tmp / cls.__name__), use_cpu=True, bf16=False, report_to="none", optim="sgd",
              logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    kw.update(case.args)  # `optim` included
    args = InfiniteGRPOConfig(**kw, **case.ours) if ours else GRPOConfig(**kw)
    peft_config = None
    if case.peft:
        import peft

        peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                      init_lora_weights=False)
    capture = Capture()
    # a reward model's tokenizer (TRL decodes the completions and tokenizes prompt + completion with it; the tiny
    # one in a tool case too: the reward model's vocabulary)
    reward_tokenizers = ([tokenizer if r == "reward_model" else None for r in case.rewards]
                         if "reward_model" in case.rewards else None)
    eval_dataset = None if case.eval_prompts is None else prompt_dataset(case.eval_prompts, case.conversational)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(case.model_seed)  # the adapters' initial weights
        trainer = cls(model=model, reward_funcs=reward_funcs(case), args=args,
                      train_dataset=prompt_dataset(case.prompts, case.conversational),
                      processing_class=tool_tokenizer() if case.tools else tokenizer,
                      eval_dataset=eval_dataset, reward_processing_classes=reward_tokenizers,
                      peft_config=peft_config, callbacks=[capture], tools=TOOLS if case.tools else None)
        logps: dict = {}
        old_logps: dict = {}
        record_logps(trainer, capture, logps, old_logps)
        if generate is not None:
            trainer._generate_single_turn = generate
        trainer.remove_callback(PrinterCallback)
        # accelerate's `free_memory` at the start of `train` runs `gc.collect()` (1-2 s with hypothesis' heap)
        with patch("accelerate.utils.memory.clear_device_cache"):
            trainer.train()
    return Run(trainer, capture, logps, [str(w.message) for w in caught], old_logps)


def engine_refuses(case: Case, model: torch.nn.Module) -> bool:
    """The engine's contract must refuse the case's model: its family is one it refuses, or the installed
    transformers does not route the model's attention kwargs (`testing/routing.py`: GPT-2, GPT-J, GPTBigCode on
    transformers 5.0); checked on a copy, with the random state restored."""
    if FAMILIES[case.family].refused == "engine":
        return True
    with torch.random.fork_rng():
        return not kwargs_reach_attention(copy.deepcopy(model).eval())


def run_case(case: Case, tmp: Path, tokenizer) -> None:
    model = build_model(case, tmp)
    refused = engine_refuses(case, model)
    initial = copy.deepcopy(model)
    if case.rollout == "fixed":
        max_len = case.args["max_completion_length"]
        generate = (tool_completions(case.completion_seed, max_len) if case.tools
                    else fixed_completions(case.completion_seed, max_len, case.completions))
        ours = run_trainer(case, InfiniteGRPOTrainer, model, tmp, tokenizer, generate)
        ref = run_trainer(case, GRPOTrainer, initial, tmp, tokenizer, generate)
    else:
        recorded: list = []
        sampled: list = []  # (optimizer steps done, prompt ids, (completions, sampling log-probs)) per rollout
        depth = [0]  # a refused model re-enters `_generate_single_turn` on its fallback: record the outer call
        original = InfiniteGRPOTrainer._generate_single_turn

        def recording(self, *args, **kwargs):
            depth[0] += 1
            try:
                out = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:  # with the global RNG after it (TRL's `generate` fallback samples from it)
                recorded.append((out, torch.get_rng_state()))
                sampled.append((self.state.global_step, args[0], out))
            return out

        def replay(*args, **kwargs):
            out, rng = next(calls)
            torch.set_rng_state(rng)  # `bnpo`'s random split draws from it next, in both trainers
            return out

        calls = iter(recorded)
        InfiniteGRPOTrainer._generate_single_turn = recording
        try:
            ours = run_trainer(case, InfiniteGRPOTrainer, model, tmp, tokenizer, None)
        finally:
            InfiniteGRPOTrainer._generate_single_turn = original
        ref = run_trainer(case, GRPOTrainer, initial, tmp, tokenizer, replay)
        multiple = case.args.get("pad_to_multiple_of")
        check_sampling_logps(sampled, ours, FAMILIES[case.family].absolute_positions,
                             multiple if isinstance(multiple, int) else 1)
    check_contracts(case, ours, refused)
    compare(ours, ref)


def check_contracts(case: Case, ours: Run, refused: bool) -> None:
    """A refused model falls back with a warning; the shared-prefix forward is used or refused with a warning."""
    trainer = ours.trainer
    if refused and case.rollout == "engine":
        assert trainer.engine_fallback_reasons, "a model the engine refuses ran on the engine"
        assert any("instead of the rollout engine" in w for w in ours.warnings), ours.warnings
    elif case.rollout == "engine":
        assert trainer.uses_engine, trainer.engine_fallback_reasons
    if case.ours["shared_prefix_training"] and trainer.shared_prefix is None:
        assert trainer.shared_prefix_reason, "shared-prefix forward off without a reason"
        assert any("instead of the shared-prefix forward" in w for w in ours.warnings), ours.warnings


def check_sampling_logps(sampled: list, ours: Run, absolute_positions: bool = False, pad_multiple: int = 1) -> None:
    """The engine sampled from the weights it was given: each completion's sampling log-probs (TRL's convention,
    `log_softmax(logits / T)` of the sampled token) equal the policy's log-probs of the row in the optimizer step of
    its rollout: its loss forward's, or, where the row's first loss forward comes after another optimizer step
    (`gradient_accumulation_steps` not a multiple of `steps_per_generation` x `num_iterations`), TRL's
    `old_per_token_logps` forward right after the rollout. A prefix cache or weight copy kept from earlier weights
    breaks it. Not with a random training forward (dropout on): the loss forward then draws dropout masks, the
    rollout runs in eval mode (as `generate` does); nor for a left-padded row of a model with `absolute_positions`
    (TRL's forward numbers it from column 0, the rollout from its first token: `GRPOTrainer`'s behaviour,
    docs/trainer.md "Positions"); TRL pads the prompts to a multiple of an integer `pad_to_multiple_of`
    (`pad_multiple`), the longest included."""
    if ours.trainer.random_forward is not None:
        return
    checked = padded = 0
    for step, prompt_ids, (completions, logps) in sampled:
        if logps is None:  # TRL's own generation (a refused model)
            continue
        width = -(-max(len(p) for p in prompt_ids) // pad_multiple) * pad_multiple  # TRL's prompt columns
        for prompt, ids, lp in zip(prompt_ids, completions, logps):
            key = (step, tuple(prompt), tuple(ids))
            seen = ours.logps.get(key) or ours.old_logps.get(key)
            if seen is None:  # masked entirely (a truncated completion under `mask_truncated_completions`)
                continue
            if absolute_positions and len(prompt) < width:  # left-padded (above)
                padded += 1
                continue
            want = seen[0]
            got = torch.tensor(lp, dtype=want.dtype)
            _close(got, want, max(1.0, want.abs().max().item()),
                   f"sampling log-probs of the rollout at step {step}, row {tuple(prompt)} -> {tuple(ids)}")
            checked += 1
    assert checked or padded or not ours.logps or all(s[2][1] is None for s in sampled), "no sampled row was checked"


def _close(got: torch.Tensor, want: torch.Tensor, scale: float, what: str) -> None:
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    # a zero (or vanishing) reference, e.g. the KL term's gradient at the reference weights, exactly 0 only where
    # both forwards round alike: compared to 1e-2 (gradients of these models are of order 0.1 to 1). With the policy's
    # log-probs from the shared-prefix forward and the reference model's from TRL's padded one, `policy - ref` is a
    # float32 rounding (an ulp of a log-prob near -4.6: 5e-7), and the KL term's gradient `beta * (1 - exp(ref -
    # policy)) * grad log p` is of that order: 4.3e-7 on `embed_tokens` where TRL's is exactly 0 (beta 0.5, rewards
    # of zero spread), over the 3e-7 a floor of 1e-3 allowed
    scale = max(scale, 1e-2)
    assert diff <= REL * scale, f"{what}: max |diff| {diff:.3g} > {REL:g} x {scale:.3g}"


def compare(ours: Run, ref: Run) -> None:
    a, b = ours.capture.grads, ref.capture.grads
    assert len(a) == len(b) > 0, (len(a), len(b))
    # log-probs of every row of every step's loss forward
    if not ref.logps:  # every completion masked (e.g. all truncated under `mask_truncated_completions`)
        assert not ours.logps, "ours ran loss forwards on rows TRL masked entirely"
    missing = [k for k in ref.logps if k not in ours.logps]
    assert not missing, f"{len(missing)} rows of TRL's loss forward never ran in ours, e.g. {missing[0]}"
    for key, (want, want_ent) in ref.logps.items():
        got, got_ent = ours.logps[key]
        _close(got, want, max(1.0, want.abs().max().item()), f"log-probs of step {key[0]} row {key[1:]}")
        assert (got_ent is None) == (want_ent is None), "entropies computed in one trainer only"
        if want_ent is not None:
            _close(got_ent, want_ent, max(1.0, want_ent.abs().max().item()), f"entropies of step {key[0]}")
    for step, (got, want) in enumerate(zip(a, b)):
        assert got.keys() == want.keys() and want, (sorted(set(got) ^ set(want)))
        scale = max(g.abs().max().item() for g in want.values())
        for name in want:
            _close(got[name], want[name], scale, f"gradient of {name} at step {step}")
    params = dict(ref.trainer.model.named_parameters())
    scale = max(p.abs().max().item() for p in params.values())
    for name, p in ours.trainer.model.named_parameters():
        _close(p.detach(), params[name].detach(), scale, f"weight {name} after training")
    compare_metrics(ours.trainer.state.log_history, ref.trainer.state.log_history)


def compare_metrics(got: list[dict], want: list[dict], skip: tuple[str, ...] = ()) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want)):
        for key, value in w.items():
            if any(t in key for t in TIMING_KEYS) or key in skip or not isinstance(value, (int, float)):
                continue
            assert key in g, f"metric {key} missing at log {step}"
            x = g[key]
            assert isinstance(x, (int, float)), f"metric {key} at log {step}: {x} vs {value}"
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(x), f"metric {key} at log {step}: {x} vs NaN"
                continue
            assert abs(x - value) <= ABS_METRIC + REL_METRIC * abs(value), f"metric {key} at log {step}: {x} vs {value}"
