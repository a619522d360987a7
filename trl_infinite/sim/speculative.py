"""Replay of speculative rollouts (none / coupled / decoupled) on recorded acceptance traces: the drive loop with an
executor that plays the verifier and the drafter.

Acceptance trace: each sample's per-token acceptance probability `p` (a trace record's `acceptance` list, one per
sample, recorded from an engine run: `acceptance_from_stats`). A draft of length k from position j is accepted up to
the first failed Bernoulli(p) draw of positions j+1 .. j+k, and a window drafted ahead stays valid if its bonus guess
succeeds too (one more draw); the draws are keyed by (seed, prompt, sample, position), so a replay is reproducible.

Per decode step the executor chooses each row's mode and window with the engine's own plan (`spec_decode/plan.py`:
Alg. 1 at the call's first decode step and again every `reconfigure_every` steps with the current batch, each time
followed by Alg. 2, or the drain plan once nothing is left to admit, as `spec_decode/decoupled.py` does; the
`coupled` mode uses the best coupled window at the step's batch), runs the decoupled state machine of
`spec_decode/decoupled.py` and charges the step

    coupled:    Dr(b_c, k) + V(b, D)                    decoupled:  Dr(b_c, k) + max(Dr(b_d, w + 1), V(b, D))

with the affine step times `StepTimes` (fitted by an engine's `Speculator`, `Speculator.step_times`). The call's
modelled seconds are `stats.extra["sim_seconds"]`; tokens per second = generated tokens / those seconds (the TGS the
plan predicts for the whole call, host work outside the forwards not included).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.sched.batch import ScheduledBatch, StepOutput
from trl_infinite.engine.spec_decode import plan as tgs  # the TGS plan (`spec_decode/plan.py`)
from trl_infinite.engine.spec_decode.adaptive import sample_acceptance
from trl_infinite.sim.replay import SimConfig, SimResult, TraceExecutor, simulate
from trl_infinite.sim.traces import TraceRecord

MODES = ("none", "coupled", "decoupled")


@dataclass(frozen=True)
class SpecReplay:
    """What the replay needs besides the trace: the step times, the mode, the largest window (`num_tokens`), a fixed
    decoupled window (None: planned), Alg. 2's period and the seed of the acceptance draws."""

    times: tgs.StepTimes
    mode: str = "decoupled"
    num_tokens: int = 5
    draft_window: int | None = None
    reconfigure_every: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"`mode` must be one of {list(MODES)}, got {self.mode!r}.")


def acceptance_from_stats(extra: dict, group: int, num_generations: int) -> list[float]:
    """Per-sample acceptance of one prompt from a call's `stats.extra["spec_sample_acceptance"]`
    (`adaptive.sample_acceptance`: samples never verified get 0.5)."""
    counts = extra.get("spec_sample_acceptance", {})
    out = []
    for i in range(num_generations):
        accepted, _, rejected = counts.get(f"{group}/{i}", (0, 0, 0))
        out.append(sample_acceptance(accepted, rejected))
    return out


