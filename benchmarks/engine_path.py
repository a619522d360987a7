"""`RolloutEngine` on a `Workload`, with per-decode-step timing for the roofline column.

Roofline of one decode step = (weight bytes + KV bytes the step must read) / HBM bandwidth. KV bytes read: with the
Triton cascade backend each group's prompt is read once per step plus every sample's own tokens; with the torch
reference every sample reads its whole context. The column reported is sum(measured step times) / sum(roofline
times) over all decode steps of the call (1.0 = at the bandwidth bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from common import Workload

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams


@dataclass
class StepTimes:
    """Decode forwards of one `generate` call: their time and the KV tokens each had to read."""

    device: torch.device
    shared_prefix: bool
    events: list = field(default_factory=list)  # CUDA: (start, end) event pairs; CPU: seconds
    kv_tokens: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)

    def seconds(self) -> list[float]:
        if self.device.type != "cuda":
            return list(self.events)
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) / 1e3 for s, e in self.events]


def _kv_tokens(segments, shared_prefix: bool) -> int:
    own = sum(s.end_pos - s.prompt_len for s in segments)
    if shared_prefix:
        return own + sum({s.group_index: s.prompt_len for s in segments}.values())
    return own + sum(s.prompt_len for s in segments)


def time_decode_steps(engine: RolloutEngine, shared_prefix: bool) -> StepTimes:
    """Wrap `engine.runner.forward` so every decode forward (one token per segment, in own blocks) is timed with
    CUDA events (no extra host sync) or `perf_counter` on CPU."""
    times = StepTimes(engine.device, shared_prefix)
    inner = engine.runner.forward

    def forward(segments, logit_rows, output_hidden=False):
        if not all(len(s.tokens) == 1 and s.suffix_blocks for s in segments):
            return inner(segments, logit_rows, output_hidden)
        times.kv_tokens.append(_kv_tokens(segments, shared_prefix))
        times.batch.append(len(segments))
        if engine.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(segments, logit_rows, output_hidden)
            end.record()
            times.events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = inner(segments, logit_rows, output_hidden)
        times.events.append(time.perf_counter() - t0)
        return out

    engine.runner.forward = forward
    return times


def make_engine(model, mode: str, scheduler: str, slots: int, kv_cache_gb: float | None, backend: str,
                block_size: int) -> RolloutEngine:
    cfg = EngineConfig(sampling_mode=mode, scheduler=scheduler, max_active_sequences=slots, kv_cache_gb=kv_cache_gb,
                       attention_backend=backend, block_size=block_size)
    return RolloutEngine(model, cfg)


def run_engine(engine: RolloutEngine, workload: Workload, max_new: int, seed: int = 0):
    sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0, eos_token_ids=[workload.eos_id], seed=seed)
    return engine.generate(workload.prompt_ids, workload.group_size, sampling, forced_lengths=workload.lengths)


def roofline(times: StepTimes, weight_bytes: int, kv_bytes_per_token: int, hbm_gbps: float | None) -> dict:
    secs = times.seconds()
    if not secs:
        return {}
    out = {"decode_step_ms": 1e3 * sum(secs) / len(secs), "mean_batch": sum(times.batch) / len(times.batch)}
    if hbm_gbps:
        ideal = [(weight_bytes + k * kv_bytes_per_token) / (hbm_gbps * 1e9) for k in times.kv_tokens]
        out["x_roofline"] = sum(secs) / sum(ideal)
    return out
