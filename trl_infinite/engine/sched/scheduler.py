"""The continuous micro-group scheduler: slots, KV blocks, admission and preemption (pure Python).

Each step it (1) makes sure every running sample has blocks for the tokens it will write, preempting when the pool
is short, (2) admits waiting samples as the sampling mode, the admission policy and the free blocks allow, and
(3) hands a `ScheduledBatch` to an executor (the model runner, or the simulator's trace replayer). The executor's
`StepOutput` comes back through `postprocess`: the first tokens of the prompts prefilled in the step (one per
sample of the group), then one or more tokens per decode row; samples finish and free their blocks at once.

A prompt's blocks are allocated when its first sample is admitted and stay resident until all G samples of the
group finished; a sample owns only the blocks of its own completion tokens.

With a prefix cache (`prefix_cache.py`, carried by the allocator), a prompt's leading full blocks found in the cache
are shared instead of allocated and only the rest is prefilled (at least its last token, whose logits give the first
tokens); its new full blocks are registered at once, so a prompt admitted later in the same step reads them (the
prefill runs the step's prompts in admission order, each layer writing every new token's KV before attending). With
`cache_completions`, a finished sample's full blocks past its prompt are registered too (its own blocks, its KV
shifted onto the cache's block grid through `copy_slots` where the prompt ends inside a block), so the next turn of a
tool loop prefills only what follows them.
"""

from __future__ import annotations

from collections.abc import Callable

from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.sched.batch import INVALID_TOKEN, NonFiniteLogitsError, ScheduledBatch, StepOutput
from trl_infinite.engine.sched.block_manager import BlockAllocator, blocks_for
from trl_infinite.engine.sched.policies.base import AdmissionPolicy, SchedulePolicy, SchedulerView
from trl_infinite.engine.sched.sequence import Group, SeqStatus, Sequence
from trl_infinite.engine.sched.slot_modes import SamplingMode

__all__ = ["ScheduledBatch", "Scheduler", "StepOutput"]


