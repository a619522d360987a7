"""The decode step compiled end to end (`torch.compile(fullgraph=True)`) with the Triton attention backend.

- The Triton decode attention is one custom op (`attention/triton_op.py`): its schema, fake implementation and
  (absent) mutations pass `torch.library.opcheck`, its output equals the torch reference's, and a traced backend call
  is exactly one node of it (the eager call skips the op's dispatch: the same body). The body follows the autocast
  state the traced caller passes, not the one around it.
- A tiny model's engine with `attention_backend="triton"` and `compile=True` compiles its step as one graph (a graph
  break would raise under `fullgraph=True`; none is counted) through which the Triton kernels run on every layer,
  and its greedy output is token-identical to `model.generate`, with the `aot_eager` backend (AOTAutograd traces
  the op through its fake implementation; inductor compiles the same graph, but its C++ builds take over a minute
  on a CI core).
- A step that cannot be compiled raises `StepCompileError` naming the setting, which `is_capture_error` does not take
  for a capture failure (the decoder does not turn graphs off over it), unless what failed inside the backend was a
  capture.

Without a GPU the kernels run under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set before triton is imported, as
in `test_triton_attention.py`).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (`pip install triton`); the Triton backend is untested")

from _models import reference_greedy, requires_compile, tiny_model  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from trl_infinite.engine import RolloutEngine  # noqa: E402
from trl_infinite.engine.attention import (  # noqa: E402
    LayerAttention,
    Segment,
    build_metadata,
    torch_paged_attention,
    triton_op,
    with_context,
)
from trl_infinite.engine.attention import triton_backend as tb  # noqa: E402
from trl_infinite.engine.config.engine_config import EngineConfig, SamplingParams  # noqa: E402
from trl_infinite.engine.decode.compiled import CompiledStep, StepCompileError  # noqa: E402
from trl_infinite.engine.decode.cuda_graphs import CaptureError, is_capture_error  # noqa: E402
from trl_infinite.engine.decode.static import bucket_sizes  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = [[3, 14, 15, 9, 2, 6, 5, 3, 5], [8, 9, 7]]


def _op_args(sinks: bool):
    segs = [Segment(5, [1, 2], [3], 6, [7], 0), Segment(5, [1, 2], [4, 5], 9, [7], 0), Segment(2, [6], [7], 3, [1], 1)]
    _, _, meta = build_metadata(segs, 4, DEVICE)
    meta = tb.prepare_cascade(meta, ((None, None),))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(32, 2, 8, generator=g).to(DEVICE)
    v = torch.randn(32, 2, 8, generator=g).to(DEVICE)
    q = torch.randn(4, 3, 8, generator=g).to(DEVICE).transpose(0, 1)  # [T, H, D] strided, like the model's
    layer = LayerAttention(scale=8**-0.5, softcap=2.0 if sinks else None, sinks=torch.randn(4).to(DEVICE)
                           if sinks else None, sliding_window=5 if sinks else None)
    order, run_len = meta.cascade
    args = (q, k, v, order, run_len, meta.q_start, meta.q_pos, meta.prompt_lens, meta.prefix_table,
            meta.suffix_table, layer.sinks, meta.block_size, float(layer.scale), layer.softcap,
            int(layer.sliding_window or 0), 0, 0, 0, 0, 0)
    return args, meta, layer


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks+softcap+window"])
def test_custom_op_checks_and_matches_reference(sinks):
    args, meta, layer = _op_args(sinks)
    torch.library.opcheck(torch.ops.trl_infinite.triton_cascade_decode.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    out = torch.ops.trl_infinite.triton_cascade_decode(*args)
    ref = torch_paged_attention(*args[:3], with_context(meta, ((layer.sliding_window, None),)), layer)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out - ref).abs().max().item() < 1e-5
    # traced (fullgraph): the backend's call is one node of the op, and the compiled call gives the same output
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: tb.triton_paged_attention(q, k, v, meta, layer), fullgraph=True,
                             backend=record)
    torch.testing.assert_close(compiled(*args[:3]), out, rtol=0, atol=0)
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert calls == ["trl_infinite.triton_cascade_decode.default"]


def _engine(model, backend: str) -> RolloutEngine:
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=2, kv_cache_tokens=256, block_size=4,
                       attention_backend="triton", compile=True, compile_backend=backend)
    return RolloutEngine(model, cfg)


@requires_compile
def test_compiled_triton_step_is_one_graph_and_token_identical(monkeypatch):
    model = tiny_model("qwen3")
    tokens = 6
    refs = [reference_greedy(model, p, tokens, []) for p in PROMPTS]
    launches, launch = [], tb.launch_cascade

    def counted(*args):
        launches.append(args[0].shape[0])  # rows
        return launch(*args)

    monkeypatch.setattr(triton_op, "_launch", counted)  # the op's body (`triton_op.set_body`), looked up per call
    torch._dynamo.reset()
    counters.clear()
    engine = _engine(model, "aot_eager")
    result = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=tokens, temperature=0.0))
    assert result.completion_ids == refs
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] >= 1
    # the kernels ran inside the compiled step, once per layer of every decode step (2 layers, 2 rows padded to
    # their bucket: a multiple of `runner.row_multiple` on CPU; the calls before them are the support check's)
    steps, rows = result.stats.decode_steps, bucket_sizes(2, engine.runner.row_multiple)[-1]
    assert steps == tokens - 1 and launches[-2 * steps:] == [rows] * (2 * steps)


class _Toy(torch.nn.Module):
    def breaks(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x + 1

    def doubles(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _failing_backend(error: Exception):
    def backend(gm, example_inputs):
        raise error

    return backend


def test_step_compile_failure_is_raised_clearly_and_is_not_a_capture_error():
    torch._dynamo.reset()
    with pytest.raises(StepCompileError, match="compile=False") as info:
        CompiledStep(_Toy().breaks, "eager", None, fast=False)(("rows", 1), torch.ones(2))
    assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported) and info.value.origin is None
    assert not is_capture_error(info.value)  # a graph break: raised, graphs not given up on
    # what the backend raised decides: a capture refused inside it is a capture error, anything else is not
    for error, capture in ((CaptureError("host_sync", "read during capture"), True), (ValueError("no"), False)):
        torch._dynamo.reset()
        with pytest.raises(StepCompileError) as info:
            CompiledStep(_Toy().doubles, _failing_backend(error), None, fast=False)(("rows", 1), torch.ones(2))
        assert info.value.origin is error and is_capture_error(info.value) == capture


def test_op_body_follows_the_autocast_state_the_caller_traced(monkeypatch):
    """Inside a compiled graph the op's body does not see an autocast region entered in the traced forward: it
    follows the state passed by the caller (`triton_op.autocast_code`), whatever the state around it."""
    monkeypatch.setattr(tb, "_interpreting", lambda: False)  # (the interpreter ignores autocast)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        traced = triton_op.autocast_code("cpu")
        assert traced == 1 and tb._dot_mode(torch.float32, "cpu", traced) == (1, "tf32")
        assert tb._dot_mode(torch.float32, "cpu", 0) == (0, "ieee")
    assert triton_op.autocast_code("cpu") == 0 and tb._dot_mode(torch.float32, "cpu", 0) == (0, "ieee")
    assert tb._dot_mode(torch.float32, "cpu", 1) == (1, "tf32") and tb._dot_mode(torch.float32, "cpu", 2) == (2, "tf32")
    assert not torch.is_autocast_enabled("cpu")  # nothing left entered
