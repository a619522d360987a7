"""Replay length traces through exactly the engine's drive loop, `Scheduler` and policies with a trace executor.

The executor plays the model: each prefilled prompt gives every sample of its group its first token, each decode row
gets one token per step, and a sample ends after its traced length (`forced_length`). Everything else — the loop,
admission, block accounting, preemption, divided rollout, the policies — is the engine's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.batch import ScheduledBatch, StepOutput
from ..engine.block_manager import BlockAllocator, blocks_for
from ..engine.history import PromptHistory, remember_visits
from ..engine.loop import drive
from ..engine.outputs import RolloutStats
from ..engine.scheduler import Scheduler
from ..engine.scheduling.factory import build_policies, build_predictor
from ..engine.scheduling.predictors import LengthPredictor
from ..engine.sequence import Group, make_group
from .traces import TraceRecord


@dataclass
class SimConfig:
    sampling_mode: str = "fixed_slot"
    scheduler: str = "fifo"
    batch_policy: str = "static"
    slots: int = 4  # g
    prompts_per_call: int = 1  # B: prompts per `generate` call (the paper: 1)
    block_size: int = 16
    kv_cache_tokens: int | None = None  # None: room for the prompts + `slots` completions of max length
    chunk_tokens: int | None = None
    length_predictor: str = "oracle"
    prefix_k: int = 16
    fptas_epsilon: float = 0.1
    max_new_tokens: int | None = None  # None: the trace's own
    history_max_prompts: int = 4096  # per-prompt history across calls, as the engine's (0 = none)
    history_max_visits: int = 2
    history_fallback: str = "none"


@dataclass
class SimResult:
    decode_steps: int = 0
    tail_steps: int = 0
    mean_active: float = 0.0
    peak_kv_blocks: int = 0
    num_kv_blocks: int = 0
    preemptions: int = 0
    offloaded_blocks: int = 0
    generated_tokens: int = 0
    num_samples: int = 0
    lengths_preserved: bool = True
    prediction_mae: float | None = None
    per_call_steps: list[int] = field(default_factory=list)
    calls: list[CallSummary] = field(default_factory=list)

    @property
    def mean_length(self) -> float:
        return self.generated_tokens / self.num_samples if self.num_samples else 0.0

    def epoch_summary(self, epochs: set[int]) -> EpochSummary:
        """Totals over the calls of these epochs (e.g. the second epoch, scheduled with the first one's history)."""
        calls = [c for c in self.calls if c.epoch in epochs]
        errs = [x for c in calls for x in c.errors]
        base = [x for c in calls for x in c.constant_errors]
        return EpochSummary(
            calls=len(calls), decode_steps=sum(c.decode_steps for c in calls), bound=sum(c.bound for c in calls),
            tail_steps=sum(c.tail_steps for c in calls), offloaded_blocks=sum(c.offloaded_blocks for c in calls),
            prediction_mae=sum(errs) / len(errs) if errs else None,
            constant_mae=sum(base) / len(base) if base else None, scored_samples=len(errs),
        )


@dataclass
class CallSummary:
    """One simulated `generate` call."""

    epoch: int
    decode_steps: int
    bound: int  # `oracle_bound` of the call's lengths
    tail_steps: int
    offloaded_blocks: int
    errors: list[float]  # |first prediction - length| of the samples that finished in this call
    constant_errors: list[float]  # the same for the constant-mean predictor (history predictor only)


@dataclass
class EpochSummary:
    calls: int
    decode_steps: int
    bound: int
    tail_steps: int
    offloaded_blocks: int
    prediction_mae: float | None
    constant_mae: float | None
    scored_samples: int


def step_cost(length: int) -> int:
    """Decode rows one sample needs: its first token comes from its prompt's prefill, each further one from a row."""
    return length - 1


def oracle_bound(lengths: list[int], slots: int) -> int:
    """Lower bound on the decode steps of `slots` continuous slots: max(longest sample, total work / slots)."""
    costs = [step_cost(x) for x in lengths]
    return max(max(costs), -(-sum(costs) // slots))


class TraceExecutor:
    """Plays the model for the drive loop. `features[(prompt_index, sample_idx)]` (optional) is the hidden state at
    completion token k, handed to `predictor.observe_hidden` exactly when the engine would (the row's input is
    token k); `predictor` None: nothing is delivered."""

    def __init__(self, predictor: LengthPredictor | None, features: dict | None, prompt_index: dict[int, int]):
        self.predictor = predictor
        self.prefix_k = predictor.prefix_k if predictor is not None else None
        self.features = features or {}
        self.prompt_index = prompt_index  # group_id -> the trace's prompt index

    def lookahead(self, num_running: int) -> int:
        return 0

    def launch(self, batch: ScheduledBatch):
        out = self.run(batch)
        return lambda: out

    def run(self, batch: ScheduledBatch) -> StepOutput:
        out = StepOutput()
        for group in batch.prefill_groups:
            n = len(group.pending_first())
            out.first_tokens.append([0] * n)
            out.first_logprobs.append([0.0] * n)
        for seq in batch.decode:
            if seq.num_generated == self.prefix_k:
                feat = self.features.get((self.prompt_index[seq.group_id], seq.sample_idx))
                if feat is not None:
                    self.predictor.observe_hidden(seq, feat)
        out.tokens = [[0] for _ in batch.decode]
        out.logprobs = [[0.0] for _ in batch.decode]
        return out

    def after_step(self, batch: ScheduledBatch) -> None:
        pass


def _prompt_ids(rec: TraceRecord) -> list[int]:
    """The recorded prompt ids, else a stand-in unique to the prompt index (the history is keyed by prompt ids)."""
    if rec.prompt_ids is not None:
        return list(rec.prompt_ids)
    return [-1 - rec.prompt_index] + [0] * (rec.prompt_len - 1)


def _calls(records: list[TraceRecord], per_call: int) -> list[list[TraceRecord]]:
    """Consecutive records, `per_call` at a time, never mixing two epochs in one call."""
    calls: list[list[TraceRecord]] = []
    for rec in records:
        if calls and len(calls[-1]) < per_call and calls[-1][-1].epoch == rec.epoch:
            calls[-1].append(rec)
        else:
            calls.append([rec])
    return calls


def _requests(records: list[TraceRecord], max_new: int) -> list[Group]:
    return [make_group(i, _prompt_ids(rec), len(rec.lengths), max_new, forced_lengths=rec.lengths)
            for i, rec in enumerate(records)]


def simulate(
    records: list[TraceRecord],
    config: SimConfig,
    predictor: LengthPredictor | None = None,
    features: dict | None = None,
    history: PromptHistory | None = None,
) -> SimResult:
    """Run the trace call by call (B prompts each, one epoch per call); the predictor and the per-prompt history
    persist across calls, as in training (a trace that revisits prompts feeds later epochs the earlier ones)."""
    if history is None:
        history = PromptHistory(config.history_max_prompts, config.history_max_visits, max_tokens=0)
    predictor = predictor or build_predictor(config.length_predictor, config.prefix_k, history, config.history_fallback)
    baseline = getattr(predictor, "baseline", None)  # `ErrorStats` of the constant-mean predictor (history)
    out = SimResult()
    active_sum = 0
    for chunk in _calls(records, config.prompts_per_call):
        max_new = config.max_new_tokens or max(r.max_new_tokens or max(r.lengths) for r in chunk)
        groups = _requests(chunk, max_new)
        seqs = [s for g in groups for s in g.samples]
        allocator = BlockAllocator(_pool_blocks(chunk, config, max_new), config.block_size)
        slot_limit = None if config.sampling_mode in ("full_group", "dynamic_slot") else config.slots
        policy, admission = build_policies(config.scheduler, config.batch_policy, predictor,
                                           num_slots=config.slots, fptas_epsilon=config.fptas_epsilon)
        sched = Scheduler(allocator, policy, admission, config.sampling_mode, slot_limit, config.chunk_tokens)
        sched.submit(groups, seqs)
        uses = getattr(policy, "predictor", None) is predictor and predictor.wants_hidden
        executor = TraceExecutor(predictor if uses else None, features,
                                 {g.group_id: rec.prompt_index for g, rec in zip(groups, chunk)})
        stats = RolloutStats()
        drive(sched, executor, stats)
        out.per_call_steps.append(stats.decode_steps)
        out.decode_steps += stats.decode_steps
        out.tail_steps += stats.tail_decode_steps
        active_sum += sched.counters.running_sum
        out.peak_kv_blocks = max(out.peak_kv_blocks, stats.peak_kv_blocks)
        out.num_kv_blocks = stats.num_kv_blocks
        out.preemptions += stats.preemptions
        out.offloaded_blocks += stats.offloaded_blocks
        out.generated_tokens += stats.generated_tokens
        out.num_samples += len(seqs)
        out.lengths_preserved &= all(s.num_generated == s.length_limit for s in seqs)
        out.calls.append(CallSummary(
            epoch=chunk[0].epoch, decode_steps=stats.decode_steps, bound=oracle_bound([s.num_generated for s in seqs], config.slots),
            tail_steps=stats.tail_decode_steps, offloaded_blocks=stats.offloaded_blocks,
            errors=list(predictor.scores.call),
            constant_errors=list(baseline.call) if baseline is not None else [],
        ))
        predictor.end_call()
        remember_visits(history, groups, tokens=False)
    out.mean_active = active_sum / out.decode_steps if out.decode_steps else 0.0
    out.prediction_mae = predictor.mae
    return out


def _pool_blocks(chunk: list[TraceRecord], config: SimConfig, max_new: int) -> int:
    if config.kv_cache_tokens is not None:
        return blocks_for(config.kv_cache_tokens, config.block_size)
    prompts = sum(blocks_for(r.prompt_len, config.block_size) for r in chunk)
    if config.sampling_mode == "full_group":
        return prompts + sum(len(r.lengths) for r in chunk) * blocks_for(max_new, config.block_size)
    return prompts + config.slots * blocks_for(max_new, config.block_size)
