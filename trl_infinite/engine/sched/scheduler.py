"""The continuous micro-group scheduler: slots, KV blocks, admission and preemption (pure Python).

Each step it (1) makes sure every running sample has blocks for the tokens it will write, preempting when the pool
is short, (2) admits waiting samples as the sampling mode, the admission policy and the free blocks allow, and
(3) hands a `ScheduledBatch` to an executor (the model runner, or the simulator's trace replayer), with the KV moves
the step orders (`batch.moves`). The executor's `StepOutput` comes back through `postprocess`: the first tokens of
the prompts prefilled in the step (one per sample of the group), then one or more tokens per decode row; samples
finish and free their blocks at once (completion caching's moves in `batch.moves_after`).

A prompt's blocks are allocated when its first sample is admitted and stay resident until all G samples of the
group finished; a sample owns only the blocks of its own completion tokens. The blocks' bookkeeping (prefix-cache
hits, completion caching, the host tier) is `kv_blocks.KVBlocks`'s.
"""

from __future__ import annotations

from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.sched.batch import INVALID_TOKEN, NonFiniteLogitsError, ScheduledBatch, StepOutput
from trl_infinite.engine.sched.block_manager import BlockAllocator, blocks_for
from trl_infinite.engine.sched.kv_blocks import KVBlocks
from trl_infinite.engine.sched.policies.base import AdmissionPolicy, SchedulePolicy, SchedulerView
from trl_infinite.engine.sched.sequence import Group, SeqStatus, Sequence
from trl_infinite.engine.sched.slot_modes import SamplingMode

__all__ = ["ScheduledBatch", "Scheduler", "StepOutput"]


