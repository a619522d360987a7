"""Relaxed decoupled speculation (SpecActor §4.1, Fig. 9): the drafter drafts the next window while the verifier
checks the current one.

Per decode step, for each row in decoupled mode with window w:
1. its drafts `D` are the window the drafter drafted ahead during the previous step, if that window is still valid
   (the previous verification accepted every draft and emitted the drafter's guess as its bonus token); otherwise
   it verifies no draft this step (one token, as plain decoding);
2. while the verification forward runs, the drafter thread drafts `E = e_1 .. e_{w+1}` after the context + `D`
   (`Drafter.propose_ahead`, `e_1` guessing the bonus token): the drafter runs at most one window ahead of what is
   verified and then waits for the verdict (the relaxed dependency: at most `2w + 1` drafted tokens are wasted);
3. after the forward the step joins the drafter thread; `E[1:]` becomes the row's next window if the emitted tokens
   are `D + [e_1]`.
Rows in coupled mode (the plan's fallback, or a request Alg. 2 moved there) are drafted before the forward, on the
caller's thread, as in coupled speculation; every row is verified in the one verification forward of the step.
When no row is in decoupled mode the step is exactly coupled speculation (the coupled controller's per-sample
lengths, within Alg. 2's windows) or, with a plan of no speculation, plain decoding: no drafter thread, no drafting,
no draft slots reserved, and no drafter work (its starts and updates wait for the next draft, `_catch_up`).

The drafter thread is one worker per call (on CUDA it drafts on its own stream); PyTorch releases the GIL inside
its kernels, so on CPU a model drafter computes while the verifier's kernels run. The drafter's state is only ever
touched by one thread at a time: `update` / `start` / `stop` / coupled `propose` run on the caller's thread while no
drafting-ahead job is in flight (each step joins its job before it returns, errors included), and `close` shuts the
worker down on every exit path of the call.

Lossless: verification is unchanged (`verify.py`: the emitted tokens are plain decoding's, keyed by seed, prompt,
sample and position), so what was drafted, by which thread and when, changes only the speed, never a token. The
plan and Alg. 2 decide from wall-clock timings, and they decide drafts only.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from trl_infinite.engine.decode.cuda_graphs import capture_lock
from trl_infinite.engine.sched.sequence import SeqStatus, Sequence
from trl_infinite.engine.spec_decode.adaptive import plan_lengths
from trl_infinite.engine.spec_decode.drafter import EMPTY, Proposal
from trl_infinite.engine.spec_decode.plan import COUPLED, DECOUPLED, Plan, drain_rows, plan, reconfigure, replan_due
from trl_infinite.engine.spec_decode.step import SpeculativeStep


@dataclass
class _Chain:
    """A window drafted ahead for one row: valid when the row's output is `expect_len` tokens ending in `tail`."""

    expect_len: int
    tail: list[int]
    tokens: list[int]  # e_2 .. e_{w+1}


@dataclass
class _Ahead:
    future: object
    rows: list[tuple[Sequence, list[int]]]  # (row, its drafts under verification)


