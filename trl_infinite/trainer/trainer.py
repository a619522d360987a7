"""`InfiniteGRPOTrainer`: TRL's `GRPOTrainer` with the rollout engine behind `_generate_single_turn`, streamed
rewards and length-bucketed micro batches for the backward pass. Everything else is TRL's."""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import torch
from accelerate.utils import DistributedType, is_peft_model
from tqdm.auto import tqdm
from trl import GRPOTrainer
from trl.chat_template_utils import parse_response
from trl.data_utils import is_conversational
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from trl_infinite.engine import RolloutEngine
from trl_infinite.engine.model.support import UnsupportedModelError, check_structure
from trl_infinite.engine.runner import host_memory
from trl_infinite.trainer.backprop import SPLIT_INVARIANT_LOSSES, TRL_SET_KEY, make_micro_batches, permute_rows
from trl_infinite.trainer.cached_rewards import streamed_funcs, wrap_reward_funcs
from trl_infinite.trainer.config import engine_config_from_args
from trl_infinite.trainer.generation import (
    effective_generation_config,
    engine_fallback_reasons,
    engine_sampling_params,
)
from trl_infinite.trainer.logprobs import HeadSpec
from trl_infinite.trainer.packing import pack_rows
from trl_infinite.trainer.positions import length_dependent_rope
from trl_infinite.trainer.rollout import (
    PromptRun,
    RolloutSeeds,
    generate_rows,
    rollout_metrics,
    rollout_seed,
    trl_groups,
    turn_metrics,
)
from trl_infinite.trainer.scoring import ChunkScorer
from trl_infinite.trainer.shared_prefix import SharedPrefixForward, SharedPrefixUnsupported
from trl_infinite.trainer.stochastic import random_training_forward, warning_text
from trl_infinite.trainer.streaming import StreamingRewards, StreamSlot
from trl_infinite.trainer.sub_batches import (
    ROW_KEYS,
    SPLITTABLE_LOSSES,
    loss_weights,
    merge_metrics,
    metric_weights,
    num_parts,
    packed_tokens,
    slice_rows,
    split_inputs,
)
from trl_infinite.trainer.trl_sets import TrlSetMetrics, piece_rows, split_metrics_warning
from trl_infinite.trainer.weight_events import WeightEvents

