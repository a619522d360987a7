"""`RolloutEngine`: G completions per prompt over a bounded paged KV pool, each prompt prefilled once."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .attention import Segment
from .block_manager import blocks_for
from .config import EngineConfig, SamplingParams
from .history import PromptHistory, remember_visits
from .kv_pool import KVCachePool
from .model_runner import ModelRunner, chunk_segments, last_rows
from .outputs import RolloutResult, RolloutStats
from .sampler import Sampler, row_keys
from .scheduler import ScheduledBatch, Scheduler
from .scheduling.factory import build_policies, build_predictor
from .sequence import Group, Sequence

FinishCallback = Callable[[int, int, list[int]], None]


class RolloutEngine:
    """Generates `num_generations` completions for each prompt with the model's current weights (no copy).

    The KV pool is allocated once, at construction, from `config`'s budget and reused by every `generate` call.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None):
        self.model = model
        self.config = config or EngineConfig()
        param = next(model.parameters())
        self.device = param.device
        self.pool = KVCachePool(model.config, self.config, dtype=param.dtype, device=self.device)
        self.runner = ModelRunner(model, self.pool, self.config.attention_backend)
        self.max_model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        # per-prompt history across calls (lengths, completions), this engine's only; `history.clear()` forgets it
        self.history = PromptHistory(
            self.config.history_max_prompts, self.config.history_max_visits, self.config.history_max_tokens
        )
        # one length predictor per engine: it keeps learning from every call's finished samples
        self.predictor = build_predictor(self.config.length_predictor, self.config.prefix_predictor_k, self.history,
                                         self.config.history_fallback)
        self.speculator = None
        if self.config.speculative_method is not None:
            from ..spec_decode import Speculator

            self.speculator = Speculator(self.config, self.device, self.config.block_size, history=self.history)

    # ------------------------------------------------------------------ validation
    def _check_inputs(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams) -> int:
        if not isinstance(num_generations, int) or num_generations < 1:
            raise ValueError(f"`num_generations` must be an integer >= 1, got {num_generations!r}.")
        if not prompt_ids:
            raise ValueError("`prompt_ids` must hold at least one prompt (a list of token-id lists).")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"`prompt_ids[{i}]` is empty: every prompt needs at least one token.")
        max_new = sampling.max_new_tokens
        if max_new is None:
            if self.max_model_len is None:
                raise ValueError("`max_new_tokens` is None and the model config has no `max_position_embeddings`.")
            max_new = self.max_model_len - max(len(p) for p in prompt_ids)
            if max_new < 1:
                raise ValueError("a prompt fills the model's `max_position_embeddings`: no room to generate.")
        bs, pool_blocks = self.config.block_size, self.pool.num_blocks
        for i, p in enumerate(prompt_ids):
            need = blocks_for(len(p), bs) + blocks_for(max_new + self._lookahead_cap(), bs)
            if need > pool_blocks:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens) plus one completion of up to {max_new} tokens needs {need} KV "
                    f"blocks of {bs} tokens but the pool holds {pool_blocks} (`kv_cache_tokens`="
                    f"{pool_blocks * bs}); raise `kv_cache_tokens`/`kv_cache_gb` or lower `max_new_tokens`."
                )
        return max_new

    def _lookahead_cap(self) -> int:
        return self.config.num_speculative_tokens if self.speculator is not None else 0

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        num_generations: int = 1,
        sampling: SamplingParams | None = None,
        forced_lengths: list[list[int]] | None = None,
        on_sample_finished: FinishCallback | None = None,
    ) -> RolloutResult:
        """G completions per prompt, prompt-major. `forced_lengths[i][j]` (benchmarks) fixes sample j of prompt i
        to exactly that many tokens, EOS ignored. `on_sample_finished(prompt_idx, sample_idx, completion_ids)` is
        called as each sample finishes, while the others keep decoding."""
        sampling = sampling or SamplingParams()
        max_new = self._check_inputs(prompt_ids, num_generations, sampling)
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        groups, seqs = self._make_requests(prompt_ids, num_generations, sampling, max_new, forced_lengths)
        self.pool.reset()
        cfg = self.config
        policy, admission = build_policies(
            cfg.scheduler, cfg.batch_policy, self.predictor, num_slots=cfg.slot_limit,
            fptas_epsilon=cfg.fptas_epsilon, sla_decode_ms=cfg.sla_decode_ms, max_batch=cfg.max_active_sequences,
        )
        scheduler = Scheduler(
            self.pool.allocator, policy, admission, cfg.sampling_mode, cfg.slot_limit, cfg.chunk_tokens
        )
        scheduler.submit(groups, seqs)
        stats = RolloutStats(kv_block_bytes=self.pool.block_bytes, num_kv_blocks=self.pool.num_blocks)
        step = _Step(self.runner, Sampler(sampling), sampling.seed, self.config.max_prefill_tokens, stats)
        uses = getattr(policy, "predictor", None) is self.predictor and self.predictor.wants_hidden
        step.prefix_k = self.predictor.prefix_k if uses else None
        step.spec = self.speculator.begin(sampling) if self.speculator is not None else None
        total = len(seqs)
        while scheduler.has_unfinished():
            lookahead = step.spec.lookahead(len(scheduler.running)) if step.spec is not None else 0
            batch = scheduler.schedule(lookahead=lookahead)
            t0 = time.perf_counter()
            tokens, logprobs = step.run(batch)
            if batch.decode:
                admission.on_step_time(len(batch.decode), time.perf_counter() - t0)
            if len(scheduler.finished) >= 0.9 * total:
                stats.tail_decode_steps += 1
            done_before = len(scheduler.finished)
            scheduler.postprocess(batch, tokens, logprobs)
            if on_sample_finished is not None:
                for seq in scheduler.finished[done_before:]:
                    on_sample_finished(seq.group_id, seq.sample_idx, list(seq.output_ids))
        self._fill_stats(stats, scheduler, seqs, start)
        remember_visits(self.history, groups, seqs)
        return RolloutResult(
            completion_ids=[s.output_ids for s in seqs],
            logprobs=[s.logprobs for s in seqs],
            stats=stats,
            finish_reasons=[s.finish_reason for s in seqs],
        )

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _make_requests(prompt_ids, num_generations, sampling, max_new, forced_lengths):
        if forced_lengths is not None:
            if len(forced_lengths) != len(prompt_ids) or any(len(f) != num_generations for f in forced_lengths):
                raise ValueError("`forced_lengths` must be a list of one list of G lengths per prompt.")
            if any(n < 1 for f in forced_lengths for n in f):
                raise ValueError("`forced_lengths` entries must be >= 1.")
        eos = frozenset(sampling.eos_token_ids)
        groups, seqs = [], []
        for i, p in enumerate(prompt_ids):
            group = Group(group_id=i, prompt_ids=list(p), num_generations=num_generations)
            groups.append(group)
            for j in range(num_generations):
                forced = forced_lengths[i][j] if forced_lengths is not None else None
                seqs.append(Sequence(group, j, max_new_tokens=max_new, eos_token_ids=eos, forced_length=forced))
        return groups, seqs

    def _fill_stats(self, stats: RolloutStats, scheduler: Scheduler, seqs: list[Sequence], start: float) -> None:
        c = scheduler.counters
        stats.generated_tokens = sum(s.num_generated for s in seqs)
        stats.peak_active_sequences = c.peak_running
        stats.mean_active_sequences = c.mean_running
        stats.peak_kv_blocks = self.pool.allocator.peak_used
        stats.kv_utilization = self.pool.allocator.mean_utilization
        stats.preemptions = c.preemptions
        stats.prompt_evictions = c.prompt_evictions
        stats.offloaded_blocks = c.offloaded_blocks
        if self.predictor.mae is not None:
            stats.extra["length_prediction_mae"] = self.predictor.mae
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            stats.peak_memory_bytes = torch.cuda.max_memory_allocated(self.device)
        stats.wall_time_s = time.perf_counter() - start


