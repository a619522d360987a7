"""What passes between the scheduler and an executor each step (`ScheduledBatch` out, `StepOutput` back), with the
KV moves the batch orders (`SlotCopy`, `PrefillCopy`, `Swap`; the engine's pool carries them out, the simulator
ignores them). Pure Python: the engine and the trace simulator share these classes."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_infinite.engine.sched.sequence import Group, Sequence


@dataclass(frozen=True)
class SlotCopy:
    """Copy the K/V of pool slots `src` into slots `dst`, every layer (all sources read before any write)."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass(frozen=True)
class PrefillCopy:
    """A partial prefix-cache hit of prompt `group_id`: the slots are copied by every layer of the forward that
    prefills the prompt, right after the layer wrote the forward's new K/V (the source may be a block that a prompt
    admitted earlier in the same step writes in that very forward), never before the forward."""

    group_id: int
    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass(frozen=True)
class Swap:
    """Divided rollout's host tier: `to_host`: copy the K/V of `blocks` to host memory, kept under `key` (the
    sample's id); else write the copy kept under `key` back into `blocks` (possibly other ids) and drop it."""

    key: int
    blocks: tuple[int, ...]
    to_host: bool


KVMove = SlotCopy | PrefillCopy | Swap

INVALID_TOKEN = -1  # an executor's token for a row whose logits were not finite (see `NonFiniteLogitsError`)


class NonFiniteLogitsError(RuntimeError):
    """The model's logits for a sample were NaN or infinite: nothing can be sampled from them (`generate` raises
    "probability tensor contains either `inf`, `nan` or element < 0" there). Names the step and the sample."""

    def __init__(self, step: int, seq: Sequence, token_index: int):
        self.step, self.prompt_index, self.sample_index = step, seq.group_id, seq.sample_idx
        self.token_index = token_index
        super().__init__(f"logits are not finite (NaN or inf) at engine step {step} for prompt {seq.group_id}, "
                         f"sample {seq.sample_idx} (completion token {token_index}): the model's forward produced "
                         "them, so no token can be sampled (`generate` raises 'probability tensor contains either "
                         "`inf`, `nan` or element < 0' here). Check the model's weights and inputs (float16 overflows "
                         "easily).")


@dataclass
class ScheduledBatch:
    """One step of work. `decode` holds every running sample that has a token to feed (all but those whose prompt
    is prefilled in this very step: they get their first token from it and decode from the next step)."""

    prefill_groups: list[Group] = field(default_factory=list)  # prompts to prefill (blocks already allocated)
    recompute: list[Sequence] = field(default_factory=list)  # re-run prompt + output_ids[:-1] into the cache
    decode: list[Sequence] = field(default_factory=list)
    grown: list[Sequence] = field(default_factory=list)  # running samples whose own block list grew in this step
    lookahead: int = 0  # extra KV slots reserved per sample (speculative drafts)
    # KV moves in the order the scheduler issued them (each one's blocks were valid when issued): done in that
    # order before the step's forward (`PrefillCopy`: by the forward's layers); `moves_after`: those `postprocess`
    # issued (completion caching), done right after it (`Executor.after_step`)
    moves: list[KVMove] = field(default_factory=list)
    moves_after: list[KVMove] = field(default_factory=list)
    # samples (re)admitted in this step that already had tokens: preempted, parked or offloaded ones coming back.
    # Their blocks may all have changed since they last decoded (new own blocks, or their prompt evicted and
    # prefilled again into other blocks in this very step), so whatever a decoder kept about them is stale
    readmitted: list[Sequence] = field(default_factory=list)
    # nothing waits for admission after this step's: the call ends when the last of the running samples does
    draining: bool = False


@dataclass
class StepOutput:
    """What an executor returns for one `ScheduledBatch`.

    `first_tokens[i]` / `first_logprobs[i]`: the first token of every sample of `batch.prefill_groups[i]` that has
    none yet (in sample order); `tokens[r]` / `logprobs[r]`: the tokens emitted by decode row r (`batch.decode`
    order; several with speculative decoding; the scheduler keeps them up to the sample's end). A token
    `INVALID_TOKEN` marks logits that were not finite: the scheduler raises `NonFiniteLogitsError`."""

    first_tokens: list[list[int]] = field(default_factory=list)
    first_logprobs: list[list[float]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    # raw log-probs (`SamplingParams.raw_logprobs_temperature`), in the same layout; None when not asked for
    first_raw_logprobs: list[list[float]] | None = None
    raw_logprobs: list[list[float]] | None = None

