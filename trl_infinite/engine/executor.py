"""The model-backed executor of the drive loop: prefill (first tokens), then one decode forward per step.

Per `ScheduledBatch`:
1. the batch's KV moves (`batch.moves`: divided rollout's host tier, copies) carried out by the pool;
2. prefill of the batch's prompts (past their prefix-cache hits) and recomputes (eager, chunked to
   `max_prefill_tokens`; its layers make the partial prefix-cache hits' `PrefillCopy`s); the last position of
   each prompt gives the first token of every one of its samples that has none (all G at once);
3. the call's decode step over `batch.decode` (each row's input is its last output token; `decode/step.py`'s
   protocol): the static decoder, the speculative step (drafts + one verification forward) when speculation is on,
   or the eager step when the sampler runs extra `GenerationConfig` processors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trl_infinite.engine.attention import Segment
from trl_infinite.engine.decode.step import DecodeStep, ReadBack, StepContext, pack
from trl_infinite.engine.runner.model_runner import chunk_segments, last_rows, sample_segment
from trl_infinite.engine.sched.batch import PrefillCopy, ScheduledBatch, StepOutput
from trl_infinite.engine.sched.sequence import Group


class ModelExecutor:
    """`Executor` of the drive loop backed by the model (see the module docstring); `step`: the call's decode step
    (`decode/step.py`'s protocol: static, eager or speculative)."""

    def __init__(self, ctx: StepContext, step: DecodeStep):
        self.ctx = ctx
        self.step = step

    def lookahead(self, num_running: int) -> int:
        return self.step.lookahead(num_running)

    def launch(self, batch: ScheduledBatch) -> Callable[[], StepOutput]:
        """Run the step's prefills, start its decode forward, return the function that completes the step."""
        self.ctx.pool.apply(batch.moves)
        out = StepOutput()
        out.first_tokens, out.first_logprobs, out.first_raw_logprobs = self._prefill(batch)
        if not batch.decode:
            return lambda: out
        pending = self.step.launch(batch)

        def complete() -> StepOutput:
            decoded = pending()
            self.ctx.deliver_hidden(batch.decode, decoded)
            out.tokens, out.logprobs, out.raw_logprobs = decoded.tokens, decoded.logprobs, decoded.raw_logprobs
            return out

        return complete

    def after_step(self, batch: ScheduledBatch) -> None:
        self.ctx.pool.apply(batch.moves_after)  # completion caching's copies
        self.step.after_step(batch)

    def step_seconds(self, batch: ScheduledBatch, measured: float) -> float:
        return measured  # the wall time of the step (on CUDA up to the tokens' read-back)

    def close(self) -> None:
        """End of the call, on every exit path: the speculative step's drafter thread (if any) is joined."""
        self.step.close()

    # ------------------------------------------------------------------ pieces

    def _prefill(self, batch: ScheduledBatch):
        """Prefill prompts and recomputes; the first token of every sample of each prefilled prompt that has none."""
        # a prompt's leading blocks found in the prefix cache are not run again (`Group.num_cached`)
        copies = {m.group_id: list(zip(m.src, m.dst)) for m in batch.moves if isinstance(m, PrefillCopy)}
        segments = [Segment(g.prompt_len, g.prompt_blocks, [], g.num_cached, g.prompt_ids[g.num_cached:], g.group_id,
                            copies.get(g.group_id, [])) for g in batch.prefill_groups]
        segments += [sample_segment(s, s.prompt_len, s.output_ids[:-1]) for s in batch.recompute]
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
        host = ReadBack(pack(*self.ctx.sample(logits, seqs, [s.prompt_len for s in seqs], contexts))).rows()
        cuts, i = [], 0
        for samples in fresh:
            cuts.append(host[i : i + len(samples)])
            i += len(samples)
        raw = [[r[2] for r in rows] for rows in cuts] if len(host[0]) > 2 else None
        return [[int(r[0]) for r in rows] for rows in cuts], [[r[1] for r in rows] for rows in cuts], raw
