"""The CUDA-graph path of the static decoder, on the CPU stand-in for `torch.cuda.graph` (`graph_emulation`).

- The warm-up before a capture leaves the live rows and the KV pool as they were (it used to run the step twice on
  the live rows: every capture skipped two tokens of every running sample).
- Greedy output with graphs (captured, replayed) is token-identical to `model.generate` and to graphs off.
"""

from __future__ import annotations

import torch
from _models import reference_greedy, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.graph_emulation import emulate_cuda_graphs
from trl_infinite.engine.static_decode import StaticDecoder

BLOCK = 4
PROMPTS = [[5, 17, 33, 8, 60, 2, 9], [11, 4, 70]]


def _config(**kw) -> EngineConfig:
    base = dict(sampling_mode="fixed_slot", max_active_sequences=3, kv_cache_tokens=512, block_size=BLOCK)
    return EngineConfig(**{**base, **kw})


def test_warmup_before_capture_leaves_rows_and_pool_untouched(monkeypatch):
    """Right before the capture the rows hold what the host uploaded, and the pool what the prefill wrote; the
    capture itself (like a CUDA capture) leaves both as they were."""
    model = tiny_model("qwen3")
    seen = []
    original = StaticDecoder._capture

    def spy(self, args):
        rows, pool = self.rows, self.runner.pool
        before = (rows.inputs.clone(), [k.clone() for k in pool.k_caches])
        captured = original(self, args)
        seen.append(torch.equal(rows.inputs, before[0]))
        # the only pool slots a step may write before replay: none (the capture runs nothing for real)
        seen.append(all(torch.equal(k, b) for k, b in zip(pool.k_caches, before[1])))
        return captured

    monkeypatch.setattr(StaticDecoder, "_capture", spy)
    with emulate_cuda_graphs() as emu:
        engine = RolloutEngine(model, _config())
        engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, temperature=0.0))
    assert emu.counts["captures"] >= 1 and seen and all(seen), seen


def test_graphs_are_token_identical_to_generate():
    model = tiny_model("qwen3")
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0)
    refs = [reference_greedy(model, p, 16, []) for p in PROMPTS]
    with emulate_cuda_graphs() as emu:
        engine = RolloutEngine(model, _config())
        out = engine.generate(PROMPTS, 3, sampling).completion_ids
    assert emu.counts["captures"] >= 1 and emu.counts["replays"] >= 10
    assert out == [r for r in refs for _ in range(3)]
