"""The model-backed executor of the drive loop: prefill (first tokens), then one decode forward per step.

Per `ScheduledBatch`:
1. the batch's KV moves (`batch.moves`: divided rollout's host tier, copies) carried out by the pool;
2. prefill of the batch's prompts (past their prefix-cache hits) and recomputes (eager, chunked to
   `max_prefill_tokens`; its layers make the partial prefix-cache hits' `PrefillCopy`s); the last position of
   each prompt gives the first token of every one of its samples that has none (all G at once);
3. one decode forward over `batch.decode` (each row's input is its last output token): the static decoder, the
   speculative step (drafts + one verification forward) when speculation is on, or an eager forward when the
   sampler runs extra `GenerationConfig` processors (`decoder` is then None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trl_infinite.engine.attention import Segment
from trl_infinite.engine.decode.static import Decoded, StaticDecoder
from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.runner.kv_pool import KVCachePool
from trl_infinite.engine.runner.model_runner import ModelRunner, chunk_segments, last_rows
from trl_infinite.engine.runner.sampler import Sampler, row_keys, seen_mask
from trl_infinite.engine.sched.batch import PrefillCopy, ScheduledBatch, StepOutput
from trl_infinite.engine.sched.predictors.base import LengthPredictor
from trl_infinite.engine.sched.sequence import Group, Sequence


@dataclass(frozen=True)
class StepContext:
    """What every part of one `generate` call's steps shares (handed over at construction, never modified)."""

    runner: ModelRunner
    sampler: Sampler
    seed: int
    stats: RolloutStats
    max_prefill_tokens: int
    decoder: StaticDecoder | None  # the static decode step (rows set up for the call); None: extra processors

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def pool(self) -> KVCachePool:
        return self.runner.pool

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int],
               contexts: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [N] and log-probs ([N], or [N, 2] with raw ones: `Sampler.sample`) drawn from `logits` [N, V] for
        `seqs` at `positions` (the emitted token's position); `contexts[i]` are the ids row i's context holds
        (needed by the repetition penalty)."""
        seen = history = None
        if self.sampler.uses_context:
            history = torch.full((len(contexts), max(len(c) for c in contexts)), -1, dtype=torch.long)
            for i, c in enumerate(contexts):
                history[i, : len(c)] = torch.tensor(c, dtype=torch.long)
            history = history.to(self.device)
            if not self.sampler.has_extra_processors:
                seen, history = seen_mask(history, logits.shape[-1]), None
        dev = self.device
        keys = row_keys(self.seed, torch.tensor([s.group_id for s in seqs], device=dev),
                        torch.tensor([s.sample_idx for s in seqs], device=dev), torch.tensor(positions, device=dev))
        processed = self.sampler.process(logits, seen, history, [s.prompt_len for s in seqs])
        return self.sampler.sample(processed, keys, logits)


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float], list[float] | None]:
    """One device->host copy of sampled tokens [N] and log-probs ([N], or [N, 2] with raw ones): (token ids,
    log-probs, raw log-probs or None)."""
    n = tokens.shape[0]
    host = torch.cat([tokens[:, None].double(), logprobs.double().reshape(n, -1)], 1).T.tolist()
    return [int(t) for t in host[0]], host[1], host[2] if len(host) > 2 else None


class PrefixCapture:
    """Delivers the last hidden state at completion token k to the length predictor (`observe_hidden`)."""

    def __init__(self, predictor: LengthPredictor):
        self.predictor = predictor
        self.k = predictor.prefix_k

    def wanted(self, seqs: list[Sequence]) -> list[int]:
        """Indices of `seqs` whose decode input is completion token k."""
        return [i for i, s in enumerate(seqs) if s.num_generated == self.k]

    def deliver(self, seq: Sequence, hidden: torch.Tensor) -> None:
        self.predictor.observe_hidden(seq, hidden.float().cpu().numpy())


class ModelExecutor:
    """`Executor` of the drive loop backed by the model (see the module docstring)."""

    def __init__(self, ctx: StepContext, prefix: PrefixCapture | None = None, spec=None):
        self.ctx = ctx
        self.prefix = prefix
        self.spec = spec  # a `spec_decode.SpeculativeStep`, or None

    def lookahead(self, num_running: int) -> int:
        return self.spec.lookahead(num_running) if self.spec is not None else 0

    def launch(self, batch: ScheduledBatch) -> Callable[[], StepOutput]:
        """Run the step's prefills, start its decode forward, return the function that completes the step."""
        self.ctx.pool.apply(batch.moves)
        out = StepOutput()
        out.first_tokens, out.first_logprobs, out.first_raw_logprobs = self._prefill(batch)
        if not batch.decode:
            return lambda: out
        if self.spec is not None:
            out.tokens, out.logprobs, out.raw_logprobs = self.spec.run(batch)
            return lambda: out
        if self.ctx.decoder is None:  # extra processors: eager
            decoded = self._eager_decode(batch.decode)
            finish = lambda: decoded  # noqa: E731
        else:
            finish = self.ctx.decoder.launch(batch, self.ctx.stats)

        def complete() -> StepOutput:
            decoded = finish()
            if self.prefix is not None:
                for i in self.prefix.wanted(batch.decode):
                    self.prefix.deliver(batch.decode[i], decoded.hidden[decoded.rows[i]])
            out.tokens = [[t] for t in decoded.tokens]
            out.logprobs = [[lp] for lp in decoded.logprobs]
            if decoded.raw_logprobs is not None:
                out.raw_logprobs = [[lp] for lp in decoded.raw_logprobs]
            return out

        return complete

    def after_step(self, batch: ScheduledBatch) -> None:
        self.ctx.pool.apply(batch.moves_after)  # completion caching's copies
        if self.spec is not None:
            self.spec.after_step(batch)

    def step_seconds(self, batch: ScheduledBatch, measured: float) -> float:
        return measured  # the wall time of the step (on CUDA up to the tokens' read-back)

    def close(self) -> None:
        """End of the call, on every exit path: the speculative step's drafter thread (if any) is joined."""
        if self.spec is not None:
            self.spec.close()

    # ------------------------------------------------------------------ pieces
    def _eager_decode(self, seqs: list[Sequence]) -> Decoded:
        """One eager decode forward (each row's input: its last output token at position `num_tokens - 1`), sampled
        with the sampler's extra processors on each row's full context. Same outputs as `StaticDecoder.launch`'s."""
        segments = [Segment(s.prompt_len, s.group.prompt_blocks, s.blocks, s.num_tokens - 1, [s.output_ids[-1]],
                            s.group_id) for s in seqs]
        want_hidden = self.prefix is not None and bool(self.prefix.wanted(seqs))
        logits, hidden = self.ctx.runner.forward(segments, torch.arange(len(seqs)), output_hidden=want_hidden)
        contexts = [s.group.prompt_ids + s.output_ids for s in seqs]
        tokens, logprobs, raw = to_host(*self.ctx.sample(logits, seqs, [s.num_tokens for s in seqs], contexts))
        return Decoded(tokens, logprobs, hidden, list(range(len(seqs))), raw)

    def _prefill(self, batch: ScheduledBatch):
        """Prefill prompts and recomputes; the first token of every sample of each prefilled prompt that has none."""
        # a prompt's leading blocks found in the prefix cache are not run again (`Group.num_cached`)
        copies = {m.group_id: list(zip(m.src, m.dst)) for m in batch.moves if isinstance(m, PrefillCopy)}
        segments = [Segment(g.prompt_len, g.prompt_blocks, [], g.num_cached, g.prompt_ids[g.num_cached:], g.group_id,
                            copies.get(g.group_id, [])) for g in batch.prefill_groups]
        segments += [
            Segment(s.prompt_len, s.group.prompt_blocks, s.blocks, s.prompt_len, s.output_ids[:-1], s.group_id)
            for s in batch.recompute
        ]
        if not segments:
            return [], [], None
        last_logits: dict[int, torch.Tensor] = {}  # group_id -> logits at the prompt's last position
        stats = self.ctx.stats
        for chunk in chunk_segments(segments, self.ctx.max_prefill_tokens):
            want = [i for i, s in enumerate(chunk) if not s.suffix_blocks and s.end_pos == s.prompt_len]
            rows = last_rows(chunk)[want] if want else torch.zeros(0, dtype=torch.long)
            logits, _ = self.ctx.runner.forward(chunk, rows)
            stats.prefill_tokens += sum(len(s.tokens) for s in chunk)
            stats.prefill_steps += 1
            for k, i in enumerate(want):
                last_logits[chunk[i].group_index] = logits[k]
        return self._first_tokens(batch.prefill_groups, last_logits)

    def _first_tokens(self, groups: list[Group], last_logits: dict[int, torch.Tensor]):
        """(tokens, log-probs, raw log-probs or None) of every sample without a token, one list per group."""
        fresh = [g.pending_first() for g in groups]
        seqs = [s for samples in fresh for s in samples]
        if not seqs:
            return [[] for _ in groups], [[] for _ in groups], None
        logits = torch.stack([last_logits[s.group_id] for s in seqs])  # [N, V]
        contexts = [s.group.prompt_ids for s in seqs] if self.ctx.sampler.uses_context else None
        tokens, logprobs, raw = to_host(*self.ctx.sample(logits, seqs, [s.prompt_len for s in seqs], contexts))
        out_t, out_lp, out_raw, i = [], [], [], 0
        for samples in fresh:
            out_t.append(tokens[i : i + len(samples)])
            out_lp.append(logprobs[i : i + len(samples)])
            out_raw.append(raw[i : i + len(samples)] if raw is not None else None)
            i += len(samples)
        return out_t, out_lp, (out_raw if raw is not None else None)
