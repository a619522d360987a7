"""`RolloutEngine`: G completions per prompt over a bounded paged KV pool, each prompt prefilled once."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch

from trl_infinite.engine.call import RolloutCall, StepTimer, call_blocks, sampling_mode
from trl_infinite.engine.config.engine_config import EngineConfig, SamplingParams
from trl_infinite.engine.config.inputs import check_eos, check_prompts, check_request, model_vocab_size, text_config
from trl_infinite.engine.config.logits import GenerationProcessors
from trl_infinite.engine.decode.cuda_graphs import graphs_available
from trl_infinite.engine.decode.static import StaticDecoder, static_step_bytes
from trl_infinite.engine.decode.step import EagerStep, StepContext
from trl_infinite.engine.executor import ModelExecutor
from trl_infinite.engine.model.guard import model_guard
from trl_infinite.engine.model.support import build_runner, check_support
from trl_infinite.engine.outputs import RolloutResult, RolloutStats
from trl_infinite.engine.runner.autocast import autocast_dtype, describe, uncached_casts
from trl_infinite.engine.runner.eval_mode import eval_mode
from trl_infinite.engine.runner.length_model import length_regressor
from trl_infinite.engine.runner.sampler import Sampler
from trl_infinite.engine.runner.weight_copy import build_weight_copy
from trl_infinite.engine.runner.weight_state import WeightTracker
from trl_infinite.engine.sched.batch import NonFiniteLogitsError
from trl_infinite.engine.sched.block_manager import blocks_for, pool_size
from trl_infinite.engine.sched.history import PromptHistory, remember_visits
from trl_infinite.engine.sched.predictors.base import build_predictor
from trl_infinite.engine.sched.sequence import Group, Sequence, make_group

FinishCallback = Callable[[int, int, list[int]], None]


class RolloutEngine:
    """Generates `num_generations` completions for each prompt with the model's current weights (no copy kept across
    calls; float32 weights under 16-bit autocast run each call on a 16-bit copy of what autocast casts: `weight_copy`).

    Weight changes: what the engine derives from the weights (the prefix cache's KV, the weight copy) is kept across
    calls only within a run of `keep_pool=True` calls, or where `kv_cache_reuse_across_calls=True` declares that the
    caller reports every weight change with `reset_prefix_cache()` (`weight_state.py`).

    The KV pool is sized for each call within `config`'s budget (`kv_memory.py`). Construction first checks that the engine runs the model exactly (`support.check_support`) and raises
    `ValueError` naming the unsupported feature otherwise. `generate` runs the model in eval mode.

    Autocast: the engine runs the model under the autocast state it is built under (an enclosing `torch.autocast`,
    and/or one the model's `forward` enters itself, as accelerate's mixed precision does), detected by the support
    probe inside the forward (`autocast.py`): the KV pool is allocated in the autocast dtype (`pool.dtype`), the
    exactness check runs and is judged in it, and `generate` must be called under the same enclosing autocast state
    as the constructor (`ValueError` otherwise).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None):
        self.model = model
        self.config = config or EngineConfig()
        # when the prefix cache and the weight copy were computed with weights that may have changed since
        self.weights = WeightTracker(model, self.config.kv_cache.reuse_across_calls)
        self.device = next(model.parameters()).device
        self.autocast = autocast_dtype(self.device.type)  # the enclosing state every `generate` must match
        decode = self.config.decode
        with model_guard(model, "RolloutEngine(model)"):  # the probe switches attention and mode for a moment
            self.support = check_support(model, decode.attention_backend, decode.cpu_decode_kernel)
            self.vocab_size = model_vocab_size(model)
            # float32 weights under 16-bit autocast: each call runs on a 16-bit copy of what autocast casts (at fixed
            # addresses where decode steps are captured, as the KV pool: `kv_memory.py`)
            stable = decode.cuda_graphs and graphs_available(self.device)
            self.weight_copy = build_weight_copy(model, decode.weight_copy, self.device, self.support.autocast,
                                                 self.vocab_size, stable)
        # the largest captured batch: the slot limit, or `cuda_graph_max_batch` where none bounds the batch
        # (`full_group`, `dynamic_slot`); its step's memory is reserved for the graphs' pool
        graph_rows = min(sampling_mode(self.config).slot_limit or decode.cuda_graph_max_batch, decode.cuda_graph_max_batch)
        graphs = self.device.type == "cuda" and decode.cuda_graphs
        self.graph_reserve = static_step_bytes(model.config, graph_rows) if graphs else 0
        # the speculator first: a draft model is checked like the model (`spec_decode/draft_check.py`) and its pool,
        # mirroring the target's blocks, is paid for by the same budget
        self.history = PromptHistory(self.config.history)  # per-prompt, across calls; `history.clear()` forgets it
        self.speculator = None
        if self.config.speculative.method is not None:
            from trl_infinite.engine.spec_decode import Speculator

            self.speculator = Speculator(self.config, self.device, history=self.history, target=model,
                                         target_support=self.support)
        draft_bytes = self.speculator.draft_block_bytes(self.config.block_size) if self.speculator is not None else 0
        self.lookahead = self.speculator.max_tokens if self.speculator is not None else 0  # draft slots per sample
        # sized for each call from what it needs (never above the budget) and released after it unless
        # `kv_cache_release=False` (`_generate`); at fixed addresses where decode steps are captured, so the graphs
        # outlive the release (`kv_memory.py`)
        self.runner = build_runner(model, self.config, self.support, reserve_bytes=self._reserve_bytes(),
                                   allocate=False, stable=stable, companion_block_bytes=draft_bytes)
        self.pool = self.runner.pool
        self.decoder = StaticDecoder(self.runner, compile=decode.compile, cuda_graphs=decode.cuda_graphs,
                                     compile_backend=decode.compile_backend, max_graph_rows=graph_rows)
        if self.decoder.use_graphs:  # a step that cannot be captured turns graphs off here, with a warning
            with torch.inference_mode(), eval_mode(model), uncached_casts(self.device.type):
                self.pool.open(1)  # the trial capture writes the null block of a one-block pool
                try:
                    self.decoder.check_capture()
                finally:
                    self.pool.release()
        self.max_model_len = getattr(text_config(model), "max_position_embeddings", None)
        # one length predictor per engine: it keeps learning from every call's finished samples
        self.predictor = build_predictor(self.config.scheduling, self.history, model_fn=length_regressor)

    # ------------------------------------------------------------------ validation
    def _check_inputs(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams,
                      forced_lengths: list[list[int]] | None) -> int:
        max_new = check_request(prompt_ids, num_generations, sampling.max_new_tokens, self.max_model_len, forced_lengths)
        check_eos(sampling.eos_token_ids, self.vocab_size)
        bs, pool_blocks = self.pool.block_size, self.pool.budget_blocks()
        for i, p in enumerate(prompt_ids):
            need = blocks_for(len(p), bs) + blocks_for(max_new + self.lookahead, bs)
            if need > pool_blocks:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens) plus one completion of up to {max_new} tokens needs {need} KV "
                    f"blocks of {bs} tokens but the pool holds {pool_blocks} (`kv_cache_tokens`="
                    f"{pool_blocks * bs}); raise `kv_cache_tokens`/`kv_cache_gb` or lower `max_new_tokens`."
                )
        return max_new

    def _check_autocast(self) -> None:
        now = autocast_dtype(self.device.type)
        if now != self.autocast:
            raise ValueError(
                f"`generate` is called {describe(now)}, but the engine was built {describe(self.autocast)} (its "
                f"exactness checked and its KV pool allocated in {str(self.pool.dtype).removeprefix('torch.')} "
                "there): call `generate` under the autocast state the engine was built under, or build a new engine "
                "under this one.")

    def _reserve_bytes(self) -> int:
        """Taken out of a `kv_cache_fraction` budget first: the captured step's memory and the weight copy's bytes
        not yet allocated (a held copy is no longer in the free memory the budget is read from)."""
        return self.graph_reserve + (self.weight_copy.pending_bytes if self.weight_copy is not None else 0)

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompt_ids: list[list[int]],
        num_generations: int = 1,
        sampling: SamplingParams | None = None,
        forced_lengths: list[list[int]] | None = None,
        on_sample_finished: FinishCallback | None = None,
        on_decode_step: StepTimer | None = None,
        keep_pool: bool = False,
    ) -> RolloutResult:
        """G completions per prompt, prompt-major. `forced_lengths[i][j]` (benchmarks) fixes sample j of prompt i
        to exactly that many tokens, EOS ignored. `on_sample_finished(prompt_idx, sample_idx, completion_ids)` is
        called as each sample finishes, while the others keep decoding. `on_decode_step(batch, seconds)`
        (benchmarks, profiling) is called after every step that ran a decode forward, with the step's
        `ScheduledBatch` (its samples still as they were before the step's tokens were appended) and the
        wall seconds of the step's execution (prefill of the step's prompts included, if any; on CUDA up to the
        tokens' read-back, so the device work is included).

        `prompt_ids`: a list of token-id lists (a 2D integer tensor / array is converted); ids must lie in
        [0, vocab). The model runs in eval mode for the call and gets its previous mode (and its own attention
        implementation) back afterwards, on every exit path, errors and `KeyboardInterrupt` included; the call's KV
        blocks and per-call tables are released at once then too.

        One call per model at a time (`model_guard`): a call from another thread waits for the running one; a call
        from inside a running one (a callback) raises `RuntimeError`. Logits that are not finite raise
        `NonFiniteLogitsError` naming the step and the sample.

        `keep_pool=True`: keep the KV pool, and the prefix cache in it, after this call even under
        `kv_cache_release=True`, because a related call follows (the next turn of a tool loop, the next batch of one
        rollout): each finished sample's completion is cached too, so a next turn that continues it prefills only
        its new tokens. The caller ends such a run with `release_pool()`; the weights must not change within it
        (`reset_prefix_cache()` if they do). Across other calls the cache (kept by `kv_cache_release=False`) is
        reused only under `kv_cache_reuse_across_calls=True`, whose caller reports each weight change with
        `reset_prefix_cache()`."""
        sampling = SamplingParams.of(sampling)
        self._check_autocast()
        self.pool.reserve_bytes = self._reserve_bytes()
        prompt_ids = check_prompts(prompt_ids, self.vocab_size)
        max_new = self._check_inputs(prompt_ids, num_generations, sampling, forced_lengths)
        processors = GenerationProcessors.for_call(self.model, sampling, self.device, max_new,
                                                   [len(p) for p in prompt_ids], self.vocab_size)
        draft = self.speculator.draft_model if self.speculator is not None else None  # held with the model
        with model_guard(self.model, also=draft), torch.inference_mode(), eval_mode(self.model), \
                uncached_casts(self.device.type):
            return self._generate(prompt_ids, num_generations, sampling, max_new, forced_lengths, on_sample_finished,
                                  on_decode_step, keep_pool, processors)

    def release_pool(self) -> None:
        """End of a run of `keep_pool=True` calls: release the pool (and its cached prefixes) as `kv_cache_release`
        asks; with `kv_cache_release=False` the pool is kept (and the cache, for the next call only under
        `kv_cache_reuse_across_calls=True`)."""
        self.weights.end_run()
        if self.config.kv_cache.release:
            self.pool.release()
            self._release_weight_copy()

    def _release_weight_copy(self) -> None:
        if self.weight_copy is not None:
            self.weight_copy.release()

    def reset_prefix_cache(self) -> None:
        """The model's weights changed (an optimizer step, a weight load, an in-place edit, an adapter switch): the
        next call drops every cached prefix and refreshes the 16-bit weight copy, whose values came from the old
        weights. As vLLM's `LLM.reset_prefix_cache()` (SGLang's `flush_cache()`) after a weight update; needed only
        with `kv_cache_reuse_across_calls=True` (otherwise nothing derived from the weights outlives a call outside
        a `keep_pool=True` run), or within such a run. Cheap: nothing is freed or recomputed until the next call."""
        self.weights.changed()

    def _generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams, max_new: int,
                  forced_lengths: list[list[int]] | None, on_sample_finished: FinishCallback | None,
                  on_decode_step: StepTimer | None = None, keep_pool: bool = False,
                  processors: GenerationProcessors | None = None) -> RolloutResult:
        """The body of `generate` on validated inputs, with the model in eval mode, in inference mode (no autograd
        bookkeeping: several percent of a host-bound step)."""
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        eos = frozenset(sampling.eos_token_ids)
        groups = [make_group(i, p, num_generations, max_new, eos, forced_lengths[i] if forced_lengths else None)
                  for i, p in enumerate(prompt_ids)]
        keep = keep_pool or not self.config.kv_cache.release
        try:
            if self.weights.begin_call():  # the weights may have changed: nothing computed from them is valid
                self.pool.drop_cache()
                if self.weight_copy is not None:
                    self.weight_copy.invalidate()
            self.pool.open(pool_size(call_blocks(self.config, groups, max_new, self.lookahead)))
            with self.weight_copy.active() if self.weight_copy is not None else nullcontext():
                result = self._run_call(groups, sampling, max_new, start, on_sample_finished, on_decode_step, keep,
                                        processors)
            self.weights.end_call(keep_pool)
            return result
        finally:
            if not keep:
                self.pool.release()
                self._release_weight_copy()

    def _run_call(self, groups, sampling, max_new, start, on_sample_finished, on_decode_step,
                  keep: bool, processors: GenerationProcessors | None = None) -> RolloutResult:
        executors = partial(self._executor, sampling=sampling, groups=groups, max_new=max_new, processors=processors)
        call = RolloutCall.build(self.config, groups, self.pool.allocator, self.predictor, executors,
                                 cache_completions=keep)
        finished = None
        if on_sample_finished is not None:
            def finished(seq: Sequence) -> None:
                on_sample_finished(seq.group_id, seq.sample_idx, list(seq.output_ids))
        ended = False
        try:
            call.run(on_finished=finished, on_decode_step=on_decode_step)
            if self.pool.allocator.num_used:  # every sample finished: each block must have been given back
                raise RuntimeError(f"{self.pool.allocator.num_used} KV blocks still held after every sample "
                                   "finished (scheduler bug).")
            ended = True
        except NonFiniteLogitsError:
            self.pool.zero()  # NaN K/V left in blocks would leak into later calls through masked reads (0 * NaN)
            raise
        finally:  # also on error / KeyboardInterrupt: nothing of this call stays held until the next one
            call.executor.close()
            self.decoder.end()
            self.pool.reset(keep_cache=ended)  # an interrupted call's registered blocks may never have been written
            self.predictor.end_call()
        self._fill_stats(call.stats, start)
        remember_visits(self.history, groups)
        seqs = [s for g in groups for s in g.samples]
        return RolloutResult(
            completion_ids=[s.output_ids for s in seqs],
            logprobs=[s.logprobs for s in seqs],
            stats=call.stats,
            finish_reasons=[s.finish_reason for s in seqs],
            raw_logprobs=[s.raw_logprobs for s in seqs] if sampling.raw_logprobs_temperature is not None else None,
        )

    # ------------------------------------------------------------------ helpers
    def _executor(self, call: RolloutCall, sampling: SamplingParams, groups: list[Group], max_new: int,
                  processors: GenerationProcessors | None = None) -> ModelExecutor:
        """The engine's executor factory (`call.py`): the model executor of `call`."""
        sampler = Sampler(sampling, processors)
        decoder = None if sampler.has_extra_processors else self.decoder  # extra processors: the eager step
        self.runner.refresh_rows()  # the row counts this call's forwards run at, for the current thread count
        ctx = StepContext(self.runner, sampler, sampling.seed, call.stats, self.config.max_prefill_tokens, decoder,
                          call.hidden_predictor)
        if decoder is not None:
            bs, slots = self.pool.block_size, call.mode.slot_limit or sum(g.num_generations for g in groups)
            decoder.begin(ctx, capacity=min(slots, self.pool.num_blocks),
                          prompt_blocks=max(blocks_for(g.prompt_len, bs) for g in groups),
                          own_blocks=blocks_for(max_new + self.lookahead, bs))
        step = self.speculator.begin(ctx, sampling) if self.speculator is not None else decoder or EagerStep(ctx)
        return ModelExecutor(ctx, step)

    def _fill_stats(self, stats: RolloutStats, start: float) -> None:
        """The engine's own counters (the scheduler's were recorded by `drive`)."""
        stats.kv_block_bytes = self.pool.block_bytes
        stats.weight_copy_bytes = self.weight_copy.nbytes if self.weight_copy is not None else 0
        if self.predictor.mae is not None:
            stats.extra["length_prediction_mae"] = self.predictor.mae
        graph_memory = self.decoder.graph_memory()
        if graph_memory.reserved:
            stats.extra["cuda_graph_bytes"] = graph_memory.reserved
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # replays reuse the graphs' pool without allocating: its part not held by live tensors is added
            stats.peak_memory_bytes = torch.cuda.max_memory_allocated(self.device) + graph_memory.unaccounted
        stats.wall_time_s = time.perf_counter() - start