class SpeculativeTraceExecutor(TraceExecutor):
    """`TraceExecutor` whose decode rows emit what a speculative step would (module docstring)."""

    def __init__(self, replay: SpecReplay, acceptance: dict[tuple[int, int], float], prompt_index: dict[int, int]):
        super().__init__(None, None, prompt_index)
        self.replay = replay
        self.acceptance = acceptance  # (prompt index, sample) -> p
        self.chain: dict[int, bool] = {}  # seq_id -> a valid window drafted ahead
        self.per_row: dict[int, tgs.Plan] = {}
        self.plan: tgs.Plan | None = None
        self.draining = False
        self.steps = 0
        self.seconds = 0.0

    def lookahead(self, num_running: int) -> int:
        return 0 if self.replay.mode == "none" else self.replay.num_tokens

    def end_call(self, stats: RolloutStats) -> None:
        stats.extra["sim_seconds"] = self.seconds

    def _p(self, seq) -> float:
        return self.acceptance.get((self.prompt_index[seq.group_id], seq.sample_idx), 0.5)

    def _draw(self, seq, pos: int, p: float) -> bool:
        key = (self.replay.seed, self.prompt_index[seq.group_id], seq.sample_idx, pos)
        return random.Random(hash(key)).random() < p

    def _accepted(self, seq, k: int) -> int:
        p, a = self._p(seq), 0
        while a < k and self._draw(seq, seq.num_generated + a + 1, p):
            a += 1
        return a

    def _row_plans(self, batch: ScheduledBatch) -> list[tgs.Plan]:
        decode = batch.decode
        r, b = self.replay, len(decode)
        mean_p = sum(self._p(s) for s in decode) / b
        if r.mode == "none":
            return [tgs.Plan(tgs.COUPLED, 0, 0.0)] * b
        if r.mode == "coupled":
            return [tgs.best_coupled(r.times, mean_p, b, r.num_tokens)] * b
        if r.draft_window is not None:
            return [tgs.Plan(tgs.DECOUPLED, r.draft_window, 0.0)] * b
        unplanned = batch.draining and self.draining and any(s.seq_id not in self.per_row for s in decode)
        drafting = any(p.window for p in self.per_row.values()) or (self.plan is not None and self.plan.window > 0)
        if self.plan is None or tgs.replan_due(self.steps, r.reconfigure_every, batch.draining, self.draining,
                                               drafting, unplanned):
            self.draining = batch.draining
            if self.draining:
                rows = {s.seq_id: (s.length_limit - s.num_generated, self._p(s)) for s in decode}
                self.plan, self.per_row = tgs.drain_rows(r.times, rows, r.num_tokens)
                return [self.per_row[s.seq_id] for s in decode]
            self.plan = tgs.plan(r.times, mean_p, b, r.num_tokens)
            if r.reconfigure_every:
                acceptance = {s.seq_id: self._p(s) for s in decode}
                self.per_row = tgs.reconfigure(r.times, self.plan, acceptance, r.num_tokens, b)
        return [self.per_row.get(s.seq_id, self.plan) for s in decode]

    def run(self, batch: ScheduledBatch) -> StepOutput:
        out = super().run(batch)
        if not batch.decode:
            return out
        self.steps += 1
        times = self.replay.times
        plans = self._row_plans(batch)
        tokens, drafts, sync_rows, sync_k, ahead_rows, ahead_w = [], 0, 0, 0, 0, 0
        for s, row in zip(batch.decode, plans):
            cap = max(0, min(self.replay.num_tokens, s.length_limit - s.num_generated - 1))
            w = min(row.window, cap)
            if row.mode == tgs.COUPLED:
                k = w
                sync_rows, sync_k = sync_rows + (k > 0), max(sync_k, k)
            else:
                k = w if self.chain.pop(s.seq_id, False) else 0
                ahead_rows, ahead_w = ahead_rows + (row.window > 0), max(ahead_w, row.window)
            a = self._accepted(s, k)
            if row.mode == tgs.DECOUPLED and row.window > 0 and a == k:  # the window drafted ahead is still valid
                self.chain[s.seq_id] = self._draw(s, s.num_generated + k + 1, self._p(s))
            drafts += k
            tokens.append(a + 1)
        verify = times.verify_time(len(batch.decode), drafts)
        ahead = times.draft_time(ahead_rows, ahead_w + 1) if ahead_rows else 0.0
        self.seconds += times.draft_time(sync_rows, sync_k) + max(verify, ahead)
        out.tokens = [[0] * n for n in tokens]
        out.logprobs = [[0.0] * n for n in tokens]
        return out


def simulate_speculative(records: list[TraceRecord], config: SimConfig, replay: SpecReplay) -> SimResult:
    """`simulate` with speculation replayed on the records' `acceptance` (one probability per sample)."""

    def factory(chunk: list[TraceRecord], index: dict[int, int]) -> SpeculativeTraceExecutor:
        acceptance = {(rec.prompt_index, i): p for rec in chunk for i, p in enumerate(rec.extra["acceptance"])}
        return SpeculativeTraceExecutor(replay, acceptance, index)

    return simulate(records, config, executor_factory=factory)
