"""`RolloutEngine` on a `Workload`, with per-decode-step timing for the roofline column.

Step times come from `RolloutEngine.generate(on_decode_step=...)`: the wall seconds of each step's execution (on
CUDA up to the sampled tokens' read-back, so the device work is in it; with CUDA graphs the replay, without them the
eager forward). Only steps that ran nothing but the decode forward are used (a step that also prefilled a prompt,
recomputed a preempted sample or moved KV to / from the host is left out).

Roofline of one decode step = (weight bytes + KV bytes the step must read) / HBM bandwidth. KV bytes read: with the
Triton cascade backend each group's prompt is read once per step plus every sample's own tokens; with the torch
reference every sample reads its whole context. A row's context is its prompt and every output token, the input
token included (its KV is written, then read, in the same step). The column reported is sum(measured step times) /
sum(roofline times) over the steps used (1.0 = at the bandwidth bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import Workload

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.sched.batch import ScheduledBatch


@dataclass
class StepTimes:
    """The decode steps of one `generate` call (pass the object as `on_decode_step`)."""

    shared_prefix: bool  # the attention backend reads each group's prompt once per step (cascade)
    seconds: list[float] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)  # KV positions the step reads
    rows: list[int] = field(default_factory=list)  # samples in the decode forward
    decode_only: list[bool] = field(default_factory=list)  # nothing but the decode forward ran in the step

    def __call__(self, batch: ScheduledBatch, seconds: float) -> None:
        self.seconds.append(seconds)
        self.kv_tokens.append(kv_tokens_read(batch, self.shared_prefix))
        self.rows.append(len(batch.decode))
        self.decode_only.append(not (batch.prefill_groups or batch.recompute or batch.moves))

    def used(self, rows: int | None = None) -> list[int]:
        """Indices of the decode-only steps (with exactly `rows` samples, if given)."""
        return [i for i, ok in enumerate(self.decode_only) if ok and (rows is None or self.rows[i] == rows)]


def kv_tokens_read(batch: ScheduledBatch, shared_prefix: bool) -> int:
    """KV positions one decode forward reads: every row's own tokens, plus each group's prompt once (cascade) or
    once per row (no sharing)."""
    seqs = batch.decode
    own = sum(s.num_generated for s in seqs)
    if shared_prefix:
        return own + sum({s.group_id: s.prompt_len for s in seqs}.values())
    return own + sum(s.prompt_len for s in seqs)


def make_engine(model, mode: str, scheduler: str, slots: int, kv_cache_gb: float | None, backend: str,
                block_size: int, cuda_graphs: bool = True) -> RolloutEngine:
    cfg = EngineConfig(sampling_mode=mode, scheduler=scheduler, max_active_sequences=slots, kv_cache_gb=kv_cache_gb,
                       attention_backend=backend, block_size=block_size, cuda_graphs=cuda_graphs)
    return RolloutEngine(model, cfg)


def shares_prefix(engine: RolloutEngine) -> bool:
    """Whether the engine's attention backend reads a group's prompt once per decode step (Triton cascade)."""
    return engine.runner.backend.attend.__name__ == "triton_paged_attention"


def run_engine(engine: RolloutEngine, workload: Workload, max_new: int, seed: int = 0, on_decode_step=None):
    sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0, eos_token_ids=[workload.eos_id], seed=seed)
    return engine.generate(workload.prompt_ids, workload.group_size, sampling, forced_lengths=workload.lengths,
                           on_decode_step=on_decode_step)


def bucket_warmup(workload: Workload, distinct: int = 48) -> Workload:
    """The same prompts and G with short, spread lengths (2 .. distinct + 1 tokens): as samples finish one by one
    the decode batch passes through every size, so every CUDA-graph bucket the measured call can use is captured
    before it (capture is a one-off cost per engine, not a per-call one)."""
    g = workload.group_size
    lengths = [[2 + (i * g + j) % distinct for j in range(g)] for i in range(len(workload.prompt_ids))]
    return Workload(workload.prompt_ids, lengths, "warmup", workload.eos_id, workload.pad_id)


def roofline(times: StepTimes, weight_bytes: int, kv_bytes_per_token: int, hbm_gbps: float | None,
             copy_gbps: float | None = None, rows: int | None = None) -> dict:
    """Mean step time (ms), mean rows, mean KV GB read, roofline time (ms) and the ratios over the decode-only steps
    (with exactly `rows` samples, if given). `x_roofline` uses `hbm_gbps` (datasheet), `x_copy` the measured copy
    bandwidth."""
    idx = times.used(rows)
    if not idx:
        return {}
    secs = sum(times.seconds[i] for i in idx)
    kv = [times.kv_tokens[i] * kv_bytes_per_token for i in idx]
    out = {"steps_used": len(idx), "decode_step_ms": 1e3 * secs / len(idx),
           "mean_batch": sum(times.rows[i] for i in idx) / len(idx), "kv_GB": sum(kv) / len(idx) / 1e9}
    for name, gbps in (("roofline", hbm_gbps), ("copy", copy_gbps)):
        if gbps:
            ideal = sum(weight_bytes + k for k in kv) / (gbps * 1e9)
            out[f"{name}_ms"] = 1e3 * ideal / len(idx)
            out[f"x_{name}"] = secs / ideal
    return out
