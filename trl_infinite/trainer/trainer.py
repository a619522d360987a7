"""`InfiniteGRPOTrainer`: TRL's `GRPOTrainer` with the rollout engine behind `_generate_single_turn`, streamed
rewards and length-bucketed micro batches for the backward pass. Everything else is TRL's."""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer

from trl_infinite.engine import RolloutEngine
from trl_infinite.engine.model.support import UnsupportedModelError, check_structure
from trl_infinite.engine.runner import host_memory
from trl_infinite.trainer.config import engine_config_from_args
from trl_infinite.trainer.full_weights import rollout_weights, trl_summon_skipped
from trl_infinite.trainer.generation_config import engine_fallback_reasons
from trl_infinite.trainer.logprobs import HeadSpec
from trl_infinite.trainer.loss_metrics import TrlSetMetrics
from trl_infinite.trainer.loss_slices import micro_batch_loss
from trl_infinite.trainer.micro_batches import buffer_micro_batches
from trl_infinite.trainer.packing import pack_rows
from trl_infinite.trainer.positions import length_dependent_rope
from trl_infinite.trainer.recompute import RecomputePolicy
from trl_infinite.trainer.rollout import RolloutSeeds, engine_rollout
from trl_infinite.trainer.shared_prefix import SharedPrefixForward, SharedPrefixUnsupported
from trl_infinite.trainer.stochastic import random_training_forward, warning_text
from trl_infinite.trainer.streamed_rewards import StreamSlot, wrap_reward_funcs
from trl_infinite.trainer.weight_events import WeightEvents


