"""The decode-step protocol (`DecodeStep`) and what every step shares: the call's `StepContext` (sampling with keys and
context rows), the one read-back of a step's results (`pack`, `ReadBack`) and the eager step.

A step is `launch(batch) -> complete`: `launch` starts the decode forward over `batch.decode` and returns the
function that waits for it and gives the step's `Decoded`. Three steps implement it: the static step
(`static.StaticDecoder`: fixed-shape device rows, compiled and / or captured), the eager step (`EagerStep`: host-built
segments, for samplers with extra `GenerationConfig` processors) and the speculative step
(`spec_decode.step.SpeculativeStep`: drafts and one verification forward). The executor calls nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.runner.kv_pool import KVCachePool
from trl_infinite.engine.runner.model_runner import ModelRunner, sample_segment
from trl_infinite.engine.runner.sampler import Sampler, row_keys, seen_mask
from trl_infinite.engine.sched.batch import ScheduledBatch
from trl_infinite.engine.sched.predictors.base import LengthPredictor
from trl_infinite.engine.sched.sequence import Sequence

if TYPE_CHECKING:
    from trl_infinite.engine.decode.static import StaticDecoder


@dataclass
class Decoded:
    """One decode step's result in `batch.decode` order: each row's emitted tokens (one; several with speculation),
    their log-probs and raw log-probs (None unless asked for, `StepOutput`); `hidden` [rows, hidden] on the device
    (or None) holds row i's last hidden state at `rows[i]`."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    raw_logprobs: list[list[float]] | None = None
    hidden: torch.Tensor | None = None
    rows: list[int] | None = None


Pending = Callable[[], Decoded]  # what `DecodeStep.launch` returns: waits for the step, gives its result


class DecodeStep:
    """The decode-step protocol (module docstring); `lookahead`, `after_step` and `close` default to nothing."""

    def launch(self, batch: ScheduledBatch) -> Pending:
        raise NotImplementedError

    def lookahead(self, num_running: int) -> int:
        """KV slots to reserve per sample beyond its next token (drafts)."""
        return 0

    def after_step(self, batch: ScheduledBatch) -> None:
        """After the scheduler appended the step's tokens."""

    def close(self) -> None:
        """End of the call, on every exit path."""


@dataclass(frozen=True)
class StepContext:
    """What every part of one `generate` call's steps shares (handed over at construction, never modified)."""

    runner: ModelRunner
    sampler: Sampler
    seed: int
    stats: RolloutStats
    max_prefill_tokens: int
    decoder: StaticDecoder | None  # the static decode step (rows set up for the call); None: extra processors
    predictor: LengthPredictor | None = None  # a length predictor wanting hidden states (`observe_hidden`)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def pool(self) -> KVCachePool:
        return self.runner.pool

    def wants_hidden(self, seqs: list[Sequence]) -> list[int]:
        """Indices of `seqs` whose decode input is completion token k (`prefix_k`) of the predictor."""
        k = None if self.predictor is None else self.predictor.prefix_k
        return [i for i, s in enumerate(seqs) if s.num_generated == k]

    def deliver_hidden(self, seqs: list[Sequence], decoded: Decoded) -> None:
        """The last hidden state at completion token k to the predictor (where the step returned hidden states)."""
        if decoded.hidden is not None:
            for i in self.wants_hidden(seqs):
                self.predictor.observe_hidden(seqs[i], decoded.hidden[decoded.rows[i]].float().cpu().numpy())

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int],
               contexts: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [N] and log-probs ([N], or [N, 2] with raw ones: `Sampler.sample`) drawn from `logits` [N, V] for
        `seqs` at `positions` (the emitted token's position); `contexts[i]` are the ids row i's context holds
        (needed by the repetition penalty)."""
        seen = history = None
        if self.sampler.uses_context:
            history = padded_rows(contexts).to(self.device)
            if not self.sampler.has_extra_processors:
                seen, history = seen_mask(history, logits.shape[-1]), None
        dev = self.device
        keys = row_keys(self.seed, torch.tensor([s.group_id for s in seqs], device=dev),
                        torch.tensor([s.sample_idx for s in seqs], device=dev), torch.tensor(positions, device=dev))
        processed = self.sampler.process(logits, seen, history, [s.prompt_len for s in seqs])
        return self.sampler.sample(processed, keys, logits)


def padded_rows(lists: list[list[int]], fill: int = -1, width: int | None = None) -> torch.Tensor:
    """[N, width] (default: the longest list) of `lists` padded with `fill`, on the host: each row's context (token
    ids, -1 padded) or block table (null-block padded)."""
    width = max(len(r) for r in lists) if width is None else width
    out = torch.full((len(lists), width), fill, dtype=torch.long)
    for i, r in enumerate(lists):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def pack(*parts: torch.Tensor) -> torch.Tensor:
    """[N, C] float64 of per-row parts ([N] or [N, k]; token ids are exact in float64): what one read-back copies."""
    n = parts[0].shape[0]
    return torch.cat([p.double().reshape(n, -1) for p in parts], 1)


class ReadBack:
    """The one device->host copy of a step's packed results. `non_blocking`: a CUDA tensor is copied into pinned
    memory (PyTorch's caching host allocator; contiguous to contiguous, no pageable temporary) without blocking the
    host until `wait`; otherwise `rows` copies when called."""

    def __init__(self, packed: torch.Tensor, non_blocking: bool = False):
        self.host, self.done = packed, None
        if packed.is_cuda and non_blocking:
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True).copy_(packed, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def rows(self) -> list[list[float]]:
        self.wait()
        return self.host.tolist()


def one_token(host: list[list[float]], rows: list[int], hidden: torch.Tensor | None = None) -> Decoded:
    """The `Decoded` of a one-token step from its read-back rows (token, log-prob[, raw log-prob]); sample i is at
    row `rows[i]`."""
    raw = [[host[r][2]] for r in rows] if len(host[0]) > 2 else None
    return Decoded([[int(host[r][0])] for r in rows], [[host[r][1]] for r in rows], raw, hidden, rows)


class EagerStep(DecodeStep):
    """One eager decode forward (each row's input: its last output token at position `num_tokens - 1`), sampled
    with the sampler's extra processors on each row's full context. Same outputs as the static step's."""

    def __init__(self, ctx: StepContext):
        self.ctx = ctx

    def launch(self, batch: ScheduledBatch) -> Pending:
        seqs, ctx = batch.decode, self.ctx
        segments = [sample_segment(s, s.num_tokens - 1, [s.output_ids[-1]]) for s in seqs]
        logits, hidden = ctx.runner.forward(segments, torch.arange(len(seqs)), output_hidden=bool(ctx.wants_hidden(seqs)))
        contexts = [s.group.prompt_ids + s.output_ids for s in seqs]
        tokens, logprobs = ctx.sample(logits, seqs, [s.num_tokens for s in seqs], contexts)
        decoded = one_token(ReadBack(pack(tokens, logprobs)).rows(), list(range(len(seqs))), hidden)
        return lambda: decoded