class Scheduler:
    """Admission, block accounting and preemption for one `generate` call (built by `call.RolloutCall`); counts
    its steps, preemptions, evictions, parks and offloads in the call's `stats`."""

    def __init__(self, allocator: BlockAllocator, policy: SchedulePolicy, admission: AdmissionPolicy,
                 mode: SamplingMode, chunk_tokens: int | None, stats: RolloutStats, cache_completions: bool = False):
        """`cache_completions`: register finished samples' completion blocks in the prefix cache (`KVBlocks`)."""
        self.allocator = allocator
        self.kv = KVBlocks(allocator, stats, cache_completions)
        self.block_size = allocator.block_size
        self.policy = policy
        self.admission = admission
        self.mode = mode
        self.chunk_tokens = chunk_tokens
        self.stats = stats
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.groups: list[Group] = []
        self._admit_counter = 0
        self.step_idx = 0

    def submit(self, groups: list[Group], sequences: list[Sequence]) -> None:
        self.groups.extend(groups)
        self.waiting.extend(sequences)
        self.policy.on_submit(groups, sequences)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_samples(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.finished)

    def view(self) -> SchedulerView:
        return SchedulerView(running=self.running, waiting=self.waiting, free_blocks=self.allocator.num_free,
                             num_blocks=self.allocator.num_blocks, block_size=self.block_size, step=self.step_idx)

    def schedule(self, lookahead: int = 0) -> ScheduledBatch:
        """Grow running samples' blocks, then admit; never allocates past the pool."""
        batch = ScheduledBatch(lookahead=lookahead)
        batch.grown = self._grow_running(lookahead)
        self._admit(batch, lookahead)
        if not self.running and self.waiting:
            raise RuntimeError("no sample could be scheduled although the pool was checked up front (bug).")
        batch.decode = [s for s in self.running if s.output_ids]
        batch.draining = not self.waiting
        batch.moves = self.kv.take_moves()
        self.stats.scheduler_steps += 1
        self.stats.active_sequence_steps += len(self.running)
        self.stats.peak_active_sequences = max(self.stats.peak_active_sequences, len(self.running))
        self.allocator.sample_usage()
        return batch

    def _grow_running(self, lookahead: int) -> list[Sequence]:
        """Give every running sample the blocks its next tokens need; returns the samples that got new blocks."""
        grown = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            need = self.kv.own_need(seq, lookahead) - len(seq.blocks)
            while need > 0 and not self.allocator.can_allocate(need):
                if not self._make_room(requester=seq):
                    break
            if seq.status is SeqStatus.RUNNING and need > 0:
                seq.blocks.extend(self.allocator.allocate(need))
                grown.append(seq)
        return grown

    def _make_room(self, requester: Sequence) -> bool:
        """Free memory for `requester`: move a parked sample's KV to the host tier, else evict an idle prompt, else
        preempt a running sample (possibly itself). Returns False when the requester itself was preempted."""
        if self._offload_one(keep=requester):
            return True
        idle = self._idle_prompts()
        if idle:
            self._evict_prompt(idle[-1])
            return True
        others = [s for s in self.running if s is not requester]
        victim = self.policy.victim(others) if others else requester
        self.preempt(victim)
        return victim is not requester

    def _admit(self, batch: ScheduledBatch, lookahead: int) -> None:
        if not self.mode.admits(len(self.running)):
            return  # a round admits only when the previous round has fully finished
        view = self.view()
        limit = self.mode.slot_limit
        bound = self.admission.max_running(view)
        if bound is not None:
            limit = bound if limit is None else min(limit, bound)
        for seq in self.policy.ordered(view):
            if limit is not None and len(self.running) >= limit:
                break
            group = seq.group
            need = self._admit_need(seq, lookahead)
            view.free_blocks = self.allocator.num_free
            if not self.running and not self.allocator.can_allocate(need):
                for idle in self._idle_prompts(keep=group):  # nothing runs: idle prompts make way for progress
                    self._evict_prompt(idle)
                while not self.allocator.can_allocate(need := self._admit_need(seq, lookahead)) and \
                        self._offload_one(keep=seq):
                    pass  # ... and so must parked samples' KV
                view.free_blocks = self.allocator.num_free
            allowed = self.running == [] or self.admission.fits(seq, need, view)
            if not (allowed and self.allocator.can_allocate(need)):
                if self.policy.strict():
                    break
                continue
            self._start(seq, batch, lookahead)

    def _admit_need(self, seq: Sequence, lookahead: int) -> int:
        """Free blocks admitting `seq` takes (its prompt's count changes as evictions unpin its cache hits)."""
        need = self.kv.own_need(seq, lookahead) - len(seq.blocks)
        need += 0 if seq.group.resident else self.kv.prompt_need(seq.group)
        return need + self.mode.headroom(len(self.running))

    def _idle_prompts(self, keep: Group | None = None) -> list[Group]:
        """Prompts whose blocks are resident while none of their samples runs (and some still will)."""
        return [g for g in self.groups if g.resident and g.num_running == 0 and not g.done and g is not keep]

    def _start(self, seq: Sequence, batch: ScheduledBatch, lookahead: int) -> None:
        group = seq.group
        if not group.resident:
            self.kv.allocate_prompt(group, max(0, self.kv.own_need(seq, lookahead) - len(seq.blocks)))
            batch.prefill_groups.append(group)
        resumed, grown = self.kv.resume(seq, lookahead)
        if grown:
            batch.grown.append(seq)
        if not resumed:
            seq.blocks = self.allocator.allocate(self.kv.own_need(seq, lookahead))
        seq.set_status(SeqStatus.RUNNING)
        seq.admit_order = self._admit_counter
        seq.chunk_start = seq.num_generated
        self._admit_counter += 1
        self.waiting.remove(seq)
        self.running.append(seq)
        if seq.num_generated > 1 and not resumed:
            batch.recompute.append(seq)
        if seq.num_generated > 0:
            batch.readmitted.append(seq)

    def _chunk_target(self, seq: Sequence) -> int | None:
        """Output length at which the sample returns to the queue (`chunk_tokens`, or the policy's probe)."""
        own = None if self.chunk_tokens is None else seq.chunk_start + self.chunk_tokens
        return min((x for x in (self.policy.chunk_limit(seq), own) if x is not None), default=None)

    def park(self, seq: Sequence) -> None:
        """Return a running sample to the queue keeping its KV blocks (it resumes with no recompute)."""
        seq.set_status(SeqStatus.WAITING)
        self.running.remove(seq)
        self.waiting.append(seq)
        self.stats.parks += 1

    def _offload_one(self, keep: Sequence | None) -> bool:
        """Move the KV of the parked sample holding the most blocks to the host tier; False if none is parked."""
        parked = [s for s in self.waiting if s.blocks and s is not keep]
        if not parked:
            return False
        self.kv.offload(max(parked, key=lambda s: len(s.blocks)))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free the sample's own blocks and put it back in the queue; its tokens are kept (recompute later)."""
        self.allocator.free(seq.blocks)
        seq.blocks = []
        seq.set_status(SeqStatus.WAITING)
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.append(seq)
        self.stats.preemptions += 1

    def _evict_prompt(self, group: Group) -> None:
        self.kv.free_prompt(group)
        self.stats.prompt_evictions += 1

    def finish(self, seq: Sequence) -> None:
        """A running sample ended, or a waiting one whose first token (from its prompt's prefill) ended it."""
        self.kv.cache_completion(seq)
        self.allocator.free(seq.blocks)
        seq.blocks = []
        group = seq.group
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.set_status(SeqStatus.FINISHED)
        self.finished.append(seq)
        if group.done and group.resident:
            self.kv.free_prompt(group)
        self.policy.on_finish(seq)
        self.admission.on_finish(seq)

    def postprocess(self, batch: ScheduledBatch, out: StepOutput) -> None:
        """Append the step's tokens through `Sequence.append_token` (the one stop rule), finish the samples that
        ended, roll back unused lookahead blocks, and return samples that reached their chunk to the queue."""
        self.kv.end_step()
        first_raw = out.first_raw_logprobs or [None] * len(out.first_tokens)
        for group, toks, lps, raws in zip(batch.prefill_groups, out.first_tokens, out.first_logprobs, first_raw):
            for k, (seq, t, lp) in enumerate(zip(group.pending_first(), toks, lps)):
                if t == INVALID_TOKEN:
                    raise NonFiniteLogitsError(self.step_idx, seq, 0)
                if seq.append_token(t, lp, None if raws is None else raws[k]):
                    self.finish(seq)
        chunked = self.chunk_tokens is not None or self.policy.chunks
        raw_rows = out.raw_logprobs or [None] * len(out.tokens)
        for seq, toks, lps, raws in zip(batch.decode, out.tokens, out.logprobs, raw_rows):
            done = False
            for k, (t, lp) in enumerate(zip(toks, lps)):
                if t == INVALID_TOKEN:
                    raise NonFiniteLogitsError(self.step_idx, seq, seq.num_generated)
                done = seq.append_token(t, lp, None if raws is None else raws[k])
                if done:
                    break
            if done:
                self.finish(seq)
                continue
            if batch.lookahead:  # give back the blocks reserved for drafts that were not accepted
                keep = blocks_for(seq.num_generated, self.block_size)
                if len(seq.blocks) > keep:
                    self.allocator.free(seq.blocks[keep:])
                    del seq.blocks[keep:]
            if chunked:
                target = self._chunk_target(seq)
                if target is not None and seq.num_generated >= target:
                    self.park(seq)
        batch.moves_after = self.kv.take_moves()
        self.step_idx += 1
        self.policy.on_step(self.view())