class InfiniteGRPOTrainer(GRPOTrainer):
    """Drop-in `GRPOTrainer`: same arguments, same reward functions, PEFT, accelerate and logging.

    - Rollouts run on the trained weights (unwrapped like TRL does, no copy, no weight sync) through a
      `RolloutEngine` whose KV pool is allocated once from the `rollout_*` budget of `InfiniteGRPOConfig`, with the
      `GenerationConfig` `generate` would use (every sampling key, through transformers' own logits processors).
    - Reward functions score completions as they finish, between decode steps on the calling thread (or on a
      background thread with `rollout_reward_executor="thread"`); TRL's own `_calculate_rewards` then reads them.
    - The backward pass runs on micro batches of similar-length completions, each padded to its own longest
      (TRL's own micro batches and forward where the training forward is random, e.g. dropout: `stochastic.py`).
    - Under FSDP1 / FSDP2 each rollout runs on the full weights, gathered once for it and resharded after it
      (`full_weights.py`).
    With `use_vllm=True`, `use_transformers_paged=True`, `generation_kwargs` the engine cannot run (beam search, ...),
    PEFT prompt learning or ZeRO-3 with `ds3_gather_for_generation=False`, generation is TRL's own (one warning says
    why); the last point still applies.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # FSDP1 switches a module's parameters between views of its gathered and its sharded storage at every
        # forward, which would undo the 16-bit weight copy's swap: the engine runs on the weights as FSDP gives them
        fsdp1 = getattr(self._dist, "fsdp_version", None) == 1
        self.engine_config = engine_config_from_args(self.args, **({"weight_copy": "off"} if fsdp1 else {}))
        self._engine: RolloutEngine | None = None
        # optimizer steps and weight loads reach the engine (its cache across rollouts: `weight_events.py`)
        self._weight_events = WeightEvents(self.reset_prefix_cache)
        self.add_callback(self._weight_events)
        if self.optimizer is not None:  # given through `optimizers=`
            self._weight_events.hook_optimizer(self.optimizer)
        self._rollout_seeds = RolloutSeeds()
        thread = getattr(self.args, "rollout_reward_executor", "main_thread") == "thread"
        self._stream_slot = StreamSlot(
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-infinite-rewards") if thread else None)
        self.reward_funcs = wrap_reward_funcs(self.reward_funcs, self._stream_slot)
        self._rollout_turn: int | None = None  # engine calls so far in the running `_generate` (None: outside)
        self._weights_gathered = False  # inside a rollout's gathered-weights window (`full_weights.py`)
        self.engine_fallback_reasons: list[str] = []
        if not (self.use_vllm or self.use_transformers_continuous_batching):
            self.engine_fallback_reasons = engine_fallback_reasons(
                self.model, self.generation_config, self._dist, self.args.ds3_gather_for_generation
            )
        if self.uses_engine:
            try:  # hybrids / SSMs are known now; the full contract runs when the engine is built
                check_structure(self.model)
            except UnsupportedModelError as err:
                self.engine_fallback_reasons.append(str(err))
        if self.engine_fallback_reasons:
            self._warn_fallback(stacklevel=3)
        self.host_tensor_cache = self._install_host_tensor_cache()
        self.length_dependent_rope = length_dependent_rope(self.model)  # micro batches keep every column then
        self._trl_sets: TrlSetMetrics | None = None  # TRL's per-micro-batch metrics of the pass (`loss_metrics.py`)
        self._forward_rows: tuple | None = None  # a forward's rows for TRL's next loss call on them (`loss_slices.py`)
        self.recompute = RecomputePolicy(getattr(self.args, "activation_memory_gb", None))
        self.shared_prefix: SharedPrefixForward | None = None
        self.shared_prefix_reason: str | None = None  # why the training forward is TRL's, if it is
        # the probes' forwards leave the global generator as `GRPOTrainer.__init__` left it (dropout masks, TRL's
        # random split and its `generate` draw from it)
        device = self.accelerator.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            # why the training forward is random (dropout, router noise), if it is: TRL's micro batches then
            self.random_forward = random_training_forward(self.model)
            if self.random_forward is not None:
                warnings.warn(warning_text(self.random_forward), UserWarning, stacklevel=2)
            if getattr(self.args, "shared_prefix_training", False):
                self._install_shared_prefix()

    def _install_host_tensor_cache(self) -> bool:
        """Training on CPU: large CPU tensors from the caching allocator of `engine/runner/host_memory.py`
        (`host_tensor_cache_mb`), so the step's resident memory follows its live tensors."""
        limit = getattr(self.args, "host_tensor_cache_mb", None)
        if limit is None or self.accelerator.device.type != "cpu":
            return False
        return host_memory.install(int(limit) << 20)

    def _install_shared_prefix(self) -> None:
        """The shared-prefix training forward on the policy (the module TRL gave its fused LM head), if the model
        passes its support contract; otherwise TRL's forward, with one warning naming why."""
        target = self.model.get_base_model() if is_peft_model(self.model) else self.model
        head = HeadSpec.from_model(target, self.temperature, self.args.cast_lm_head_to_fp32)
        try:
            if self.trl_forward is not None:
                raise SharedPrefixUnsupported(self.trl_forward)
            self.shared_prefix = SharedPrefixForward.install(target, head, autocast=self.accelerator.autocast,
                                                             outer=self.model)
        except SharedPrefixUnsupported as err:
            self.shared_prefix_reason = str(err)
            warnings.warn(
                f"InfiniteGRPOTrainer trains with TRL's padded forward (each prompt encoded once per completion) "
                f"instead of the shared-prefix forward: {err}.", UserWarning, stacklevel=4,
            )

    def _warn_fallback(self, stacklevel: int) -> None:
        reasons = "; ".join(r.rstrip(". ") for r in self.engine_fallback_reasons)
        warnings.warn(
            "InfiniteGRPOTrainer generates with TRL's own path (transformers `generate`, rewards scored after "
            f"generation) instead of the rollout engine for the rest of this run: {reasons}.",
            UserWarning,
            stacklevel=stacklevel,
        )

    @property
    def uses_engine(self) -> bool:
        return not (self.use_vllm or self.use_transformers_continuous_batching or self.engine_fallback_reasons)

    # ------------------------------------------------------------------ generation
    def _generate_and_score_completions(self, inputs):
        self._stream_slot.inputs = inputs
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._stream_slot.close()

    def _generate(self, prompts: list):
        """TRL's `_generate` (first turn, tool loop or `environment_factory` turns, or the user's `rollout_func`),
        one rollout: with tools, environments or a `rollout_func`, every engine call in it keeps the KV pool, its
        prefix cache and its finished completions for the next (a turn prefills only the tokens it adds to the
        conversation); released at the end as `rollout_kv_cache_release` says. The cache outlives the rollout only
        under `rollout_kv_cache_reuse_across_calls=True`, never an optimizer step or a weight load
        (`weight_events.py`)."""
        self._stream_slot.prompts = prompts
        self._rollout_turn = 0
        # under FSDP the engine runs on the full weights, gathered once for the rollout (`full_weights.py`)
        gather = self.uses_engine and getattr(self, "_dist", None) is not None
        with rollout_weights(self.model_wrapped, self._dist.fsdp_version if gather else None):
            self._weights_gathered = gather
            try:
                return super()._generate(prompts)
            finally:
                self._weights_gathered = False
                self._rollout_turn = None
                engine = getattr(self, "_engine", None)  # (TRL's tests build trainers without `__init__`)
                if engine is not None:
                    engine.release_pool()  # before the weights are resharded
                if getattr(self, "host_tensor_cache", False):
                    host_memory.trim()  # the rollout's freed blocks, before the loss's forward and backward

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Engine rollout for rows that hold each prompt `num_generations` times in a row (TRL's layout); the tool
        loop re-enters with one row per sample and `num_generations=1`. Returns (completion ids cut after the first
        EOS, sampling log-probs in TRL's convention: `log_softmax(logits / temperature)` of the sampled token, as TRL's
        own `per_token_logps`, with no top-k / top-p / min-p truncation or penalty), both in row order."""
        if not self.uses_engine:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if (images is not None and any(images)) or multimodal_fields:
            raise ValueError("The rollout engine generates text only; set `use_vllm=True` for multimodal prompts.")
        try:
            return engine_rollout(self, prompt_ids, num_generations)
        except UnsupportedModelError as err:  # the full support contract failed: TRL's own (exact) generation
            self._stream_slot.stream = None  # nothing was generated: TRL's path scores the batch after generation
            self.engine_fallback_reasons.append(str(err))
            self._warn_fallback(stacklevel=2)
            with trl_summon_skipped(self):  # inside the rollout's gathered window
                return self._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                  has_tool_images)

    def reset_prefix_cache(self) -> None:
        """The policy's weights changed (an optimizer step, a weight load: reported by the trainer itself; call it
        after changing them otherwise, e.g. in a callback): nothing the engine computed from them is reused
        (`weight_events.py`)."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.reset_prefix_cache()

    def create_optimizer(self, *args, **kwargs):  # transformers < 5.x's takes no `model`
        optimizer = super().create_optimizer(*args, **kwargs)
        events = getattr(self, "_weight_events", None)
        if events is not None:
            events.hook_optimizer(optimizer)
        return optimizer

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self.reset_prefix_cache()

    def _load_best_model(self):
        super()._load_best_model()
        self.reset_prefix_cache()

    def _get_engine(self, model: torch.nn.Module) -> RolloutEngine:
        """One engine per process, built on first use; its KV pool is allocated once and reused. A different module
        object (a re-wrapped model) gets a new engine, so nothing built on the old one's parameters survives."""
        if self._engine is None or self._engine.model is not model:
            self._engine = RolloutEngine(model, self.engine_config)
        return self._engine

    # ------------------------------------------------------------------ training forward
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's per-token log-probs and entropies of the completion tokens ([B, C], zero where masked), from the
        shared-prefix forward when it is installed on this model and the batch is text in TRL's layout; TRL's
        own forward otherwise (multimodal inputs, the MoE auxiliary loss, the reference model). Inside
        `_loss_pieces`: the rows of the micro batch's forward that TRL's loss call is given."""
        rows = getattr(self, "_forward_rows", None)
        if rows is not None:
            self._forward_rows = None
            return rows
        forward = self.shared_prefix
        layout = None
        if (forward is not None and not compute_aux_loss and all(v is None for v in multimodal.values())
                and self._policy_module(model) is forward.model):
            layout = pack_rows(input_ids, attention_mask, logits_to_keep)
        if layout is None or isinstance(layout, str):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )
        with self.accelerator.autocast():
            out = model(prefix_groups=forward.context(layout, entropy=compute_entropy))
        return out.log_probs, (out.entropy if compute_entropy else None), None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss; a training micro batch above `backward_token_budget` tokens runs as slices whose weighted
        losses are backpropagated one by one, so the gradient and the returned value are the micro batch's and its
        activations never coexist; a micro batch holding rows of several of TRL's micro batches runs TRL's loss on
        each one's rows, so its metrics are composed over TRL's micro batches (`loss_slices.py`)."""
        return micro_batch_loss(self, super().compute_loss, model, inputs, return_outputs, num_items_in_batch)

    def _policy_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The causal LM under `model`'s wrappers (DDP / FSDP / DeepSpeed, then PEFT)."""
        inner = self.accelerator.unwrap_model(model)
        return inner.get_base_model() if is_peft_model(inner) else inner

    # ------------------------------------------------------------------ micro-batched backprop
    @property
    def trl_forward(self) -> str | None:
        """Why the training forward must be `GRPOTrainer`'s own, bit for bit, if it must: its micro batches (TRL's
        random split, padded to the generation batch's widths), its padded forward, one backward per micro batch."""
        if self.random_forward is not None:
            return (f"its training forward is random ({self.random_forward}): the packed forward would draw other "
                    "dropout masks than TRL's padded forward; set `disable_dropout=True` or turn the noise off")
        if self.top_entropy_quantile < 1.0:
            return ("`top_entropy_quantile < 1` trains only the tokens whose entropy reaches a quantile of the micro "
                    "batch's entropies, a hard threshold: the rounding of any other forward (trimmed padding, packed "
                    "rows) moves tied entropies across it and trains other tokens than GRPOTrainer")
        return None

    @property
    def split_dependent_loss(self) -> bool:
        """A loss term that depends on which rows share a micro batch is on (the entropy bonus, a top-entropy
        quantile, the MoE auxiliary loss): the micro batches are then TRL's random split (`micro_batches.py`)."""
        return bool(getattr(self, "_entropy_bonus_enabled", False) or self.top_entropy_quantile < 1.0
                    or self.aux_loss_enabled)

    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of one generation batch over `steps_per_generation` steps, but split into micro batches
        of whole groups (shared-prefix forward) or of similar-length completions (TRL's random split where a loss
        term depends on it), each padded only to its own longest completion (`micro_batches.py`)."""
        if not self.model.training or self.trl_forward is not None:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            self._buffered_inputs = buffer_micro_batches(self, self._generate_and_score_completions(generation_batch))
        return self._buffered_inputs[self._step % self.args.steps_per_generation]
