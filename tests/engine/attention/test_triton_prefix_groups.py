"""The Triton cascade kernel's prompt splits follow the decode batch's group count (issue #38, item 6).

- `triton_tiles.prefix_splits` sizes the KV splits of the shared prompts by the number of distinct groups (a host
  int, bucketed to a power of two by `group_bucket`): one group of 128 samples gets more splits than 8 groups of 16
  at the same prompt capacity and SM count, and 64 groups of 2 fewer; without a count it keeps its estimate.
- `build_metadata` counts the distinct prompts of its segments; the static decode step puts the bucket of its rows'
  group count into its graph / compile key and the metadata, so a captured graph replays the splits it captured.
- Results are unchanged (CPU interpreter, small shapes): the kernels match the torch reference at the split counts
  the group count gives and at the estimate's, and the engine's greedy output equals the torch backend's while its
  groups finish one after another (buckets 2 then 1), under the CUDA-graph stand-in.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (`pip install triton`); the Triton backend is untested")

from _models import tiny_model  # noqa: E402
from test_triton_attention import DEVICE, PAGE, _decode_segments, _pool, _reference, _triton  # noqa: E402

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from trl_infinite.engine.attention import LayerAttention, build_metadata  # noqa: E402
from trl_infinite.engine.attention import triton_backend as tb  # noqa: E402
from trl_infinite.engine.attention import triton_tiles as tiles  # noqa: E402
from trl_infinite.engine.decode.cpu_graphs import emulate_cuda_graphs  # noqa: E402
from trl_infinite.engine.decode.static import StaticDecoder  # noqa: E402


def test_group_bucket_is_the_next_power_of_two():
    assert [tiles.group_bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 128)] == [1, 1, 2, 4, 8, 8, 16, 128]


def test_split_count_follows_the_group_count():
    # 128 rows, 8 KV heads, 32 query heads, Dv 128, a 4096-token prompt table, 132 SMs
    one_group = tiles.prefix_splits(128, 8, 32, 128, 4096, 132, num_groups=1)
    eight_groups = tiles.prefix_splits(128, 8, 32, 128, 4096, 132, num_groups=8)
    assert one_group == 16 > eight_groups == 4  # 8 programs -> 16 splits; 64 programs: ceil(264 / 64) = 5 -> 4
    assert tiles.prefix_splits(128, 8, 32, 128, 4096, 132) == eight_groups  # unknown: groups of 16 assumed
    assert tiles.prefix_splits(128, 8, 32, 128, 4096, 132, num_groups=64) == 1  # 512 programs: 4 waves already
    assert tiles.prefix_splits(128, 8, 32, 128, 4096, 132, num_groups=5) == eight_groups  # bucketed up to 8
    # the capacity floor (>= 256 prompt positions per split) and the partials' memory cap still apply
    assert tiles.prefix_splits(128, 8, 32, 128, 1024, 132, num_groups=1) == 4
    assert tiles.prefix_splits(256, 1, 128, 512, 8192, 132, num_groups=1) == 1


def test_build_metadata_counts_distinct_prompts():
    segs, _ = _decode_segments([3, 1, 4], [9, 1, 37], seed=1)
    assert build_metadata(segs, PAGE, DEVICE)[2].num_groups == 3
    # unlabelled groups (all group 0) with distinct prompt blocks are still distinct prompts (the kernel's runs)
    segs, _ = _decode_segments([2, 2, 1], [5, 8, 5], seed=5, shared=False)
    assert build_metadata(segs, PAGE, DEVICE)[2].num_groups == 3


def test_kernels_match_reference_at_the_group_count_splits(monkeypatch):
    """8 segments in 3 groups on a pretend 16-SM device, 2 KV heads, splits of >= 4 prompt positions: the estimate
    (one group of 16) gives 16 splits, the count (bucket 4) 4; both equal the torch reference."""
    monkeypatch.setattr(tiles, "MIN_SPLIT_TOKENS", 4)
    monkeypatch.setattr(tb, "device_sms", lambda device: 16)
    chosen = []
    monkeypatch.setattr(tb, "prefix_splits", lambda *args: chosen.append(tiles.prefix_splits(*args)) or chosen[-1])
    segs, n = _decode_segments([3, 1, 4], [29, 5, 70], seed=4)
    k, v = _pool(n, 2, 8, torch.float32)
    _, _, meta = build_metadata(segs, PAGE, DEVICE)
    q = torch.randn(len(segs), 4, 8, device=DEVICE)
    layer = LayerAttention(scale=8**-0.5, sliding_window=40)
    ref = _reference(q, k, v, meta, layer)
    for groups, splits in ((meta.num_groups, 4), (None, 16)):
        got = _triton(q, k, v, replace(meta, num_groups=groups), layer)
        assert chosen[-1] == splits
        assert (got - ref).abs().max().item() < 1e-5


def test_static_step_keys_and_metadata_carry_the_group_bucket(monkeypatch):
    """Two prompts x 2 samples, the first prompt's samples done after 3 tokens: the steps' graph keys (captured on
    the CPU stand-in) carry group buckets 2 then 1, the kernels get the same count, and the tokens equal the torch
    backend's."""
    keys, counts = [], []
    inputs_of = StaticDecoder._inputs

    def spy_inputs(self, padded, captured):
        x, key = inputs_of(self, padded, captured)
        keys.append(key)
        return x, key

    monkeypatch.setattr(StaticDecoder, "_inputs", spy_inputs)
    monkeypatch.setattr(tb, "prefix_splits", lambda *args: counts.append(args[-1]) or tiles.prefix_splits(*args))
    model = tiny_model("qwen3")
    prompts, forced = [[5, 17, 33, 8, 60, 2, 9], [11, 4, 70]], [[3, 3], [7, 7]]
    sampling = SamplingParams(max_new_tokens=7, temperature=0.0)
    out = {}
    for backend in ("torch", "triton"):
        cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=4, kv_cache_tokens=512, block_size=4,
                           attention_backend=backend)
        with emulate_cuda_graphs():
            engine = RolloutEngine(model, cfg)
        keys.clear()
        counts.clear()  # (the support check's probe forwards: no group count)
        out[backend] = engine.generate(prompts, 2, sampling, forced_lengths=forced).completion_ids
        buckets = [key[-1] for key in keys if key != ("check",)]
        assert buckets, backend
        if backend == "torch":
            assert set(buckets) == {0}  # the torch backend reads no group count: no extra graphs
    assert buckets[0] == 2 and buckets[-1] == 1 and sorted(set(buckets)) == [1, 2]
    assert set(counts) == {1, 2}  # what the kernels got (warm-ups, captures: replays run no Python)
    assert engine.decoder.use_graphs and {k[-1] for k in engine.decoder.graphs.graphs} == {1, 2}
    assert out["triton"] == out["torch"]
