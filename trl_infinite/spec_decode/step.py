"""`SpeculativeStep`: the decode part of an engine step with drafting and one verification forward.

Each decode sample's segment is `[pending token, d_1 .. d_k]` (pending = the last emitted token, whose KV is not
cached yet). The forward writes the KV of all k+1 positions; rejected positions are simply overwritten later, and
the scheduler trims the blocks reserved for drafts back to the emitted length (`lookahead`).
"""

from __future__ import annotations

import time

import torch

from ..engine.attention import Segment
from ..engine.config import EngineConfig, SamplingParams
from ..engine.sampler import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE, row_keys
from ..engine.sequence import Sequence
from .adaptive import AcceptanceTracker, CostModel, plan_lengths
from .drafter import EMPTY, Drafter, Proposal, build_drafter
from .verify import Verified, verify_greedy, verify_sampling


class Speculator:
    """Engine-lifetime state: the drafter name/options and the cost model (profiled once per model)."""

    def __init__(self, config: EngineConfig, device: torch.device, block_size: int, history=None):
        self.config = config
        self.device = device
        self.cost = CostModel()
        self.extras: dict = {"history": history}  # the engine's `PromptHistory` (drafts from earlier visits)
        if config.speculative_draft_model is not None:
            from .draft_model import load_draft_model

            self.extras["draft_model"] = load_draft_model(config.speculative_draft_model, device)

    @property
    def max_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def begin(self, sampling: SamplingParams) -> SpeculativeStep:
        drafter = build_drafter(
            self.config.speculative_method, config=self.config, device=self.device, sampling=sampling, **self.extras
        )
        return SpeculativeStep(self, drafter, sampling)


class SpeculativeStep:
    """Per-`generate` state: drafter, acceptance tracker. `run` replaces `_Step`'s plain decode."""

    def __init__(self, spec: Speculator, drafter: Drafter, sampling: SamplingParams):
        self.spec = spec
        self.drafter = drafter
        self.greedy = sampling.greedy
        self.tracker = AcceptanceTracker()
        self.verified_rows = 0

    def lookahead(self, num_running: int) -> int:
        """KV slots to reserve per sample for drafts next step."""
        return self.spec.max_tokens

    # ------------------------------------------------------------------ one step
    def run(self, step, batch, first: dict[int, int], first_lp: dict[int, float]):
        seqs = batch.decode
        pending = [first.get(s.seq_id, s.output_ids[-1] if s.output_ids else None) for s in seqs]
        self._sync_drafter(seqs, first)
        proposals = self._draft(seqs, first, batch.lookahead)
        drafts = [p.tokens for p in proposals]
        start = [s.prompt_len if s.seq_id in first else s.num_tokens - 1 for s in seqs]
        segments = [self._segment(s, [t] + d, pos) for s, t, d, pos in zip(seqs, pending, drafts, start)]
        t0 = time.perf_counter()
        n_query = sum(len(seg.tokens) for seg in segments)
        logits, _ = step.runner.forward(segments, torch.arange(n_query))
        verified = self._verify(step, seqs, first, pending, proposals, start, logits)
        toks, lps, n_acc = _to_host(verified)
        self._observe(step.stats, seqs, drafts, n_acc, time.perf_counter() - t0)
        tokens, logprobs = [], []
        for s, row, lp_row, n in zip(seqs, toks, lps, n_acc):
            emitted, emitted_lp = _until_end(s, row[: n + 1], lp_row[: n + 1], first.get(s.seq_id))
            self._after_emit(s, emitted, s.seq_id in first)
            if s.seq_id in first:
                emitted, emitted_lp = [first[s.seq_id]] + emitted, [first_lp[s.seq_id]] + emitted_lp
            tokens.append(emitted)
            logprobs.append(emitted_lp)
        return tokens, logprobs

    # -- drafting
    def _sync_drafter(self, seqs: list[Sequence], first: dict[int, int]) -> None:
        for s in seqs:
            if not self.drafter.started(s):
                self.drafter.start(s)
            if s.seq_id in first:
                self.drafter.update(s, [first[s.seq_id]])

    def _draft(self, seqs: list[Sequence], first: dict[int, int], lookahead: int) -> list[Proposal]:
        caps = []
        for s in seqs:
            generated = s.num_generated + (1 if s.seq_id in first else 0)
            caps.append(max(0, min(lookahead, s.length_limit - generated - 1)))
        alphas = [self.tracker.alpha(s.seq_id) for s in seqs]
        ks = plan_lengths(alphas, caps, self.spec.cost, self.spec.config.speculative_adaptive)
        if not any(ks):
            return [EMPTY] * len(seqs)
        proposals = self.drafter.propose(seqs, ks)
        return [Proposal(p.tokens[:k], None if p.logprobs is None else p.logprobs[:k]) for p, k in zip(proposals, ks)]

    @staticmethod
    def _segment(seq: Sequence, tokens: list[int], pos: int) -> Segment:
        g = seq.group
        return Segment(g.prompt_len, g.prompt_blocks, seq.blocks, pos, tokens, g.group_id)

    # -- verification
    def _verify(self, step, seqs, first, pending, proposals, start, logits) -> Verified:
        device = logits.device
        drafts = [p.tokens for p in proposals]
        k = max(len(d) for d in drafts)
        lens = torch.tensor([len(d) for d in drafts], device=device)
        history = None
        if step.sampler.params.repetition_penalty != 1.0:
            history = _history_rows(seqs, first, drafts).to(device)
        p_flat = step.sampler.process(logits, history)  # [T, V]
        offsets = torch.tensor([0] + [len(d) + 1 for d in drafts][:-1], device=device).cumsum(0)
        cols = torch.arange(k + 1, device=device)
        idx = offsets[:, None] + torch.minimum(cols[None, :], lens[:, None])  # [N, K+1] (padding repeats the last)
        p = p_flat[idx]  # [N, K+1, V]
        d = torch.tensor([dr + [0] * (k - len(dr)) for dr in drafts], dtype=torch.long, device=device)
        d = d.view(len(drafts), k)  # [N, K]
        if self.greedy:
            return verify_greedy(p, d, lens)
        keys = [self._keys(step, seqs, start, k, stream) for stream in (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE)]
        return verify_sampling(p, d, lens, *keys, q=_draft_logprobs(proposals, k, p.shape[-1], device))

    @staticmethod
    def _keys(step, seqs, start, k: int, stream: int) -> torch.Tensor:
        """[N, K+1] keys of emitted positions start+1 .. start+1+K."""
        n = len(seqs)
        dev = step.device
        pos = torch.tensor(start, device=dev)[:, None] + 1 + torch.arange(k + 1, device=dev)[None, :]
        g = torch.tensor([s.group_id for s in seqs], device=dev)[:, None].expand(n, k + 1)
        i = torch.tensor([s.sample_idx for s in seqs], device=dev)[:, None].expand(n, k + 1)
        return row_keys(step.seed, g.reshape(-1), i.reshape(-1), pos.reshape(-1), stream).view(n, k + 1)

    # -- bookkeeping
    def _observe(self, stats, seqs, drafts, n_acc, seconds: float) -> None:
        stats.decode_steps += 1
        num_drafts = sum(len(d) for d in drafts)
        self.spec.cost.observe(len(seqs), num_drafts, seconds)
        if num_drafts == 0:
            return
        stats.verify_steps += 1
        for s, d, n in zip(seqs, drafts, n_acc):
            if d:
                self.tracker.observe(s.seq_id, len(d), n)
                self.verified_rows += 1
                stats.draft_tokens += len(d)
                stats.accepted_tokens += n
        stats.mean_acceptance_length = (stats.accepted_tokens + self.verified_rows) / self.verified_rows

    def _after_emit(self, seq: Sequence, emitted: list[int], fresh: bool) -> None:
        self.drafter.update(seq, emitted)
        if _finishes(seq, emitted, fresh):
            self.drafter.stop(seq)
            self.tracker.forget(seq.seq_id)


