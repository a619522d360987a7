"""What `RolloutEngine.generate` returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RolloutStats:
    """Counters of one `generate` call (all per call, none cumulative)."""

    decode_steps: int = 0  # model forward passes in the decode phase (verification passes included)
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    prefill_steps: int = 0
    generated_tokens: int = 0
    peak_active_sequences: int = 0
    mean_active_sequences: float = 0.0
    peak_kv_blocks: int = 0
    num_kv_blocks: int = 0
    kv_block_bytes: int = 0
    kv_utilization: float = 0.0  # mean fraction of pool blocks in use over decode steps
    preemptions: int = 0
    prompt_evictions: int = 0
    wall_time_s: float = 0.0
    peak_memory_bytes: int = 0  # CUDA peak during the call, 0 on CPU
    tail_decode_steps: int = 0  # decode steps after 90% of the samples had finished
    offloaded_blocks: int = 0  # divided rollout: KV blocks of parked samples moved to host memory (and back)
    draft_tokens: int = 0  # speculative draft tokens verified
    accepted_tokens: int = 0  # of which accepted
    verify_steps: int = 0  # decode forwards that verified at least one draft
    mean_acceptance_length: float = 0.0  # tokens emitted per sample per verification forward (bonus included)
    host_time_s: float = 0.0  # host work around the forwards: scheduling, postprocess, decode-batch upload, read-back
    decode_forward_s: float = 0.0  # time in decode forwards (sampling included; on CUDA up to the token read-back)
    extra: dict = field(default_factory=dict)  # counters of plug-ins (speculation, predictors, offload)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def host_ms_per_step(self) -> float:
        """Host work per decode step (ms): what a captured GPU step cannot hide unless it overlaps."""
        return 1e3 * self.host_time_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def peak_kv_bytes(self) -> int:
        return self.peak_kv_blocks * self.kv_block_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(out.pop("extra"))
        out["tokens_per_second"] = self.tokens_per_second
        return out


@dataclass
class RolloutResult:
    """`completion_ids[i * G + j]` is sample j of prompt i, cut after its first EOS (kept). `logprobs`: each token's
    log-probability under the processed distribution it was drawn from; `raw_logprobs` (only with
    `SamplingParams.raw_logprobs_temperature`, else None): under `softmax(raw logits / raw_logprobs_temperature)`."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    stats: RolloutStats
    finish_reasons: list[str] = field(default_factory=list)
    raw_logprobs: list[list[float]] | None = None