class DecoupledStep(SpeculativeStep):
    """`SpeculativeStep` with decoupled drafting (module docstring). The plan (Alg. 1) is made at the first step
    where the step-time models and the acceptance have data (before that: today's coupled controller, which
    profiles them), and made again with the current batch every `speculative_reconfigure_every` steps, followed by
    Alg. 2 for the requests below the mean acceptance. Once nothing is left to admit (`ScheduledBatch.draining`)
    the plan is the drain plan instead (`plan.drain`: per-row windows for the least makespan), made at once and then
    at the same period. A coupled plan drafts its window (0: none) for every row before the forward; a decoupled
    one verifies the windows drafted ahead."""

    def __init__(self, ctx, spec, drafter, sampling, window: int | None, reconfigure_every: int):
        super().__init__(ctx, spec, drafter, sampling)
        self.w_max = spec.max_tokens
        fixed = window if window is not None or spec.adaptive else spec.max_tokens
        self.every = reconfigure_every if fixed is None else 0
        # a fixed window (or `speculative_adaptive=False`): no plan, no reconfiguration
        self.plan: Plan | None = Plan(DECOUPLED, fixed, 0.0) if fixed is not None else None
        self.per_row: dict[int, Plan] = {}
        self.draining = False  # the plan in force is the drain plan (its per-row windows are used as they are)
        self.chains: dict[int, _Chain] = {}
        self.pending: list[tuple[int, int]] = []  # (row index, window) drafted ahead this step
        self.steps = 0
        self.worker: ThreadPoolExecutor | None = None
        self.stream = torch.cuda.Stream(ctx.device) if ctx.device.type == "cuda" else None
        dev = ctx.device.type
        self.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) if dev in ("cuda", "cpu") \
            else (False, None)
        self.counters = {"ahead_tokens": 0, "ahead_used": 0, "ahead_wasted": 0, "decoupled_rows": 0,
                         "coupled_rows": 0, "plans": 0}

    def _make_plan(self, seqs: list[Sequence], draining: bool) -> None:
        """Alg. 1 (then Alg. 2) at the current batch, or the drain plan when nothing is left to admit (first plan of
        the call, a periodic re-plan, or the step the call starts draining)."""
        times = self.spec.step_times()
        if times is None or not self.spec.acceptance.counts:
            return
        first = self.plan is None
        mean = self.spec.acceptance.alpha(None)
        self.draining = draining
        if draining:  # every row's acceptance: its own where it has verified drafts, else the slowest expected
            seen = self.tracker.counts
            prior = self.spec.slowest_acceptance(sum(1 for s in seqs if s.seq_id not in seen))
            prior = mean if prior is None else prior
            rows = {s.seq_id: (s.length_limit - s.num_generated,
                               self.tracker.alpha(s.seq_id) if s.seq_id in seen else prior) for s in seqs}
            self.plan, self.per_row = drain_rows(times, rows, self.w_max)
        else:
            self.plan = plan(times, mean, len(seqs), self.w_max)
            acceptance = {s.seq_id: self.tracker.alpha(s.seq_id) for s in seqs if s.seq_id in self.tracker.counts}
            self.per_row = reconfigure(times, self.plan, acceptance, self.w_max, len(seqs)) if self.every else {}
        if first:  # the plan at the call's initial batch, for the benchmarks
            self.ctx.stats.extra.update(
                spec_plan_mode=self.plan.mode, spec_plan_window=self.plan.window, spec_plan_batch=len(seqs),
                spec_plan_tgs=self.plan.tgs, spec_plan_acceptance=mean, spec_plan_draining=draining)
        self.counters["plans"] += 1

    def _idle(self) -> bool:
        """The plan is "no speculation" for every row (Alg. 1 chose w = 0 and Alg. 2 gave no row a window)."""
        return (self.plan is not None and self.plan.window == 0
                and all(p.window == 0 for p in self.per_row.values()))

    def lookahead(self, num_running: int) -> int:
        """No draft slots while idle (a re-plan that resumes speculation drafts from the step after it)."""
        return 0 if self._idle() else self.w_max

    def _draft(self, batch) -> list[Proposal]:
        seqs, lookahead = batch.decode, batch.lookahead
        self.steps += 1
        self.pending = []
        unplanned = batch.draining and self.draining and any(s.seq_id not in self.per_row for s in seqs)
        if self.plan is None or replan_due(self.steps, self.every, batch.draining, self.draining, not self._idle(),
                                           unplanned):
            self._make_plan(seqs, batch.draining)
        if self.plan is None:  # the step-time models are not profiled yet: today's coupled controller
            return super()._draft(batch)
        rows = [self.per_row.get(s.seq_id, self.plan) for s in seqs]
        if all(p.mode == COUPLED for p in rows):  # no row drafts ahead: exactly coupled speculation (or plain)
            return self._draft_coupled(seqs, lookahead, rows)
        caps = [max(0, min(lookahead, s.length_limit - s.num_generated - 1)) for s in seqs]
        out, ks = [EMPTY] * len(seqs), [0] * len(seqs)
        for i, (s, row_plan) in enumerate(zip(seqs, rows)):
            w = min(row_plan.window, caps[i])
            chain = self.chains.pop(s.seq_id, None)
            if row_plan.mode == COUPLED:
                ks[i] = w
                self.counters["coupled_rows"] += 1
                continue
            self.counters["decoupled_rows"] += 1
            if chain is not None and s.num_generated == chain.expect_len and s.output_ids[-len(chain.tail):] == \
                    chain.tail:
                out[i] = Proposal(chain.tokens[:w])
                self.counters["ahead_used"] += len(out[i].tokens)
            elif chain is not None:
                self.counters["ahead_wasted"] += len(chain.tokens)
            if row_plan.window > 0:
                self.pending.append((i, row_plan.window))
        if any(ks):
            coupled = self._propose(seqs, ks)
            out = [c if k else o for c, o, k in zip(coupled, out, ks)]
        return out

    def _draft_coupled(self, seqs: list[Sequence], lookahead: int, rows: list[Plan]) -> list[Proposal]:
        """Every row coupled: the coupled controller's lengths (`SpeculativeStep._draft`, per-sample acceptance and
        the batch switch), each row capped at its plan's window where Alg. 2 gave it one and at 0 where the plan is
        "no speculation"; the batch plan's own coupled window does not cap (the controller refines it per sample).
        Draining: the drain plan's windows as they are (the controller maximises tokens per second, which is not
        what a draining call needs). Every row at most `lookahead` drafts, the KV slots reserved for them. No
        drafter thread: with a plan of no speculation the step is the plain static one."""
        self.counters["coupled_rows"] += len(seqs)
        for s in seqs:  # windows drafted ahead under an earlier decoupled plan are void now
            chain = self.chains.pop(s.seq_id, None)
            if chain is not None:
                self.counters["ahead_wasted"] += len(chain.tokens)
        limit = [lookahead if p is self.plan and p.window > 0 else p.window for p in rows]
        # never past the slots the scheduler reserved (`lookahead`: 0 while the plan was "no speculation", so a
        # re-plan that resumes speculation drafts from the next step)
        caps = [max(0, min(c, lookahead, s.length_limit - s.num_generated - 1)) for c, s in zip(limit, seqs)]
        if not any(caps):
            return [EMPTY] * len(seqs)
        if self.draining:
            return self._propose(seqs, caps)
        alphas = [self.tracker.alpha(s.seq_id) for s in seqs]
        return self._propose(seqs, plan_lengths(alphas, caps, self.spec.cost, self.spec.adaptive))

    def _launch_ahead(self, seqs: list[Sequence], drafts: list[list[int]]):
        if not self.pending:
            return None
        self._catch_up(seqs)  # on this thread, before the drafter thread reads the drafter's state
        rows = [(seqs[i], list(drafts[i])) for i, _ in self.pending]
        ks = [w + 1 for _, w in self.pending]
        if self.worker is None:
            self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-infinite-drafter")
        job = self.worker.submit(self._draft_ahead, [s for s, _ in rows], [d for _, d in rows], ks)
        return _Ahead(job, rows)

    def _draft_ahead(self, seqs: list[Sequence], assumed: list[list[int]], ks: list[int]):
        """On the drafter thread: the windows after each row's drafts (its own CUDA stream on GPU)."""
        enabled, dtype = self.autocast
        with capture_lock:  # never beside a graph capture on the verifier's thread (`cuda_graphs.capture_lock`)
            t0 = time.perf_counter()
            with torch.inference_mode(), torch.autocast(self.ctx.device.type, dtype=dtype, enabled=enabled):
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        proposals = self.drafter.propose_ahead(seqs, assumed, ks)
                    self.stream.synchronize()
                else:
                    proposals = self.drafter.propose_ahead(seqs, assumed, ks)
            return proposals, time.perf_counter() - t0

    def _join_ahead(self, ahead: _Ahead | None, keep: bool) -> None:
        if ahead is None:
            return
        if not keep:
            ahead.future.exception()  # waits; the step's own error is the one raised
            return
        proposals, seconds = ahead.future.result()
        ks = [w + 1 for _, w in self.pending]
        self.spec.draft_times.observe(len(ks), max(ks), sum(ks), seconds)
        for (s, drafts), p in zip(ahead.rows, proposals):
            self.counters["ahead_tokens"] += len(p.tokens)
            if p.tokens:
                self.chains[s.seq_id] = _Chain(s.num_generated + len(drafts) + 1, drafts + p.tokens[:1],
                                               p.tokens[1:])

    def after_step(self, batch) -> None:
        super().after_step(batch)
        for s in batch.decode:
            if s.status is SeqStatus.FINISHED:
                self.chains.pop(s.seq_id, None)
                self.per_row.pop(s.seq_id, None)

    def close(self) -> None:
        """Joins and ends the drafter thread (every exit path of the call), then records the counters."""
        if self.worker is not None:
            self.worker.shutdown(wait=True)
            self.worker = None
        super().close()
        self.ctx.stats.extra.update({f"spec_{k}": v for k, v in self.counters.items()})