# accelerate setups whose gradient sync the sub-batches' `no_sync` handles (DeepSpeed and FSDP count or shard
# backward passes themselves: one pass per micro batch there)
_SUB_BATCH_DISTRIBUTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
# the batch entries TRL's `_compute_loss` passes to the log-prob forward besides the ids and masks (row-aligned ones
# only reach `_loss_pieces`: batches with images use TRL's split)
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                 "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class InfiniteGRPOTrainer(GRPOTrainer):
    """Drop-in `GRPOTrainer`: same arguments, same reward functions, PEFT, accelerate and logging.

    - Rollouts run on the trained weights (unwrapped like TRL does, no copy, no weight sync) through a
      `RolloutEngine` whose KV pool is allocated once from the `rollout_*` budget of `InfiniteGRPOConfig`, with the
      `GenerationConfig` `generate` would use (every sampling key, through transformers' own logits processors).
    - Reward functions score completions as they finish, between decode steps on the calling thread (or on a
      background thread with `rollout_reward_executor="thread"`); TRL's own `_calculate_rewards` then reads them.
    - The backward pass runs on micro batches of similar-length completions, each padded to its own longest
      (TRL's own micro batches and forward where the training forward is random, e.g. dropout: `stochastic.py`).
    With `use_vllm=True`, `use_transformers_paged=True`, `generation_kwargs` the engine cannot run (beam search, ...)
    or PEFT prompt learning, generation is TRL's own (one warning says why); the last point still applies.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine_config = engine_config_from_args(self.args)
        self._engine: RolloutEngine | None = None
        # optimizer steps and weight loads reach the engine (its cache across rollouts: `weight_events.py`)
        self._weight_events = WeightEvents(self.reset_prefix_cache)
        self.add_callback(self._weight_events)
        if self.optimizer is not None:  # given through `optimizers=`
            self._weight_events.hook_optimizer(self.optimizer)
        self._rollout_seeds = RolloutSeeds()
        self._stream_slot = StreamSlot()
        self.reward_funcs = wrap_reward_funcs(self.reward_funcs, self._stream_slot)
        executor = getattr(self.args, "rollout_reward_executor", "main_thread")
        self._reward_executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-infinite-rewards") if executor == "thread"
            else None
        )
        self._batch_inputs: list[dict] | None = None
        self._batch_prompts: list | None = None
        self._rollout_turn: int | None = None  # engine calls so far in the running `_generate` (None: outside)
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
        self._trl_sets: TrlSetMetrics | None = None  # TRL's per-micro-batch metrics of the pass (`trl_sets.py`)
        self._forward_rows: tuple | None = None  # a forward's rows for TRL's next loss call on them (`trl_sets.py`)
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
            if self.random_forward is not None:
                raise SharedPrefixUnsupported(
                    f"its training forward is random ({self.random_forward}): the packed forward would draw other "
                    "dropout masks than TRL's padded forward; set `disable_dropout=True` or turn the noise off")
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
        self._batch_inputs = inputs
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._batch_inputs = self._batch_prompts = None
            self._stream_slot.close()

    def _generate(self, prompts: list):
        """TRL's `_generate` (first turn, tool loop or `environment_factory` turns, or the user's `rollout_func`),
        one rollout: with tools, environments or a `rollout_func`, every engine call in it keeps the KV pool, its
        prefix cache and its finished completions for the next (a turn prefills only the tokens it adds to the
        conversation); released at the end as `rollout_kv_cache_release` says. The cache outlives the rollout only
        under `rollout_kv_cache_reuse_across_calls=True`, never an optimizer step or a weight load
        (`weight_events.py`)."""
        self._batch_prompts = prompts
        self._rollout_turn = 0
        try:
            return super()._generate(prompts)
        finally:
            self._rollout_turn = None
            engine = getattr(self, "_engine", None)  # (TRL's tests build trainers without `__init__`)
            if engine is not None:
                engine.release_pool()
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
        groups = trl_groups(len(prompt_ids), num_generations, self.accelerator.process_index * len(prompt_ids))
        stream = self._start_stream(prompt_ids, groups)
        seed = self._rollout_seed()
        bar = tqdm(
            total=len(prompt_ids), desc="rollout", unit="sample", leave=False,
            disable=self.args.disable_tqdm or not self.accelerator.is_local_main_process,
        )

        def on_row_finished(row: int, ids: list[int]) -> None:  # on this thread, between two engine steps
            bar.update(1)
            if stream is not None:
                stream.add(row, ids)

        try:
            # under the autocast of TRL's training forwards (`accelerator.autocast()`: bf16 / fp16 mixed precision,
            # which the prepared model's `forward` also enters): the engine is built, checked and run under it
            with (profiling_context(self, "rollout_engine.generate"), self._generation_model() as model,
                  self.accelerator.autocast()):
                config = effective_generation_config(model, self.generation_config)
                sampling = engine_sampling_params(config, self.max_completion_length, self.eos_token_ids, seed,
                                                  logprobs_temperature=self.temperature)
                engine = self._get_engine(model)
                completions, logprobs, stats = generate_rows(engine, prompt_ids, sampling, groups, on_row_finished,
                                                             keep_pool=self._multi_turn)
        except UnsupportedModelError as err:  # the full support contract failed: TRL's own (exact) generation
            self._stream_slot.close()  # nothing was generated: TRL's path scores the batch after generation
            self.engine_fallback_reasons.append(str(err))
            self._warn_fallback(stacklevel=2)
            return self._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                              has_tool_images)
        finally:
            bar.close()
        if stream is not None:
            stream.flush()
        mode = "train" if self.model.training else "eval"
        for s in stats:
            metrics = rollout_metrics(s)
            if self._multi_turn:
                metrics.update(turn_metrics(s, self._rollout_turn))
            for key, value in metrics.items():
                self._metrics[mode][key].append(value)
        if self._rollout_turn is not None:
            self._rollout_turn += 1
        return completions, logprobs

    @property
    def _multi_turn(self) -> bool:
        """Inside a rollout that may call the engine again with conversations continuing this call's (TRL's tool
        loop, `environment_factory`, a `rollout_func`): the engine keeps its pool and caches the completions."""
        return getattr(self, "_rollout_turn", None) is not None and (
            bool(self.tools) or self.rollout_func is not None
            or getattr(self, "environment_factories", None) is not None)

    def _rollout_seed(self) -> int:
        """The engine's seed for this rollout, from checkpointed state (`rollout.RolloutKey`): a run resumed from a
        checkpoint samples what the uninterrupted run sampled."""
        mode = "train" if self.model.training else "eval"
        key = self._rollout_seeds.next_key(self.state.global_step, self._step % self.args.gradient_accumulation_steps,
                                           mode, self.accelerator.process_index)
        return rollout_seed(self.args.seed, key)

    @contextmanager
    def _generation_model(self):
        """The trained model, unwrapped (ZeRO-3 / FSDP parameters gathered) exactly as TRL does for `generate`,
        in eval mode (no dropout) for the duration of the rollout."""
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            was_training = model.training
            model.eval()
            try:
                yield model
            finally:
                model.train(was_training)

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

    # ------------------------------------------------------------------ streamed rewards
    def _streamable(self, prompt_ids: list) -> bool:
        return (
            self._batch_inputs is not None
            and self._batch_prompts is not None
            and self._stream_slot.get() is None  # the first turn only; tool-loop re-entries are scored at the end
            and len(prompt_ids) == len(self._batch_prompts)
            and not self.tools
            and self.rollout_func is None
            and getattr(self, "environment_factories", None) is None
            and bool(streamed_funcs(self.reward_funcs))
        )

    def _start_stream(self, prompt_ids: list, groups: list[PromptRun]) -> StreamingRewards | None:
        if not self._streamable(prompt_ids):
            return None
        prompts = self._batch_prompts

        def decode(row: int, ids: list[int]):
            return self._decode_completion(prompts[row], prompt_ids[row], ids)

        scorer = ChunkScorer(self, self._batch_inputs, prompts, decode, groups)
        chunk = self.engine_config.scheduling.max_active_sequences or self.num_generations
        if getattr(self.args, "rollout_reward_chunks", "groups") == "batch":
            chunk = len(prompt_ids)
        stream = StreamingRewards(len(prompt_ids), scorer.score, chunk, self._reward_executor,
                                  group_sizes=[g.length for g in groups])
        self._stream_slot.open(stream)
        return stream

    def _decode_completion(self, prompt, prompt_ids: list[int], ids: list[int]):
        """One completion as TRL's `_generate` decodes it (text, or an assistant message for chat prompts)."""
        if not is_conversational({"prompt": prompt}):
            return self.processing_class.decode(ids, skip_special_tokens=True)
        tok = self._tokenizer
        if getattr(tok, "response_template", None) is not None or getattr(tok, "response_schema", None) is not None:
            return [parse_response(tok, ids, prefix=prompt_ids, tools=self.tools)]
        return [{"role": "assistant", "content": self.processing_class.decode(ids, skip_special_tokens=True)}]

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
        losses are backpropagated one by one (all but the last here, under `no_sync`; the last by the caller), so
        the gradient and the returned value are the micro batch's and its activations never coexist
        (`sub_batches.py`); a micro batch holding rows of several of TRL's micro batches runs TRL's loss on each
        one's rows, so its metrics are composed over TRL's micro batches (`trl_sets.py`)."""
        sets = inputs.get(TRL_SET_KEY)
        if sets is not None:
            inputs = {k: v for k, v in inputs.items() if k != TRL_SET_KEY}
        slices = None if return_outputs else self._loss_slices(inputs)
        if slices is None and (sets is None or return_outputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        slices = slices or [slice(0, inputs["completion_mask"].shape[0])]
        parts = split_inputs(inputs, slices)
        weights = loss_weights(self.loss_type, parts)
        metrics = self._metrics["train"]
        before = {key: len(values) for key, values in metrics.items()}
        pieces: list[tuple[int | None, dict]] = []  # (TRL micro batch, inputs) of every TRL loss call, in order
        done = None
        for i, (part, weight, rows) in enumerate(zip(parts, weights, slices)):
            loss = self._loss_pieces(model, part, None if sets is None else sets[rows], num_items_in_batch,
                                     pieces) * weight
            if i == len(parts) - 1:
                break
            with self.accelerator.no_sync(model) if self.accelerator.sync_gradients else nullcontext():
                self.accelerator.backward(loss)
            if self.host_tensor_cache:  # the next slice's sizes differ: give this slice's freed blocks back
                host_memory.trim()
            done = loss.detach() if done is None else done + loss.detach()
        tokens, rows = metric_weights([p for _, p in pieces],
                                      lambda t: self.accelerator.reduce(t.to(self.accelerator.device),
                                                                        reduction="sum").cpu())
        one_column = inputs["completion_mask"].shape[1] == 1
        token_level = self.importance_sampling_level == "token"
        if sets is None or self._trl_sets is None:
            merge_metrics(metrics, before, tokens, rows, token_level=token_level, one_column=one_column)
        else:
            self._trl_sets.add(metrics, before, [s for s, _ in pieces], tokens, rows, int(sets.numel()))
            self._trl_sets.flush(metrics, one_column)
        return loss if done is None else loss + done

    def _loss_pieces(self, model, inputs: dict, sets: torch.Tensor | None, num_items_in_batch, pieces: list):
        """TRL's loss of `inputs` (rows of one micro batch): one call, or, where its rows belong to several of TRL's
        micro batches (`sets`), one forward and one TRL loss call on each one's rows, weighted to sum to the loss
        of `inputs` (`trl_sets.py`). Appends (TRL micro batch, inputs) of each call to `pieces`."""
        split = None if sets is None else piece_rows(sets)
        if split is None or len(split) == 1:
            pieces.append((None if split is None else split[0][0], inputs))
            return super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        logps, entropies, aux = self._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), inputs["completion_ids"].size(1),
            compute_entropy=True, compute_aux_loss=False, **{k: inputs.get(k) for k in _FORWARD_KEYS},
        )
        subs = [permute_rows(inputs, index) for _, index in split]
        total = None
        for (s, index), sub, weight in zip(split, subs, loss_weights(self.loss_type, subs)):
            self._forward_rows = (logps[index], entropies[index], aux)
            loss = super().compute_loss(model, sub, num_items_in_batch=num_items_in_batch) * weight
            total = loss if total is None else total + loss
            pieces.append((s, sub))
        return total

    def _loss_slices(self, inputs: dict) -> list[slice] | None:
        """The row slices of a training micro batch over `backward_token_budget` tokens (None: one pass)."""
        budget = getattr(self.args, "backward_token_budget", None)
        if (budget is None or self.random_forward is not None or not self.model.training or not torch.is_grad_enabled()
                or self.loss_type not in SPLITTABLE_LOSSES or self.split_dependent_loss
                or self.accelerator.distributed_type not in _SUB_BATCH_DISTRIBUTED):
            return None
        if any(isinstance(v, torch.Tensor) and v.ndim >= 1 and k not in ROW_KEYS
               and v.shape[0] != inputs["completion_mask"].shape[0] for k, v in inputs.items()):
            return None  # an entry not aligned with the rows (e.g. pixel values): one pass
        if self.shared_prefix is not None:
            costs = packed_tokens(inputs)
        else:
            width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
            costs = torch.full((inputs["completion_mask"].shape[0],), width)
        parts = num_parts(int(costs.sum()), budget, costs.numel())
        if self.accelerator.num_processes > 1:  # the same number of loss calls on every process
            parts = int(self.accelerator.gather(torch.tensor([parts], device=self.accelerator.device)).max())
            parts = min(parts, costs.numel())
        return slice_rows(costs, parts) if parts > 1 else None

    @staticmethod
    def _row_aligned(batch: dict, rows: int) -> bool:
        """Every tensor of the generation batch has one entry per row (not so: images' pixel values)."""
        flat = unsplit_pixel_values_by_grid(batch)
        return all(not (isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] != rows) for v in flat.values())

    def _warn_split_metrics(self) -> None:
        if not getattr(self, "_split_metrics_warned", False):
            self._split_metrics_warned = True
            warnings.warn(split_metrics_warning(self.accelerator.num_processes), UserWarning, stacklevel=3)

    def _policy_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The causal LM under `model`'s wrappers (DDP / FSDP / DeepSpeed, then PEFT)."""
        inner = self.accelerator.unwrap_model(model)
        return inner.get_base_model() if is_peft_model(inner) else inner

    # ------------------------------------------------------------------ micro-batched backprop
    @property
    def split_dependent_loss(self) -> bool:
        """A loss term that depends on which rows share a micro batch is on (the entropy bonus, a top-entropy
        quantile, the MoE auxiliary loss): the micro batches are then TRL's random split (`backprop.py`)."""
        return bool(getattr(self, "_entropy_bonus_enabled", False) or self.top_entropy_quantile < 1.0
                    or self.aux_loss_enabled)

    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of one generation batch over `steps_per_generation` steps, but split into micro batches
        of whole groups (shared-prefix forward) or of similar-length completions (TRL's random split where a loss
        term depends on it), each padded only to its own longest completion (`backprop.py`)."""
        if not self.model.training or self.random_forward is not None:  # (dropout: TRL's masks need TRL's split)
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = split_pixel_values_by_grid(self._generate_and_score_completions(generation_batch))
            spg = self.args.steps_per_generation
            rows = batch["completion_mask"].shape[0]
            # TRL's split where a loss term depends on it, where an optimizer step holds only part of a pass over the
            # generation batch (its rows are then TRL's step's rows), or with entries not aligned with the rows
            trl_split = (self.split_dependent_loss or self.args.gradient_accumulation_steps % spg != 0
                         or not self._row_aligned(batch, rows))
            tag = spg > 1 and self.accelerator.num_processes == 1
            chunks = make_micro_batches(batch, spg, self.loss_type, self.pad_to_multiple_of,
                                        by_group=self.shared_prefix is not None, trl_split=trl_split,
                                        trim=self.length_dependent_rope is None, tag_trl_sets=tag)
            if any(TRL_SET_KEY in c for c in chunks):
                self._trl_sets = TrlSetMetrics(spg, rows, self.importance_sampling_level == "token")
            elif spg > 1 and not trl_split and self.loss_type in SPLIT_INVARIANT_LOSSES:
                self._warn_split_metrics()
            self._buffered_inputs = [unsplit_pixel_values_by_grid(c) for c in chunks]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]