def _to_host(v: Verified) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """One device->host copy per step: tokens (exact in float64), log-probs and accepted counts together."""
    k1 = v.tokens.shape[1]
    rows = torch.cat([v.tokens.double(), v.logprobs.double(), v.num_accepted[:, None].double()], 1).tolist()
    return ([[int(t) for t in r[:k1]] for r in rows], [r[k1 : 2 * k1] for r in rows], [int(r[-1]) for r in rows])


def _until_end(seq: Sequence, tokens: list[int], lps: list[float], first: int | None):
    """Cut the emitted tokens after the first EOS or at the length limit (what `append_token` will keep).
    `first` is a fresh sample's first token (sampled before the forward), None otherwise."""
    room = seq.length_limit - seq.num_generated - (0 if first is None else 1)
    if first is not None and seq.forced_length is None and first in seq.eos_token_ids:
        room = 0
    tokens, lps = tokens[:room], lps[:room]
    if seq.forced_length is None:
        for i, t in enumerate(tokens):
            if t in seq.eos_token_ids:
                return tokens[: i + 1], lps[: i + 1]
    return tokens, lps


def _finishes(seq: Sequence, emitted: list[int], fresh: bool) -> bool:
    if emitted and seq.forced_length is None and emitted[-1] in seq.eos_token_ids:
        return True
    if not emitted and fresh:
        return True  # the first token ended the sample
    return seq.num_generated + len(emitted) + (1 if fresh else 0) >= seq.length_limit


def _history_rows(seqs, first, drafts) -> torch.Tensor:
    """[T, L] context token ids of every verified row (row j of a sample also sees drafts d_1..d_j), -1 padded."""
    rows = []
    for s, d in zip(seqs, drafts):
        base = s.group.prompt_ids + s.output_ids + ([first[s.seq_id]] if s.seq_id in first else [])
        rows.extend(base + d[:j] for j in range(len(d) + 1))
    out = torch.full((len(rows), max(len(r) for r in rows)), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _draft_logprobs(proposals: list[Proposal], k: int, vocab: int, device) -> torch.Tensor | None:
    """[N, K, V] draft distributions, point masses for deterministic drafts; None if no proposal has any."""
    if k == 0 or all(p.logprobs is None for p in proposals):
        return None
    q = torch.full((len(proposals), k, vocab), float("-inf"), device=device)
    for i, p in enumerate(proposals):
        if p.logprobs is not None:
            q[i, : len(p.tokens)] = p.logprobs.to(device)
        else:
            q[i, torch.arange(len(p.tokens)), torch.tensor(p.tokens, dtype=torch.long)] = 0.0
    return q

