"""What `RolloutEngine.generate` returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

_MAX = ("peak_active_sequences", "peak_kv_blocks", "num_kv_blocks", "kv_block_bytes", "peak_memory_bytes",
        "weight_copy_bytes")
_WEIGHTED = {"kv_utilization": "scheduler_steps", "mean_acceptance_length": "verify_steps"}


@dataclass
class RolloutStats:
    """Counters of one `generate` call (all per call, none cumulative): the one stats type of the engine and the
    simulator. Totals over several calls: `RolloutStats.total(calls)`."""

    decode_steps: int = 0  # model forward passes in the decode phase (verification passes included)
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose KV was found in the prefix cache (not prefilled)
    cached_completion_blocks: int = 0  # completion blocks registered in the prefix cache (for a next turn)
    prefill_steps: int = 0
    generated_tokens: int = 0
    num_samples: int = 0
    scheduler_steps: int = 0  # steps scheduled (a step that only prefills included)
    active_sequence_steps: int = 0  # running samples summed over the scheduled steps
    peak_active_sequences: int = 0
    peak_kv_blocks: int = 0
    num_kv_blocks: int = 0
    kv_block_bytes: int = 0
    kv_utilization: float = 0.0  # mean fraction of pool blocks in use over decode steps
    preemptions: int = 0
    prompt_evictions: int = 0
    parks: int = 0  # divided rollout: a sample returned to the queue with its KV kept
    wall_time_s: float = 0.0
    peak_memory_bytes: int = 0  # CUDA peak during the call, 0 on CPU
    weight_copy_bytes: int = 0  # the 16-bit copy of the weights the call ran on (`engine/runner/weight_copy.py`), 0 if none
    tail_decode_steps: int = 0  # decode steps after 90% of the samples had finished
    offloaded_blocks: int = 0  # divided rollout: KV blocks of parked samples moved to host memory (and back)
    draft_tokens: int = 0  # speculative draft tokens verified
    accepted_tokens: int = 0  # of which accepted
    verify_steps: int = 0  # decode forwards that verified at least one draft
    mean_acceptance_length: float = 0.0  # tokens emitted per sample per verification forward (bonus included)
    host_time_s: float = 0.0  # host work around the forwards: scheduling, postprocess, decode-batch upload, read-back
    decode_forward_s: float = 0.0  # time in decode forwards (sampling included; on CUDA up to the token read-back)
    graph_captures: int = 0  # decode-step graphs captured during the call (0 once every bucket in use is captured)
    # |first length prediction - true length| of the samples scored in this call, and the same for the constant-mean
    # predictor (the 'history' predictor only)
    prediction_errors: list[float] = field(default_factory=list)
    constant_errors: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # counters of plug-ins (speculation, predictors, offload)

    @classmethod
    def total(cls, calls: list[RolloutStats]) -> RolloutStats:
        """One `RolloutStats` for several calls: counts and errors summed / joined, peaks the largest, the KV
        utilization and the mean acceptance length weighted by the steps they are means over (`extra` left out)."""
        out = {}
        for f in fields(cls):
            values = [getattr(c, f.name) for c in calls]
            if f.name == "extra" or not values:
                continue
            if f.name in _MAX:
                value = max(values)
            elif f.name in _WEIGHTED:
                weights = [getattr(c, _WEIGHTED[f.name]) for c in calls]
                value = sum(v * w for v, w in zip(values, weights)) / sum(weights) if sum(weights) else 0.0
            elif isinstance(values[0], list):
                value = [x for v in values for x in v]
            else:
                value = sum(values)
            out[f.name] = value
        return cls(**out)

    @property
    def mean_active_sequences(self) -> float:
        return self.active_sequence_steps / self.scheduler_steps if self.scheduler_steps else 0.0

    @property
    def prediction_mae(self) -> float | None:
        return sum(self.prediction_errors) / len(self.prediction_errors) if self.prediction_errors else None

    @property
    def constant_mae(self) -> float | None:
        return sum(self.constant_errors) / len(self.constant_errors) if self.constant_errors else None

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
        out["mean_active_sequences"] = self.mean_active_sequences
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
