"""`SpeculativeStep`: the decode part of an engine step with drafting and one verification forward.

Each decode sample's segment is `[pending token, d_1 .. d_k]` (pending = the last emitted token, at position
`num_tokens - 1`, whose KV is not cached yet). The forward writes the KV of all k+1 positions; rejected positions
are simply overwritten later, and the scheduler trims the blocks reserved for drafts back to the emitted length
(`lookahead`). The step returns every verified token; the scheduler keeps them up to the sample's end
(`Sequence.append_token`), and the drafter learns what was actually kept before its next draft (`_catch_up`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from trl_infinite.engine.attention import Segment
from trl_infinite.engine.config.engine_config import SamplingParams
from trl_infinite.engine.decode.step import Decoded, DecodeStep, Pending, ReadBack, StepContext, pack, padded_rows
from trl_infinite.engine.runner.model_runner import sample_segment
from trl_infinite.engine.runner.sampler import STREAM_SAMPLE, row_keys, seen_mask
from trl_infinite.engine.sched.batch import ScheduledBatch
from trl_infinite.engine.sched.sequence import SeqStatus, Sequence
from trl_infinite.engine.spec_decode.adaptive import AcceptanceTracker, plan_lengths
from trl_infinite.engine.spec_decode.drafter import EMPTY, Drafter, Proposal
from trl_infinite.engine.spec_decode.verify import Verified, verify

if TYPE_CHECKING:
    from trl_infinite.engine.spec_decode.speculator import Speculator


class SpeculativeStep(DecodeStep):
    """Per-`generate` state: drafter, acceptance tracker; the call's decode step (`decode/step.py`'s protocol)."""

    def __init__(self, ctx: StepContext, spec: Speculator, drafter: Drafter, sampling: SamplingParams):
        self.ctx = ctx
        self.spec = spec
        self.drafter = drafter
        self.greedy = sampling.greedy
        self.tracker = AcceptanceTracker()
        self.verified_rows = 0
        self.known: dict[int, int] = {}  # seq_id -> output tokens the drafter has seen (started samples)
        self.retired: list[Sequence] = []  # finished since the last draft: the drafter learns them at the next one
        # (group, sample) -> [drafts accepted, drafts verified, verifications that rejected one]
        self.sample_counts: dict[tuple[int, int], list[int]] = {}

    def lookahead(self, num_running: int) -> int:
        """KV slots to reserve per sample for drafts next step."""
        return self.spec.max_tokens

    def launch(self, batch: ScheduledBatch) -> Pending:
        """Draft, verify in one forward: each row's accepted drafts + correction/bonus token (see `StepOutput`).
        Without any draft to verify, the plain static step (where the call has one)."""
        seqs = batch.decode
        proposals = self._draft(batch)
        drafts = [p.tokens for p in proposals]
        ahead = self._launch_ahead(seqs, drafts)
        try:
            if any(drafts) or self.ctx.decoder is None:
                out = self._verify_step(batch, seqs, proposals)
            else:
                t0 = time.perf_counter()
                out = replace(self.ctx.decoder.launch(batch)(), hidden=None, rows=None)  # (no hidden states here)
                self._observe(seqs, drafts, [0] * len(seqs), time.perf_counter() - t0)
        except BaseException:
            self._join_ahead(ahead, keep=False)  # the drafter thread is idle again before the error leaves
            raise
        self._join_ahead(ahead, keep=True)
        return lambda: out

    def _launch_ahead(self, seqs: list[Sequence], drafts: list[list[int]]):
        """Decoupled speculation starts drafting the next window here (`decoupled.py`); coupled: nothing."""
        return None

    def _join_ahead(self, ahead, keep: bool) -> None:
        """Waits for what `_launch_ahead` started (`keep`: use its drafts, else only wait)."""

    def close(self) -> None:
        """End of the call (every exit path): the per-sample acceptance for traces (`sim/speculative.py`) and for
        the engine's record (the drain plan's prior, `Speculator.slowest_acceptance`)."""
        self.ctx.stats.extra["spec_sample_acceptance"] = {
            f"{g}/{i}": tuple(c) for (g, i), c in sorted(self.sample_counts.items())}
        self.spec.record_samples(self.sample_counts.values())

    def _verify_step(self, batch: ScheduledBatch, seqs: list[Sequence], proposals: list[Proposal]) -> Decoded:
        drafts = [p.tokens for p in proposals]
        if self.ctx.decoder is not None:  # this step appends tokens the static rows do not see: rebuild them next
            self.ctx.decoder.invalidate()
        start = [s.num_tokens - 1 for s in seqs]
        segments = [sample_segment(s, pos, [s.output_ids[-1]] + d) for s, d, pos in zip(seqs, drafts, start)]
        if self.ctx.runner.device.type == "cpu":  # each query token a decode row of its own (`_as_decode_rows`)
            segments = _as_decode_rows(segments)
        t0 = time.perf_counter()
        n_query = sum(len(seg.tokens) for seg in segments)
        logits, _ = self.ctx.runner.forward(segments, torch.arange(n_query))
        verified, raw = self._verify(seqs, proposals, start, logits)
        k1 = verified.tokens.shape[1]  # one read-back: tokens, log-probs, raw log-probs (or none), accepted counts
        host = ReadBack(pack(verified.tokens, verified.logprobs, *([raw] if raw is not None else []),
                             verified.num_accepted)).rows()
        n_acc = [int(r[-1]) for r in host]
        self._observe(seqs, drafts, n_acc, time.perf_counter() - t0)
        cut = lambda j: [r[j * k1 : j * k1 + n + 1] for r, n in zip(host, n_acc)]  # noqa: E731
        return Decoded([[int(t) for t in row] for row in cut(0)], cut(1), cut(2) if raw is not None else None)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Forget finished samples' acceptance and keep them for the drafter's next catch-up (`_catch_up`). The
        drafter itself learns nothing here: whatever it is told (new samples, their tokens, finished siblings) waits
        for the next draft, so a step or a whole call without drafts costs the drafter nothing."""
        for s in batch.decode:
            if s.status is SeqStatus.FINISHED:
                self.tracker.forget(s.seq_id)
                self.retired.append(s)

    def _sync(self, s: Sequence) -> None:
        """Give the drafter the tokens of `s` it has not seen yet: start it (the whole context), or one update."""
        seen = self.known.get(s.seq_id)
        if seen is None:
            self.drafter.start(s)
        elif seen < s.num_generated:
            self.drafter.update(s, s.output_ids[seen:])
        self.known[s.seq_id] = s.num_generated

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Before drafting for `seqs`, on the caller's thread: the samples finished since the last draft first (their
        completions serve their siblings' drafts; then they are stopped), then each of `seqs` started or brought up
        to date in one update."""
        for s in self.retired:
            self._sync(s)
            self.drafter.stop(s)
            del self.known[s.seq_id]
        self.retired = []
        for s in seqs:
            self._sync(s)

    def _draft(self, batch: ScheduledBatch) -> list[Proposal]:
        """Each decode row's drafts for this step (the coupled controller's lengths, `adaptive.plan_lengths`)."""
        seqs = batch.decode
        caps = [max(0, min(batch.lookahead, s.length_limit - s.num_generated - 1)) for s in seqs]
        alphas = [self.tracker.alpha(s.seq_id) for s in seqs]
        ks = plan_lengths(alphas, caps, self.spec.cost, self.spec.adaptive)
        return self._propose(seqs, ks)

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """The drafter's proposals cut to `ks`, timed for the drafting cost model."""
        if not any(ks):
            return [EMPTY] * len(seqs)
        self._catch_up(seqs)
        t0 = time.perf_counter()
        proposals = self.drafter.propose(seqs, ks)
        self.spec.draft_times.observe(sum(1 for k in ks if k), max(ks), sum(ks), time.perf_counter() - t0)
        return [Proposal(p.tokens[:k]) for p, k in zip(proposals, ks)]

    def _verify(self, seqs, proposals, start, logits) -> tuple[Verified, torch.Tensor | None]:
        """Identity verification (`verify.py`) of the drafts against the logits of the verification forward
        ([T, V], T = sum of (drafts + 1) per row); also the raw log-probs [N, K+1] of the emitted tokens when the
        sampler returns them."""
        device = logits.device
        drafts = [p.tokens for p in proposals]
        k = max(len(d) for d in drafts)
        lens = torch.tensor([len(d) for d in drafts], device=device)
        sampler = self.ctx.sampler
        seen = history = None
        if sampler.uses_context:
            # [T, L] context of every verified row (row j of a sample also sees drafts d_1..d_j)
            history = padded_rows([s.group.prompt_ids + s.output_ids + d[:j] for s, d in zip(seqs, drafts)
                                    for j in range(len(d) + 1)]).to(device)
            if not sampler.has_extra_processors:
                seen, history = seen_mask(history, logits.shape[-1]), None
        prompt_lens = [s.prompt_len for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)]  # [T]
        p_flat = sampler.process(logits, seen, history, prompt_lens)  # [T, V]
        offsets = torch.tensor([0] + [len(d) + 1 for d in drafts][:-1], device=device).cumsum(0)
        cols = torch.arange(k + 1, device=device)
        idx = offsets[:, None] + torch.minimum(cols[None, :], lens[:, None])  # [N, K+1] (padding repeats the last)
        p = p_flat[idx]  # [N, K+1, V]
        d = torch.tensor([dr + [0] * (k - len(dr)) for dr in drafts], dtype=torch.long, device=device)
        d = d.view(len(drafts), k)  # [N, K]
        keys = None if self.greedy else self._keys(seqs, start, k, STREAM_SAMPLE)
        verified = verify(p, d, lens, keys)
        raw = None
        if sampler.returns_raw:  # the model's own log-probs at the raw-log-prob temperature, of the emitted tokens
            raw_rows = torch.log_softmax(logits.float() / sampler.raw_temperature, -1)[idx]  # [N, K+1, V]
            raw = raw_rows.gather(2, verified.tokens.clamp_min(0)[:, :, None])[:, :, 0]
        return verified, raw

    def _keys(self, seqs, start, k: int, stream: int) -> torch.Tensor:
        """[N, K+1] keys of emitted positions start+1 .. start+1+K."""
        n = len(seqs)
        dev = self.ctx.device
        pos = torch.tensor(start, device=dev)[:, None] + 1 + torch.arange(k + 1, device=dev)[None, :]
        g = torch.tensor([s.group_id for s in seqs], device=dev)[:, None].expand(n, k + 1)
        i = torch.tensor([s.sample_idx for s in seqs], device=dev)[:, None].expand(n, k + 1)
        return row_keys(self.ctx.seed, g.reshape(-1), i.reshape(-1), pos.reshape(-1), stream).view(n, k + 1)

    def _observe(self, seqs, drafts, n_acc, seconds: float) -> None:
        stats = self.ctx.stats
        num_drafts = sum(len(d) for d in drafts)
        self.spec.cost.observe(len(seqs), num_drafts, seconds)
        if num_drafts == 0:
            return
        stats.verify_steps += 1
        for s, d, n in zip(seqs, drafts, n_acc):
            if d:
                self.tracker.observe(s.seq_id, len(d), n)
                self.spec.acceptance.observe(None, len(d), n)
                counts = self.sample_counts.setdefault((s.group_id, s.sample_idx), [0, 0, 0])
                counts[0] += n
                counts[1] += len(d)
                counts[2] += n < len(d)
                self.verified_rows += 1
                stats.draft_tokens += len(d)
                stats.accepted_tokens += n
        stats.mean_acceptance_length = (stats.accepted_tokens + self.verified_rows) / self.verified_rows


def _as_decode_rows(segments: list[Segment]) -> list[Segment]:
    """Each token of each verification segment as a one-token segment at its own position (same order, so the
    logits rows are the same): the forward is then a decode forward (`PagedAttentionMetadata.is_decode`) whose row
    at position `p` attends to positions `.. p` of its sample (the K/V of every position, drafts included, are
    written before any layer attends), through the same attention kernel, at a row-invariant row count, as the plain
    decode step: each row's logits are bit-identical to what the plain step computes for it
    (`row_plan.RowPlan`), so verification emits exactly plain decoding's tokens on real models too."""
    return [replace(seg, start_pos=seg.start_pos + j, tokens=[t]) for seg in segments for j, t in enumerate(seg.tokens)]
