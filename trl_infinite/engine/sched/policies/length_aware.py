"""Length-aware ordering policies: SJF, LFS, FPTAS plan, Infinite Sampling (FPTAS + SJF) and Seer.

Each ranks the same waiting queue with a `LengthPredictor` (`sched/predictors/base.py`). None of them drops or shortens a
sample: they only choose which pending sample takes a free slot. Samples whose predictor still needs its first k
tokens are probed first (they decode k+1 tokens, return to the queue with their KV kept, then get a prediction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trl_infinite.engine.config.registry import register_scheduler
from trl_infinite.engine.sched.policies.base import SchedulePolicy, SchedulerView
from trl_infinite.engine.sched.policies.fptas import fptas_partition
from trl_infinite.engine.sched.predictors.base import GroupPredictor, LengthPredictor
from trl_infinite.engine.sched.sequence import Group, Sequence

if TYPE_CHECKING:
    from trl_infinite.engine.config.engine_config import SchedulingConfig


class LengthAwarePolicy(SchedulePolicy):
    """Ranks by `predictor`, the engine's `LengthPredictor` (shared across calls, so it keeps learning)."""

    def __init__(self, config: SchedulingConfig, predictor: LengthPredictor, slot_limit: int | None) -> None:
        self.predictor = predictor

    def probing(self, seq: Sequence) -> bool:
        """Still decoding the prefix its predictor needs (the k tokens, plus the one whose input is token k)."""
        k = self.predictor.prefix_k
        return k is not None and seq.num_generated <= k and not self.predictor.has_estimate(seq)

    def remaining(self, seq: Sequence) -> float:
        return self.predictor.estimate(seq) - seq.num_generated

    def chunk_limit(self, seq: Sequence) -> int | None:
        """A run that started inside the prefix with no estimate yet stops after token k+1 (the hidden state at
        token k is then known), so the sample is ranked again with its prediction; its k+1 tokens and KV are kept.
        A sample the predictor answers for without its prefix (history, finished siblings) is not stopped."""
        k = self.predictor.prefix_k
        if k is None or seq.chunk_start > k or not self.predictor.needs_prefix(seq):
            return None
        return k + 1

    def split_probes(self, waiting: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        probes = [s for s in waiting if self.probing(s)]
        probes.sort(key=lambda s: (s.group_id, s.sample_idx))
        ids = {id(s) for s in probes}
        return probes, [s for s in waiting if id(s) not in ids]

    def on_submit(self, groups: list[Group], sequences: list[Sequence]) -> None:
        self.predictor.begin_call(groups)

    def on_finish(self, seq: Sequence) -> None:
        self.predictor.observe(seq)

    def strict(self) -> bool:
        return False  # a shorter job may pass one that does not fit the free blocks


@register_scheduler("sjf")
class SJFPolicy(LengthAwarePolicy):
    """Shortest (predicted remaining) job first (Infinite Sampling, Alg. 3)."""

    def ordered(self, view: SchedulerView) -> list[Sequence]:
        probes, rest = self.split_probes(view.waiting)
        return probes + sorted(rest, key=lambda s: (self.remaining(s), s.group_id, s.sample_idx))


@register_scheduler("lfs")
class LFSPolicy(LengthAwarePolicy):
    """Longest (predicted total) first: long samples start early, short ones fill around them at the end."""

    def ordered(self, view: SchedulerView) -> list[Sequence]:
        probes, rest = self.split_probes(view.waiting)
        return probes + sorted(rest, key=lambda s: (-self.predictor.estimate(s), s.group_id, s.sample_idx))


@register_scheduler("fptas")
class FPTASPolicy(LengthAwarePolicy):
    """Static plan (Alg. 2): the pending samples are split into `num_slots` bins of balanced predicted length (made
    once every pending sample has its prediction); each slot runs its own bin's samples one after another, in plan
    order, and idles when its bin is empty (the "FPTAS only" ablation of Infinite Sampling's Table 2)."""

    steal = False

    def __init__(self, config: SchedulingConfig, predictor: LengthPredictor, slot_limit: int | None) -> None:
        super().__init__(config, predictor, slot_limit)
        self.num_slots = slot_limit
        self.eps = config.fptas.epsilon
        self.num_bins = 0
        # side tables by seq_id (this policy lives for one call)
        self.planned: dict[int, tuple[int, int]] = {}  # (bin, position in the bin) of the plan
        self.slot: dict[int, int] = {}  # slot (bin) a running sample occupies
        self.next_slot: dict[int, int] = {}  # slot a sample was picked for, committed once it is admitted
        self.slot_order: dict[int, int] = {}  # `admit_order` of the admission the slot was committed for

    def plan(self, waiting: list[Sequence]) -> None:
        if self.num_bins or not waiting or any(self.probing(s) for s in waiting):
            return
        self.num_bins = min(self.num_slots or len(waiting), len(waiting))
        costs = [max(1.0, self.remaining(s)) for s in waiting]
        plan, _ = fptas_partition(costs, self.num_bins, self.eps)
        for b, items in enumerate(plan):
            for pos, i in enumerate(items):
                self.planned[waiting[i].seq_id] = (b, pos)
                self.slot[waiting[i].seq_id] = b

    def pick(self, own: list[Sequence]) -> Sequence:
        return min(own, key=lambda s: self.planned[s.seq_id][1])

    def ordered(self, view: SchedulerView) -> list[Sequence]:
        self.plan(view.waiting)
        probes, rest = self.split_probes(view.waiting)
        if not self.num_bins:
            return probes + sorted(rest, key=lambda s: (s.group_id, s.sample_idx))
        busy = {self.slot.get(s.seq_id) for s in view.running}
        pending: dict[int, list[Sequence]] = {}
        for s in rest:
            pending.setdefault(self.planned[s.seq_id][0] if s.seq_id in self.planned else -1, []).append(s)
        picks: list[Sequence] = list(pending.pop(-1, []))  # submitted after the plan: any free slot
        taken: set[int] = set()
        for b in range(self.num_bins):
            if b in busy:
                continue
            own = [s for s in pending.get(b, []) if id(s) not in taken]
            if own:
                seq = self.pick(own)
            elif self.steal:
                pool = [s for ss in pending.values() for s in ss if id(s) not in taken]
                if not pool:
                    continue
                seq = min(pool, key=lambda s: (self.remaining(s), s.group_id, s.sample_idx))
            else:
                continue
            self.next_slot[seq.seq_id] = b
            taken.add(id(seq))
            picks.append(seq)
        return probes + picks

    def on_step(self, view: SchedulerView) -> None:
        for s in view.running:  # commit the slot a sample was admitted into
            if self.slot_order.get(s.seq_id) != s.admit_order and s.seq_id in self.next_slot:
                self.slot[s.seq_id] = self.next_slot.pop(s.seq_id)
                self.slot_order[s.seq_id] = s.admit_order


@register_scheduler("infinite")
class InfinitePolicy(FPTASPolicy):
    """Two-stage plan (Alg. 1): the FPTAS bins fill the slots; a freed slot takes the shortest predicted job of its
    own bin, and once its bin is empty the shortest pending job of any bin (SJF refill, Alg. 3), so early finishes
    and mispredictions are absorbed at run time."""

    steal = True

    def pick(self, own: list[Sequence]) -> Sequence:
        return min(own, key=lambda s: (self.remaining(s), s.group_id, s.sample_idx))


@register_scheduler("seer")
class SeerPolicy(LengthAwarePolicy):
    """Seer's context-aware scheduling (Alg. 1): each group's first sample is a probe, run first, smallest generated
    length first (SFS); the others go largest group estimate L_g first (LFS), L_g from finished siblings
    (`max_new_tokens` until one finishes). Pair with `chunk_tokens` for divided rollout."""

    def __init__(self, config: SchedulingConfig, predictor: LengthPredictor, slot_limit: int | None) -> None:
        super().__init__(config, GroupPredictor(), slot_limit)  # Seer's estimate is the group's own, learnt in the call

    def ordered(self, view: SchedulerView) -> list[Sequence]:
        spec = [s for s in view.waiting if s.sample_idx == 0]
        rest = [s for s in view.waiting if s.sample_idx != 0]
        spec.sort(key=lambda s: (s.num_generated, s.group_id))
        rest.sort(key=lambda s: (-self.predictor.estimate(s), -s.num_generated, s.group_id, s.sample_idx))
        return spec + rest


@register_scheduler("lrf")
class LRFPolicy(LengthAwarePolicy):
    """Longest predicted *remaining* first (LPT on what is left): with divided rollout (`chunk_tokens`) a returning
    sample is ranked by E[L - e | L > e], so samples about to end wait and fill the last slots, while samples that
    outlived their prediction and fresh ones run first. Without chunks it orders like `lfs`."""

    def ordered(self, view: SchedulerView) -> list[Sequence]:
        probes, rest = self.split_probes(view.waiting)
        return probes + sorted(rest, key=lambda s: (-self.remaining(s), s.group_id, s.sample_idx))


@register_scheduler("lfs_max")
class LFSMaxPolicy(LengthAwarePolicy):
    """Longest-known-prompt first: a prompt's samples are ranked by the longest completion known for it (its earlier
    visits in the history, this call's finished siblings: Seer's L_g = max finished length, RhymeRL's history); a
    prompt with neither is a potential long tail and goes first (`max_new_tokens`, as in Seer). Ties: returning
    samples with more tokens first, then submission order. Needs no probe."""

    def ordered(self, view: SchedulerView) -> list[Sequence]:
        def key(s: Sequence) -> tuple:
            known = self.predictor.longest_known(s)
            return (-(s.max_new_tokens if known is None else known), -s.num_generated, s.group_id, s.sample_idx)

        return sorted(view.waiting, key=key)

    def chunk_limit(self, seq: Sequence) -> int | None:
        return None