class _Step:
    """Executes one `ScheduledBatch`: prompt prefills, recomputes, first tokens, one decode forward."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, seed: int, max_prefill_tokens: int, stats: RolloutStats):
        self.runner = runner
        self.sampler = sampler
        self.seed = seed
        self.max_prefill_tokens = max_prefill_tokens
        self.stats = stats
        self.group_logits: dict[int, torch.Tensor] = {}  # prompt's last-position logits, for fresh samples
        self.device = runner.device
        self.spec = None  # a `spec_decode.SpeculativeStep` replaces the plain decode forward when set
        self.prefix_k: int | None = None  # capture the hidden state at completion token k (prefix predictor)
        self.host_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # divided rollout's host tier

    def run(self, batch: ScheduledBatch) -> tuple[list[list[int]], list[list[float]]]:
        self._swap(batch)
        self._prefill(batch)
        first, first_lp = self._first_tokens(batch.fresh)
        if not batch.decode:
            return [], []
        if self.spec is not None:
            return self.spec.run(self, batch, first, first_lp)
        # a fresh sample whose first token already ends it (EOS, or a one-token limit) needs no decode row
        rows = [s for s in batch.decode if s.seq_id not in first or not s.ends_with_first(first[s.seq_id])]
        sampled = self._decode(rows, first) if rows else {}
        tokens, logprobs = [], []
        for seq in batch.decode:
            head, head_lp = ([first[seq.seq_id]], [first_lp[seq.seq_id]]) if seq.seq_id in first else ([], [])
            tail, tail_lp = sampled.get(seq.seq_id, ([], []))
            tokens.append(head + tail)
            logprobs.append(head_lp + tail_lp)
        return tokens, logprobs

    def _decode(self, rows: list[Sequence], first: dict[int, int]) -> dict[int, tuple[list[int], list[float]]]:
        """One decode forward over `rows` (a fresh sample's input is its first token): {seq_id: ([token], [lp])}."""
        segments, fresh_first = [], {}
        for seq in rows:
            if seq.seq_id in first:
                fresh_first[seq.seq_id] = first[seq.seq_id]
                segments.append(self._decode_segment(seq, first[seq.seq_id], seq.prompt_len))
            else:
                segments.append(self._decode_segment(seq, seq.output_ids[-1], seq.num_tokens - 1))
        want = self.prefix_k is not None and any(self._at_prefix(s) for s in rows)
        logits, hidden = self.runner.forward(segments, torch.arange(len(segments)), output_hidden=want)
        self.stats.decode_steps += 1
        if want:
            for row, seq in enumerate(rows):
                if self._at_prefix(seq):  # the input token of this row is completion token k
                    seq.extra["prefix_hidden"] = hidden[row].float().cpu().numpy()
        positions = [seg.start_pos + 1 for seg in segments]
        history = self._history(rows, fresh_first) if self.sampler.params.repetition_penalty != 1.0 else None
        toks, lps = self._sample(logits, rows, positions, history)
        return {seq.seq_id: ([t], [lp]) for seq, t, lp in zip(rows, toks.tolist(), lps.tolist())}

    # -- pieces
    def _at_prefix(self, seq: Sequence) -> bool:
        return (1 if seq.is_fresh else seq.num_generated) == self.prefix_k

    def _swap(self, batch: ScheduledBatch) -> None:
        """Divided rollout's host tier: copy parked samples' KV out (first), then returning ones back in."""
        pool, bs = self.runner.pool, self.runner.pool.block_size
        for seq, blocks in batch.swap_out:
            slots = (torch.tensor(blocks, device=self.device)[:, None] * bs + torch.arange(bs, device=self.device))
            slots = slots.reshape(-1)  # [n * B]
            self.host_kv[seq.seq_id] = (pool.k_cache[:, slots].cpu(), pool.v_cache[:, slots].cpu())
        for seq, blocks in batch.swap_in:
            slots = (torch.tensor(blocks, device=self.device)[:, None] * bs + torch.arange(bs, device=self.device))
            k, v = self.host_kv.pop(seq.seq_id)
            pool.k_cache[:, slots.reshape(-1)] = k.to(self.device)
            pool.v_cache[:, slots.reshape(-1)] = v.to(self.device)

    @staticmethod
    def _decode_segment(seq: Sequence, token: int, pos: int) -> Segment:
        g = seq.group
        return Segment(g.prompt_len, g.prompt_blocks, seq.blocks, pos, [token], g.group_id)

    def _prefill(self, batch: ScheduledBatch) -> None:
        segments = [Segment(g.prompt_len, g.prompt_blocks, [], 0, g.prompt_ids, g.group_id) for g in batch.prefill_groups]
        segments += [
            Segment(s.prompt_len, s.group.prompt_blocks, s.blocks, s.prompt_len, s.output_ids[:-1], s.group_id)
            for s in batch.recompute
        ]
        if not segments:
            return
        for chunk in chunk_segments(segments, self.max_prefill_tokens):
            # the last piece of each prompt gives the logits its fresh samples draw their first token from
            want = [i for i, s in enumerate(chunk) if not s.suffix_blocks and s.end_pos == s.prompt_len]
            rows = last_rows(chunk)[want] if want else None
            logits, _ = self.runner.forward(chunk, rows)
            self.stats.prefill_tokens += sum(len(s.tokens) for s in chunk)
            self.stats.prefill_steps += 1
            for k, i in enumerate(want):
                self.group_logits[chunk[i].group_index] = logits[k]
        for s in batch.recompute:
            s.num_cached = s.num_generated - 1

    def _first_tokens(self, fresh: list[Sequence]) -> tuple[dict[int, int], dict[int, float]]:
        if not fresh:
            return {}, {}
        logits = torch.stack([self.group_logits[s.group_id] for s in fresh])
        history = self._history(fresh, {}) if self.sampler.params.repetition_penalty != 1.0 else None
        toks, lps = self._sample(logits, fresh, [s.prompt_len for s in fresh], history)
        ids = [s.seq_id for s in fresh]
        return dict(zip(ids, toks.tolist())), dict(zip(ids, lps.tolist()))

    def _sample(self, logits, seqs, positions, history):
        keys = row_keys(
            self.seed,
            torch.tensor([s.group_id for s in seqs], device=self.device),
            torch.tensor([s.sample_idx for s in seqs], device=self.device),
            torch.tensor(positions, device=self.device),
        )
        return self.sampler.sample(self.sampler.process(logits, history), keys)

    def _history(self, seqs: list[Sequence], extra: dict[int, int]) -> torch.Tensor:
        rows = [s.group.prompt_ids + s.output_ids + ([extra[s.seq_id]] if s.seq_id in extra else []) for s in seqs]
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r)
        return out.to(self.device)
