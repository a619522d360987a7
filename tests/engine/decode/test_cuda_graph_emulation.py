"""The CUDA-graph path of the static decoder, on the CPU stand-in for `torch.cuda.graph` (`decode/cpu_graphs.py`).

Every capture/replay rule runs here without a GPU:
- the warm-up before a capture leaves the live rows and the KV pool as they were (it used to run the step twice on
  the live rows: every capture skipped two tokens of every running sample and could read past the block tables);
- greedy output with graphs (captured, replayed) is token-identical to `model.generate` on Llama, Qwen3, Mistral
  (sliding window), Gemma2 (soft-cap), gpt-oss (sinks, MoE) and Qwen3-MoE (bf16), with the Triton backend (CPU
  interpreter), and with a compiled step;
- buffers are static (no recapture within a call) while the batch switches buckets, samples are preempted and
  rebuilt, and speculative verification forwards run between replays; sampled output equals graphs off;
- parameters moved to new storage between calls are recaptured; rows beyond `cuda_graph_max_batch` run uncaptured;
- a model whose step cannot be captured (MoE in fp32: ATen's grouped matmul reads its offsets on the host) is found
  by the support check's trial capture and runs uncaptured, with a warning;
- the emulator itself refuses what a CUDA capture refuses (host syncs, data-dependent shapes, host uploads, opaque
  kernels, replay on moved storage), also where the code it runs reports the refusal as another error.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _models import reference_greedy, requires_compile, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.decode.compiled import fast_dispatch_supported
from trl_infinite.engine.decode.cpu_graphs import GraphEmulator, emulate_cuda_graphs
from trl_infinite.engine.decode.cuda_graphs import CaptureError
from trl_infinite.engine.decode.graphs import StepGraphs
from trl_infinite.engine.decode.static import bucket_sizes
from trl_infinite.testing.tiny_configs import build_tiny_model

BLOCK = 4
PROMPTS = [[5, 17, 33, 8, 60, 2, 9], [11, 4, 70]]
REFUSALS = ("host_sync", "dynamic_shape", "host_upload", "host_alloc", "untracked_output", "moved_storage")


def _config(**kw) -> EngineConfig:
    base = dict(sampling_mode="fixed_slot", max_active_sequences=3, kv_cache_tokens=512, block_size=BLOCK)
    return EngineConfig(**{**base, **kw})


def _engine(model, **kw) -> tuple[RolloutEngine, GraphEmulator]:
    with emulate_cuda_graphs() as emu:
        return RolloutEngine(model, _config(**kw)), emu


def _moe(model_type: str, experts: str, dtype: torch.dtype = torch.float32):
    model = build_tiny_model(model_type).to(dtype)
    model.set_experts_implementation(experts)
    return model


# transformers' grouped expert matmul (`aten._grouped_mm`) needs torch 2.9
requires_grouped_mm = pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 9),
                                         reason="transformers' grouped_mm experts need torch >= 2.9")

MODELS = {
    "llama": lambda: tiny_model("llama"),
    "qwen3": lambda: tiny_model("qwen3"),
    "mistral_window": lambda: build_tiny_model("mistral"),  # sliding window 6
    "gemma2_softcap": lambda: build_tiny_model("gemma2"),
    # gpt-oss in fp32 with transformers' batched expert matmul (static shapes: capturable)
    "gpt_oss_sinks": lambda: _moe("gpt_oss", "batched_mm"),
}
GROUPED_MM_MODELS: set[str] = set()


def test_warmup_before_capture_leaves_rows_and_pool_untouched(monkeypatch):
    """Right before the capture the rows hold what the host uploaded, and the pool what the prefill wrote; the
    warm-up and the capture itself (like a CUDA capture) leave both as they were."""
    model = tiny_model("qwen3")
    seen = []
    original = StepGraphs._capture

    def spy(self, args, run, record):
        inputs, pool = args[0], self.pool  # the live rows' [token; position] view
        before = (inputs.clone(), [k.clone() for k in pool.k_caches], [v.clone() for v in pool.v_caches])
        captured = original(self, args, run, record)
        seen.append(torch.equal(inputs, before[0]))
        seen.append(all(torch.equal(k, b) for k, b in zip(pool.k_caches + pool.v_caches, before[1] + before[2])))
        return captured

    monkeypatch.setattr(StepGraphs, "_capture", spy)
    engine, emu = _engine(model)
    engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, temperature=0.0))
    assert emu.counts["captures"] >= 2 and seen and all(seen), seen


@pytest.mark.parametrize("name", [pytest.param(n, marks=requires_grouped_mm) if n in GROUPED_MM_MODELS else n
                                  for n in MODELS])
def test_graphs_are_token_identical_to_generate(name):
    model = MODELS[name]()
    refs = [reference_greedy(model, p, 8, []) for p in PROMPTS]
    engine, emu = _engine(model)
    result = engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert result.completion_ids == [r for r in refs for _ in range(3)]
    assert engine.decoder.use_graphs and emu.counts["captures"] >= 2 and emu.counts["replays"] >= 10
    assert not any(emu.counts[k] for k in REFUSALS) and engine.decoder.graphs.recaptures == 0
    assert result.stats.extra["cuda_graph_bytes"] == emu.pool_memory().reserved > 0


@pytest.mark.parametrize("kw", [
    pytest.param(dict(attention_backend="triton"), id="triton"),
    pytest.param(dict(compile=True, compile_backend="aot_eager"), id="compiled", marks=requires_compile),
    pytest.param(dict(attention_backend="triton", compile=True, compile_backend="aot_eager"), id="triton-compiled",
                 marks=requires_compile)])
def test_graphs_of_triton_kernels_and_compiled_steps(kw):
    """The Triton cascade kernels (their launches are graph nodes), a compiled step (its compiled graph called
    without entering Dynamo) and both (the kernels' custom op inside the compiled graph) capture and replay
    token-identically."""
    if kw.get("compile") and not fast_dispatch_supported():
        # without the direct dispatch the capture calls the guarded compiled function, which Dynamo skips (torch
        # 2.14: "non-infra torch dispatch mode present") or traces again under the emulator's dispatch mode, into
        # the interpreter's kernel launch: an emulator limit (a CUDA capture has no dispatch mode); the compiled step
        # without graphs: test_compiled_step.py, test_triton_compiled.py
        pytest.skip(f"torch {torch.__version__}: the capture emulation of a compiled step needs the direct "
                    "dispatch (decode.compiled.FAST_DISPATCH_TORCH)")
    torch._dynamo.reset()  # nothing compiled by an earlier test is traced again under the emulator
    model = tiny_model("qwen3")
    refs = [reference_greedy(model, p, 8, []) for p in PROMPTS]
    engine, emu = _engine(model, **kw)
    result = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert result.completion_ids == [r for r in refs for _ in range(2)]
    assert engine.decoder.use_graphs and emu.counts["replays"] >= 10 and not any(emu.counts[k] for k in REFUSALS)


def _sampled_pair(model, prompts, g, sampling, forced=None, **kw):
    """(graphs on, graphs off) results of the same call, and the emulator."""
    engine, emu = _engine(model, **kw)
    on = engine.generate(prompts, g, sampling, forced_lengths=forced)
    off = RolloutEngine(model, _config(cuda_graphs=False, **kw)).generate(prompts, g, sampling, forced_lengths=forced)
    return on, off, engine, emu


def _same(on, off) -> None:
    assert on.completion_ids == off.completion_ids
    for a, b in zip(on.logprobs, off.logprobs):  # a graph's table widths are bucketed: other padding, same values
        assert a == pytest.approx(b, abs=1e-5)


def test_bucket_switches_mid_rollout_sampled_identical():
    """Samples finish one after another: the batch goes through buckets 8, 4, 2, 1 (on CPU multiples of the row plan's; one graph each, captured as
    first needed, while other rows keep decoding); top-p sampling with a repetition penalty (seen marks advanced
    by the step) equals graphs off."""
    model = tiny_model("llama")
    forced = [[2, 3, 4, 5, 6, 8, 11, 14]]
    sampling = SamplingParams(max_new_tokens=14, temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=3)
    on, off, engine, emu = _sampled_pair(model, [[5, 6, 7, 8, 9]], 8, sampling, forced, max_active_sequences=8)
    _same(on, off)
    buckets = {key[0] for key in engine.decoder.graphs.graphs}
    want = set(bucket_sizes(8, engine.runner.row_multiple))  # 8, 4, 2, 1; on CPU multiples of the row plan's
    assert buckets == want and emu.counts["captures"] >= len(want) and engine.decoder.graphs.recaptures == 0


def test_preemption_and_rebuilds_between_replays():
    """A pool too small for every sample: samples are preempted and recomputed into new blocks between replays
    (their rows rewritten in the static buffers); output equals graphs off and `model.generate`."""
    model = tiny_model("qwen3")
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    refs = [reference_greedy(model, p, 12, []) for p in prompts]
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    on, off, engine, emu = _sampled_pair(model, prompts, 3, sampling, kv_cache_tokens=(3 + 3 + 1) * BLOCK,
                                         scheduler="fifo")
    assert on.stats.preemptions > 0
    assert on.completion_ids == off.completion_ids == [r for r in refs for _ in range(3)]
    assert emu.counts["replays"] > 0 and engine.decoder.graphs.recaptures == 0


def test_speculative_verify_steps_between_replays():
    """Speculative decoding: verification forwards (eager, several tokens per row) alternate with captured plain
    steps; the rows are rebuilt after each verification. Greedy output equals `model.generate`."""
    model = tiny_model("llama")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9]]
    refs = [reference_greedy(model, p, 16, []) for p in prompts]
    engine, emu = _engine(model, speculative_method="ngram", speculative_adaptive=False, speculative_num_tokens=3,
                          speculative_ngram_min_n=1)
    result = engine.generate(prompts, 2, SamplingParams(max_new_tokens=16, temperature=0.0))
    assert result.completion_ids == [r for r in refs for _ in range(2)]
    assert result.stats.verify_steps > 0 and emu.counts["replays"] > 0


def test_parameters_in_new_storage_are_recaptured():
    """Between calls the parameters move (ZeRO-3 / FSDP gathers): the next call recaptures every graph (replaying
    the old ones would read freed memory: the emulator refuses that) and follows the updated weights."""
    model = tiny_model("qwen3")
    engine, emu = _engine(model)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine.generate(PROMPTS, 1, sampling)
    first = emu.counts["captures"]
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data + torch.randn_like(p) * 0.5
    out = engine.generate(PROMPTS, 1, sampling).completion_ids
    assert out == [reference_greedy(model, p, 8, []) for p in PROMPTS]
    assert emu.counts["captures"] > first and not emu.counts["moved_storage"]


def test_batches_above_the_graph_limit_run_uncaptured():
    model = tiny_model("qwen3")
    refs = [reference_greedy(model, p, 6, []) for p in PROMPTS]
    engine, emu = _engine(model, max_active_sequences=8, cuda_graph_max_batch=2)
    result = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert result.completion_ids == [r for r in refs for _ in range(4)]
    assert {key[0] for key in engine.decoder.graphs.graphs} <= {1, 2}  # the 8-row steps ran uncaptured


@requires_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uncapturable_model_runs_uncaptured_with_a_warning(caplog, dtype):
    """Qwen3-MoE with transformers' grouped expert matmul: the group offsets are copied to the host (fp32: ATen's
    fallback; bf16: seen on an H100, torch 2.11: "Cannot copy between CPU and CUDA tensors during CUDA graph
    capture"). The support check's trial capture finds it, turns graphs off with a warning, and the engine still
    generates exactly."""
    model = _moe("qwen3_moe", "grouped_mm", dtype)
    refs = [reference_greedy(model, p, 6, []) for p in PROMPTS]
    with caplog.at_level(logging.WARNING, logger="trl_infinite.engine.decode.graphs"):
        engine, emu = _engine(model)
    assert not engine.decoder.use_graphs and emu.counts["host_sync"] == 1 and not emu.counts["captures"]
    assert "_grouped_mm" in engine.decoder.graphs.failure and "cannot be captured" in caplog.text
    result = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert result.completion_ids == [r for r in refs for _ in range(2)]


# ------------------------------------------------------------------------------------------------ the emulator


def _capture(fn):
    emu = GraphEmulator()
    with torch.inference_mode():
        return emu, *emu.capture(fn)


def test_emulator_replays_recorded_ops_on_the_same_buffers():
    """Capture runs nothing for real (the written tensor is put back); replay re-runs the ops on the captured
    buffers, output in the same static tensor; Python is not re-run (a host value read at capture stays frozen)."""
    x = torch.arange(4.0)
    state = torch.zeros(4)
    scale = [2.0]

    def step():
        y = x * scale[0] + state
        state.add_(1.0)
        return y

    emu, graph, out = _capture(step)
    assert torch.equal(state, torch.zeros(4))  # the capture left no trace
    scale[0] = 100.0  # a host value: frozen at capture, as in a CUDA graph
    for i in range(3):
        graph.replay()
        assert torch.equal(out, x * 2.0 + i) and torch.equal(state, torch.full((4,), i + 1.0))
    x.copy_(torch.ones(4))  # same buffer, new contents: seen by the replay
    graph.replay()
    assert torch.equal(out, torch.full((4,), 2.0 + 3.0))
    assert emu.counts["captures"] == 1 and emu.counts["replays"] == 4
    assert emu.pool_memory().reserved >= 2 * 4 * 4  # y and x * scale


@pytest.mark.parametrize("kind, fn", [
    ("host_sync", lambda x: x.sum().item()),
    ("host_sync", lambda x: x.tolist()),
    ("host_sync", lambda x: bool(x[0] > 0)),
    ("dynamic_shape", lambda x: x.nonzero()),
    ("dynamic_shape", lambda x: x[x > 1]),
    ("dynamic_shape", lambda x: torch.repeat_interleave(x.long())),
    ("host_upload", lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0])),
    # CUDA's index_put_ copies the host scalar. Two index tensors: torch 2.15 lowers `x[index] = scalar` with one to
    # `index_fill_` (capture-safe, not refused), earlier releases to `index_put_`
    ("host_upload", lambda x: x.view(2, 2).__setitem__((x[:2].long(), x[:2].long()), 0.0)),
    ("host_upload", lambda x: x.index_put_((x.long(),), torch.tensor(0.0))),
], ids=["item", "tolist", "bool", "nonzero", "mask_index", "repeat_interleave", "torch_tensor", "index_put_scalar",
        "index_put_op"])
def test_emulator_refuses_what_a_capture_refuses(kind, fn):
    x = torch.arange(4.0)
    emu = GraphEmulator()
    with torch.inference_mode(), pytest.raises(CaptureError) as err:
        emu.capture(lambda: fn(x))
    assert err.value.kind == kind and emu.counts[kind] == 1 and not emu.counts["captures"]
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]  # host reads work again after the capture


def test_emulator_refuses_outputs_of_unrecorded_kernels_and_moved_storage():
    x = torch.arange(4.0)
    emu = GraphEmulator()
    with torch.inference_mode(), pytest.raises(CaptureError, match="untracked_output"):
        emu.capture(lambda: _opaque(x))
    w = torch.ones(4)
    emu, graph, out = _capture(lambda: x * w)
    w.data = torch.full((4,), 3.0)  # the graph would read the old storage
    with pytest.raises(CaptureError, match="moved_storage"):
        graph.replay()
    assert emu.counts["moved_storage"] == 1


def test_a_refusal_reported_as_another_error_is_still_a_refusal():
    """Inductor's C++ wrapper reports an error raised inside it as `RuntimeError: ... API call failed` (found by the
    engine fuzzer: a compiled step's capture read its size arguments on the host); a CUDA capture's error stays one."""
    x = torch.arange(4.0)

    def wrapped():
        try:
            return x.sum().item()
        except CaptureError as err:
            raise RuntimeError("aoti_torch_item_int64(...) API call failed") from err

    emu = GraphEmulator()
    with torch.inference_mode(), pytest.raises(CaptureError) as err:
        emu.capture(wrapped)
    assert err.value.kind == "host_sync" and emu.counts["host_sync"] == 1 and not emu.counts["captures"]
    with pytest.raises(ZeroDivisionError):  # not a refusal: raised as it is
        emu.capture(lambda: 1 / 0)


def _opaque(x: torch.Tensor) -> torch.Tensor:
    """A kernel outside the dispatcher: writes a fresh tensor through its data pointer (like a C++ wrapper)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        out = torch.empty(4)
        out.copy_(x + 1)
    return out


def test_graphs_outlive_the_pool_released_between_calls():
    """A training loop: rollouts of different sizes (the pool sized per call, released after each), an in-place
    optimizer step between them. The pool keeps its addresses (`KVCachePool(stable=True)`), so each bucket is
    captured once over the whole loop (`RolloutStats.graph_captures` 0 after the first calls), the memory goes back
    after each call, and every call stays token-identical to `model.generate` with the updated weights."""
    model = tiny_model("llama")
    engine, emu = _engine(model, kv_cache_tokens=1024)
    pool = engine.pool
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    captures, addresses = [], set()
    for step, batch in enumerate([PROMPTS, PROMPTS[:1], PROMPTS, [[7, 7, 3, 1, 2, 9, 4, 4, 5, 6, 1], [3]]] * 2):
        result = engine.generate(batch, 3, sampling)
        assert result.completion_ids == [reference_greedy(model, p, 8, []) for p in batch for _ in range(3)]
        assert not pool.allocated and pool.allocated_bytes == 0  # released: the training step has the memory
        captures.append(result.stats.graph_captures)
        addresses.add(tuple(t.data_ptr() for t in pool._views))
        model.zero_grad()
        torch.manual_seed(step)
        model(torch.tensor([batch[0]])).logits.square().mean().backward()
        optimizer.step()  # in place: the parameters keep their storage
    assert captures[0] > 0 and sum(captures[4:]) == 0, captures  # the second pass over the sizes captures nothing
    assert engine.decoder.graphs.recaptures == 0
    assert len(addresses) == 1 and not emu.counts["moved_storage"]


def test_a_pool_allocated_per_call_recaptures_and_says_so(monkeypatch):
    """Without fixed addresses (a device that cannot reserve them) the pool moves between calls of other sizes:
    the next call captures its graphs again, and `graph_captures` counts it."""
    model = tiny_model("llama")
    monkeypatch.setattr("trl_infinite.engine.runner.kv_pool.reserve_range", lambda sizes, device: None)  # as declined
    engine, _ = _engine(model, kv_cache_tokens=1024)
    assert not engine.pool.stable
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    first = engine.generate(PROMPTS, 3, sampling).stats.graph_captures
    engine.generate(PROMPTS[:1], 1, sampling)  # a smaller pool
    again = engine.generate(PROMPTS, 3, sampling)
    assert first > 0 and again.stats.graph_captures > 0
