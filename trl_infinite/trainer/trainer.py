"""`InfiniteGRPOTrainer`: TRL's `GRPOTrainer` with the rollout engine behind `_generate_single_turn`, streamed
rewards and length-bucketed micro batches for the backward pass. Everything else is TRL's."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from accelerate.utils import gather
from tqdm.auto import tqdm
from trl import GRPOTrainer
from trl.chat_template_utils import parse_response
from trl.data_utils import is_conversational
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from ..engine import RolloutEngine
from ..engine.support import check_structure
from .backprop import make_micro_batches
from .config import engine_config_from_args
from .rollout import check_generation_kwargs, generate_rows, rollout_metrics, rollout_seed, sampling_params
from .scoring import BatchScorer
from .streaming import StreamingRewards

logger = logging.getLogger(__name__)


class InfiniteGRPOTrainer(GRPOTrainer):
    """Drop-in `GRPOTrainer`: same arguments, same reward functions, PEFT, accelerate and logging.

    - Rollouts run on the trained weights (unwrapped like TRL does, no copy, no weight sync) through a
      `RolloutEngine` whose KV pool is allocated once from the `rollout_*` budget of `InfiniteGRPOConfig`.
    - Reward functions score completions on a worker thread as they finish; TRL's group normalisation runs once
      all G are in.
    - The backward pass runs on micro batches of similar-length completions, each padded to its own longest.
    With `use_vllm=True` or `use_transformers_paged=True` generation is TRL's own (only the last two points remain).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine_config = engine_config_from_args(self.args)
        if self.uses_engine:
            check_generation_kwargs(self.args.generation_kwargs)
            check_structure(self.model)  # hybrids / SSMs refused now; the full contract runs when the engine is built
        self._engine: RolloutEngine | None = None
        self._rollout_calls = 0
        self._reward_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-infinite-rewards")
        self._batch_inputs: list[dict] | None = None
        self._batch_prompts: list | None = None
        self._stream: StreamingRewards | None = None

    @property
    def uses_engine(self) -> bool:
        return not (self.use_vllm or self.use_transformers_continuous_batching)

    # ------------------------------------------------------------------ generation
    def _generate_and_score_completions(self, inputs):
        self._batch_inputs = inputs
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._batch_inputs = self._batch_prompts = self._stream = None

    def _generate(self, prompts: list):
        self._batch_prompts = prompts
        return super()._generate(prompts)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Engine rollout for rows that hold each prompt `num_generations` times in a row (TRL's layout); the tool
        loop re-enters with one row per sample and `num_generations=1`. Returns (completion ids cut after the first
        EOS, sampling log-probs of the processed distribution), both in row order."""
        if not self.uses_engine:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if (images is not None and any(images)) or multimodal_fields:
            raise ValueError("The rollout engine generates text only; set `use_vllm=True` for multimodal prompts.")
        stream, scorer = self._start_stream(prompt_ids)
        self._rollout_calls += 1
        seed = rollout_seed(self.args.seed, self.accelerator.process_index, self._rollout_calls)
        sampling = sampling_params(self.args, self.eos_token_ids, self.args.generation_kwargs, seed)
        bar = tqdm(
            total=len(prompt_ids), desc="rollout", unit="sample", leave=False,
            disable=self.args.disable_tqdm or not self.accelerator.is_local_main_process,
        )

        def on_row_finished(row: int, ids: list[int]) -> None:
            bar.update(1)
            if stream is not None:
                scorer.completion_ids[row] = ids
                stream.add(row, ids)

        try:
            with profiling_context(self, "rollout_engine.generate"), self._generation_model() as model:
                engine = self._get_engine(model)
                completions, logprobs, stats = generate_rows(engine, prompt_ids, sampling, on_row_finished)
        finally:
            bar.close()
        if stream is not None:
            stream.flush()
        mode = "train" if self.model.training else "eval"
        for s in stats:
            for key, value in rollout_metrics(s).items():
                self._metrics[mode][key].append(value)
        return completions, logprobs

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

    def _get_engine(self, model: torch.nn.Module) -> RolloutEngine:
        """One engine per process, built on first use; its KV pool is allocated once and reused."""
        if self._engine is None or self._engine.model is not model:
            self._engine = RolloutEngine(model, self.engine_config)
        return self._engine

    # ------------------------------------------------------------------ streamed rewards
    def _streamable(self, prompt_ids: list) -> bool:
        return (
            self._batch_inputs is not None
            and self._batch_prompts is not None
            and self._stream is None  # the first turn only; tool-loop re-entries are scored at the end
            and len(prompt_ids) == len(self._batch_prompts)
            and not self.tools
            and self.rollout_func is None
            and getattr(self, "environment_factories", None) is None
        )

    def _start_stream(self, prompt_ids: list) -> tuple[StreamingRewards | None, BatchScorer | None]:
        if not self._streamable(prompt_ids):
            return None, None
        prompts = self._batch_prompts

        def decode(row: int, ids: list[int]):
            return self._decode_completion(prompts[row], prompt_ids[row], ids)

        scorer = BatchScorer(self, self._batch_inputs, prompts, decode)
        chunk = self.engine_config.max_active_sequences or self.num_generations
        self._stream = StreamingRewards(
            len(prompt_ids), len(self.reward_funcs), scorer.score, chunk, self._reward_executor
        )
        return self._stream, scorer

    def _decode_completion(self, prompt, prompt_ids: list[int], ids: list[int]):
        """One completion as TRL's `_generate` decodes it (text, or an assistant message for chat prompts)."""
        if not is_conversational({"prompt": prompt}):
            return self.processing_class.decode(ids, skip_special_tokens=True)
        tok = self._tokenizer
        if getattr(tok, "response_template", None) is not None or getattr(tok, "response_schema", None) is not None:
            return [parse_response(tok, ids, prefix=prompt_ids, tools=self.tools)]
        return [{"role": "assistant", "content": self.processing_class.decode(ids, skip_special_tokens=True)}]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Rewards of every local row ([N, F], gathered across processes like TRL's): the streamed cache where it
        scored exactly these completions, the rest scored now."""
        n = len(prompts)
        stream = self._stream
        rewards = torch.full((n, len(self.reward_funcs)), float("nan"))
        extra: dict[str, list] = {}
        fresh = list(range(n))
        if stream is not None:
            stream.wait()
            ok = stream.matches(completion_ids_list)
            rewards, extra = stream.rewards.clone(), stream.extra_columns(n)
            fresh = [i for i in range(n) if not ok[i]]
        if fresh:
            scorer = BatchScorer(self, inputs, prompts, decode=lambda row, ids: completions[row])
            scorer.completion_ids = dict(enumerate(completion_ids_list))
            scorer.completions = dict(enumerate(completions))
            values, fresh_extra = scorer.score(fresh)
            rewards[fresh] = values
            for column, col_values in fresh_extra.items():
                full = extra.setdefault(column, [None] * n)
                for row, v in zip(fresh, col_values):
                    full[row] = v
        for column, values in extra.items():
            self._pending_extra_logs[column].extend(values)
        if torch.isnan(rewards).all(dim=1).any():
            row = int(torch.isnan(rewards).all(dim=1).nonzero()[0])
            logger.warning("All reward functions returned None for prompt %r, completion %r.", prompts[row],
                           completions[row])
        self._stream = None
        return gather(rewards.to(self.accelerator.device))

    # ------------------------------------------------------------------ micro-batched backprop
    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of one generation batch over `steps_per_generation` steps, but split into micro batches
        of similar-length completions, each padded only to its own longest sequence."""
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = split_pixel_values_by_grid(self._generate_and_score_completions(generation_batch))
            chunks = make_micro_batches(batch, self.args.steps_per_generation, self.loss_type, self.pad_to_multiple_of)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(c) for c in chunks]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]