class Scheduler:
    """Admission, block accounting and preemption for one `generate` call (built by `call.RolloutCall`); counts
    its steps, preemptions, evictions, parks and offloads in the call's `stats`."""

    def __init__(
        self,
        allocator: BlockAllocator,
        policy: SchedulePolicy,
        admission: AdmissionPolicy,
        mode: SamplingMode,
        chunk_tokens: int | None,
        stats: RolloutStats,
        copy_slots: Callable[[list[int], list[int]], None] | None = None,
        cache_completions: bool = False,
    ):
        """`copy_slots(src, dst)`: copies the KV of pool slots `src` into slots `dst` (the engine's pool; None:
        completions are cached only where their blocks lie on the cache's grid). `cache_completions`: register finished samples'
        completion blocks in the prefix cache (useful when a later call continues the conversation)."""
        self.allocator = allocator
        self.cache = allocator.cache
        self.copy_slots = copy_slots
        self.cache_completions = cache_completions and allocator.cache is not None
        self._keys: dict[int, list[int]] = {}  # group_id -> chain keys of its prompt's full blocks
        self._pinned: list[int] = []  # sources of this step's partial-hit copies, held until its forward ran
        # destination slot -> source slot of this step's partial-hit copies: a later copy whose source slot is an
        # earlier copy's destination reads that copy's source (all copies of a step are one gather, then one scatter)
        self._copied: dict[int, int] = {}
        self.block_size = allocator.block_size
        self.policy = policy
        self.admission = admission
        self.mode = mode
        self.chunk_tokens = chunk_tokens
        self.stats = stats
        self._swap_out: list[tuple[Sequence, list[int]]] = []
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.groups: list[Group] = []
        self._admit_counter = 0
        self.step_idx = 0

    # ------------------------------------------------------------------ submission
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
        return SchedulerView(
            running=self.running,
            waiting=self.waiting,
            free_blocks=self.allocator.num_free,
            num_blocks=self.allocator.num_blocks,
            block_size=self.block_size,
            step=self.step_idx,
        )

    # ------------------------------------------------------------------ one step
    def schedule(self, lookahead: int = 0) -> ScheduledBatch:
        """Grow running samples' blocks, then admit; never allocates past the pool."""
        batch = ScheduledBatch(lookahead=lookahead)
        batch.grown = self._grow_running(lookahead)
        self._admit(batch, lookahead)
        if not self.running and self.waiting:
            raise RuntimeError("no sample could be scheduled although the pool was checked up front (bug).")
        batch.decode = [s for s in self.running if s.output_ids]
        batch.draining = not self.waiting
        batch.swap_out, self._swap_out = self._swap_out, []
        self.stats.scheduler_steps += 1
        self.stats.active_sequence_steps += len(self.running)
        self.stats.peak_active_sequences = max(self.stats.peak_active_sequences, len(self.running))
        self.allocator.sample_usage()
        return batch

    def _own_blocks_needed(self, seq: Sequence, lookahead: int) -> int:
        # KV slots for every output token (the last one's KV is written by this step's forward) + drafts; a sample
        # without tokens yet reserves the slot of its first token.
        return blocks_for(max(seq.num_generated, 1) + lookahead, self.block_size)

    def _grow_running(self, lookahead: int) -> list[Sequence]:
        """Give every running sample the blocks its next tokens need; returns the samples that got new blocks."""
        grown = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            need = self._own_blocks_needed(seq, lookahead) - len(seq.blocks)
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
        need = self._own_blocks_needed(seq, lookahead) - len(seq.blocks)
        need += 0 if seq.group.resident else self._prompt_need(seq.group)
        return need + self.mode.headroom(len(self.running))

    def _idle_prompts(self, keep: Group | None = None) -> list[Group]:
        """Prompts whose blocks are resident while none of their samples runs (and some still will)."""
        return [g for g in self.groups if g.resident and g.num_running == 0 and not g.done and g is not keep]

    # ------------------------------------------------------------------ prefix cache
    def _prompt_keys(self, group: Group) -> list[int]:
        keys = self._keys.get(group.group_id)
        if keys is None:
            keys = self._keys[group.group_id] = self.cache.keys(group.prompt_ids, group.prompt_len // self.block_size)
        return keys

    def _prompt_hits(self, group: Group) -> list[int]:
        """Cached blocks for the prompt's leading full blocks, short of its last token (prefilled for its logits)."""
        if self.cache is None:
            return []
        return self.cache.match(group.prompt_ids, self._prompt_keys(group)[: (group.prompt_len - 1) // self.block_size])

    def _prompt_need(self, group: Group) -> int:
        """Blocks that making the prompt resident takes from the free count (hits on blocks in use take none)."""
        hits = self._prompt_hits(group)
        return blocks_for(group.prompt_len, self.block_size) - sum(1 for b in hits if self.allocator.refs(b) > 0)

    def _allocate_prompt(self, group: Group, reserve: int) -> None:
        """The prompt's blocks: its cache hits shared, the rest allocated and registered (their KV is computed by
        this step's prefill, before anything admitted later reads it). `reserve`: blocks the caller allocates next
        (a partial hit's source is pinned only if that leaves them free)."""
        hits, bs = self._prompt_hits(group), self.block_size
        self.allocator.share(hits)  # first: the allocation below may evict unreferenced cached blocks
        count = blocks_for(group.prompt_len, bs) - len(hits)
        parent = self.cache.serial(hits[-1]) if hits else 0
        partial = None
        if self.cache is not None:  # the next block's first ids, short of the prompt's last token
            start = len(hits) * bs
            partial = self.cache.partial(group.prompt_ids[start:], parent, min(bs, group.prompt_len - 1 - start))
            if (partial is not None and self.allocator.refs(partial[0]) == 0
                    and not self.allocator.can_allocate(count + 1 + reserve)):
                partial = None  # pinning the source would take a block the prompt needs
            if partial is not None:
                self.allocator.share([partial[0]])  # pinned until the step's forward copied it (`postprocess`)
                self._pinned.append(partial[0])
        fresh = self.allocator.allocate(count)
        group.prompt_blocks = hits + fresh
        group.num_cached = len(hits) * bs
        group.cache_copies = []
        if partial is not None:
            src, m = partial
            group.cache_copies = [(self._copied.get(src * bs + t, src * bs + t), fresh[0] * bs + t) for t in range(m)]
            self._copied.update((dst, slot) for slot, dst in group.cache_copies)
            group.num_cached += m
        if self.cache is None:
            return
        self.stats.prefix_cache_hit_tokens += group.num_cached
        keys = self._prompt_keys(group)
        for i in range(len(hits), len(keys)):
            parent = self.cache.insert(group.prompt_blocks[i], keys[i], tuple(group.prompt_ids[i * bs:(i + 1) * bs]),
                                       parent)
            if parent is None:  # its key is another prefix's (a hash collision): the rest stays uncached
                break

    def _cache_completion(self, seq: Sequence) -> None:
        """Register `seq`'s prompt + completion past its prompt's full blocks (see the module docstring): the
        positions whose KV is written (all but the last output token), after a cached chain; the full blocks, then
        the last, partial one (found only by `PrefixCache.partial`: the next turn copies its ids' KV). Grid block
        `i` (positions `[i * B, (i + 1) * B)`) goes into the sample's own block `i - P // B`: where the prompt ends
        inside a block the KV is shifted there (one gather / scatter, no new block: the sample is finished, nothing
        reads its own blocks any more)."""
        group, bs, cache = seq.group, self.block_size, self.cache
        plen, written = group.prompt_len, seq.num_tokens - 1
        if not seq.blocks or not group.resident or written <= plen:
            return
        ids = group.prompt_ids + seq.output_ids
        full, first = written // bs, plen // bs
        keys = cache.keys(ids, full)
        held = cache.match(ids, keys)
        start = len(held)
        if start < first:  # the prompt's chain is not cached
            return
        end = written if plen % bs == 0 or self.copy_slots is not None else full * bs
        if start * bs >= end:
            return
        self.allocator.share(held)  # pinned while a block is taken for the shifted tail
        pinned, blocks = list(held), list(seq.blocks)
        try:
            if end > full * bs and full - first == len(blocks):  # the shift carries the tail past the own blocks
                if plen % bs and group.num_finished == group.num_generations - 1:
                    # the group's last sample: the prompt's partial block is no one else's and is freed with it
                    blocks.append(group.prompt_blocks[first])
                    self.allocator.share(blocks[-1:])
                    pinned.append(blocks[-1])
                elif not self.allocator.can_allocate(1):
                    end = full * bs
                else:
                    blocks += self.allocator.allocate(1)  # free or evictable anyway: the room does not shrink
                    pinned.append(blocks[-1])
            if plen % bs and start * bs < end:
                src = [self._slot(seq, p) for p in range(start * bs, end)]
                self.copy_slots(src, [blocks[p // bs - first] * bs + p % bs for p in range(start * bs, end)])
            parent = cache.serial(held[-1]) if held else 0
            for i in range(start, full):
                parent = cache.insert(blocks[i - first], keys[i], tuple(ids[i * bs:(i + 1) * bs]), parent)
                if parent is None:
                    return
                self.stats.cached_completion_blocks += 1
            if end > full * bs:
                tokens = tuple(ids[full * bs:end])
                if cache.insert(blocks[full - first], cache.hash_fn(keys[-1] if full else 0, tokens), tokens,
                                parent) is not None:
                    self.stats.cached_completion_blocks += 1
        finally:
            self.allocator.free(pinned)

    def _slot(self, seq: Sequence, pos: int) -> int:
        """Pool slot holding position `pos` of `seq` (prompt blocks, then its own blocks from the prompt's end)."""
        plen, bs = seq.prompt_len, self.block_size
        if pos < plen:
            return seq.group.prompt_blocks[pos // bs] * bs + pos % bs
        own = pos - plen
        return seq.blocks[own // bs] * bs + own % bs

    def _start(self, seq: Sequence, batch: ScheduledBatch, lookahead: int) -> None:
        group = seq.group
        if not group.resident:
            self._allocate_prompt(group, max(0, self._own_blocks_needed(seq, lookahead) - len(seq.blocks)))
            batch.prefill_groups.append(group)
        resumed = self._resume_kv(seq, batch, lookahead)
        if not resumed:
            seq.blocks = self.allocator.allocate(self._own_blocks_needed(seq, lookahead))
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

    # ------------------------------------------------------------------ divided rollout
    def _resume_kv(self, seq: Sequence, batch: ScheduledBatch, lookahead: int) -> bool:
        """A parked sample comes back with its KV: still in the pool, or copied back from the host tier."""
        host, seq.host_blocks = seq.host_blocks, 0
        if not seq.blocks and not host:
            return False
        extra = self._own_blocks_needed(seq, lookahead) - len(seq.blocks)
        if extra > 0:
            seq.blocks.extend(self.allocator.allocate(extra))
            batch.grown.append(seq)
        if host:
            batch.swap_in.append((seq, seq.blocks[:host]))
        return True

    def _chunk_target(self, seq: Sequence) -> int | None:
        """Output length at which the sample returns to the queue (`chunk_tokens`, or the policy's probe)."""
        limits = [self.policy.chunk_limit(seq)]
        if self.chunk_tokens is not None:
            limits.append(seq.chunk_start + self.chunk_tokens)
        limits = [x for x in limits if x is not None]
        return min(limits) if limits else None

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
        seq = max(parked, key=lambda s: len(s.blocks))
        self._swap_out.append((seq, list(seq.blocks)))
        seq.host_blocks = len(seq.blocks)
        self.stats.offloaded_blocks += len(seq.blocks)
        self.allocator.free(seq.blocks)
        seq.blocks = []
        return True

    # ------------------------------------------------------------------ state changes
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
        self.allocator.free(group.prompt_blocks)
        group.prompt_blocks = []
        self.stats.prompt_evictions += 1

    def finish(self, seq: Sequence) -> None:
        """A running sample ended, or a waiting one whose first token (from its prompt's prefill) ended it."""
        if self.cache_completions:
            self._cache_completion(seq)
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
            self.allocator.free(group.prompt_blocks)
            group.prompt_blocks = []
        self.policy.on_finish(seq)
        self.admission.on_finish(seq)

    def postprocess(self, batch: ScheduledBatch, out: StepOutput) -> None:
        """Append the step's tokens through `Sequence.append_token` (the one stop rule), finish the samples that
        ended, roll back unused lookahead blocks, and return samples that reached their chunk to the queue."""
        self.allocator.free(self._pinned)  # the step's forward made its partial-hit copies
        self._pinned = []
        self._copied = {}
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
        self.step_idx += 1
        self.policy.on_step(self.view())
