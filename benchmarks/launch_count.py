"""Kernels per decode step, per layer, eager vs compiled: a device-independent proxy for the launch-bound cost of an
uncompiled captured step.

A decode step on a GPU launches one kernel per operator that is not a view or a bare allocation; replayed as a CUDA
graph, each still costs ~2 us of GPU-side launch latency, so a step of ~1,600 kernels has a floor of a few ms whatever
the batch. This script counts them on the CPU, on random weights at a model's real shape, with fewer layers:

- `eager`: every operator dispatched inside `StaticDecoder.launch` (the whole step: upload, forward, sampling,
  read-back), minus views and allocations (a `TorchDispatchMode`), plus every Triton launch (the CPU interpreter
  with `--backend triton`, the GPU's default path: its cascade kernels, 2 or 3 per layer);
- `compiled`: `torch.compile` (inductor's CPU code): the generated C++ kernels and the operators it calls outside
  them, from `torch.profiler` inside the same step (`torch._inductor.config.cpp.enable_kernel_profile`). Inductor
  fuses for the CPU here, not for CUDA: a proxy of its GPU fusion, not its kernel list.

Per layer = (count at L2 layers - count at L1) / (L2 - L1); the rest of the step function (embedding, final norm,
LM head, sampler, metadata) = its count at L1 - L1 x per layer; `outside` = the step's kernels outside the step
function (`StaticDecoder._step`, compiled: `CompiledStep.__call__`; what a CUDA graph captures): launched one by one from the host on every step even
with graphs on (uploads of joining rows, table copies, read-back); `at N layers` = rest + outside + N x per layer
(N: the config's depth). Counts are means over the call's decode steps (the first step uploads every row).

    python benchmarks/launch_count.py --config qwen3-1.7b --layers 1 2 --rows 32 --modes eager compiled \
        --backend torch triton
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

if "--backend" in sys.argv and "triton" in sys.argv[sys.argv.index("--backend"):]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
from common import Table, pick_device, run_header, write_results  # noqa: E402

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from trl_infinite.engine.decode.compiled import CompiledStep  # noqa: E402
from trl_infinite.engine.decode.static import StaticDecoder  # noqa: E402
from trl_infinite.testing.model_zoo import model_config  # noqa: E402

aten = torch.ops.aten
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
             aten.new_empty_strided.default, aten.lift_fresh.default, aten.detach.default, aten.detach_.default,
             aten._local_scalar_dense.default}
NO_KERNEL_NAMES = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::as_strided",
                   "aten::_reshape_alias", "aten::resize_", "aten::detach", "aten::detach_", "aten::lift_fresh",
                   "aten::alias", "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::transpose",
                   "aten::expand", "aten::slice", "aten::select", "aten::t", "aten::_unsafe_view", "aten::set_",
                   "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::result_type",
                   "aten::resolve_conj", "aten::resolve_neg")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-1.7b", help="model_zoo name (random weights)")
    p.add_argument("--layers", type=int, nargs=2, default=[1, 2], help="two depths: per layer = their difference")
    p.add_argument("--rows", type=int, default=32, help="samples of one prompt decoding at once")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--backend", nargs="+", default=["torch"], choices=["torch", "triton"],
                   help="attention backend (triton: the CPU interpreter; eager only)")
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


class _Count(TorchDispatchMode):
    """Operators that launch a kernel on a GPU: not views (an output sharing its input's storage), not allocations.
    Those inside the step function go to `ops`, the others to `outside`."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.outside: Counter = Counter()
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in NO_KERNEL:
            return out
        if func.is_view:
            ins = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
            outs = out if isinstance(out, (tuple, list)) else [out]
            if all(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in ins for t in outs):
                return out
        (self.ops if self.inside else self.outside)[str(func.overloadpacket)] += 1
        return out


def _count_triton(counter: _Count):
    """Count Triton launches (CPU interpreter) as one kernel each; their host copies are not the step's."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return None
    original = InterpretedFunction.run

    def run(fn, *args, **kwargs):
        (counter.ops if counter.inside else counter.outside)[f"triton:{fn.fn.__name__}"] += 1
        with _disable_current_modes():
            return original(fn, *args, **kwargs)

    InterpretedFunction.run = run
    return lambda: setattr(InterpretedFunction, "run", original)


def _model(name: str, layers: int, device):
    config = model_config(name)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), config


def count_step(args, layers: int, mode: str, backend: str, device) -> tuple[float, float, Counter]:
    """Mean kernels per decode step inside and outside the step function, and the per-operator counts inside."""
    if mode == "compiled":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # before compiling: each C++ kernel a profiler range
    model, config = _model(args.config, layers, device)
    n, new = args.rows, args.new_tokens
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=n, kv_cache_tokens=n * (args.prompt_len + new)
                       + 64 + args.prompt_len, attention_backend=backend, cuda_graphs=False,
                       compile=mode == "compiled", cpu_decode_kernel=backend == "torch")
    engine = RolloutEngine(model, cfg)
    prompt = torch.randint(2, config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0, eos_token_ids=[1])

    def run():
        return engine.generate([prompt.tolist()], n, sampling, forced_lengths=[[new] * n]).stats

    run()  # warm-up (and compilation)
    # the step function as `StaticDecoder.launch` calls it: `_step` eager, the compiled dispatch compiled
    owner, name = (StaticDecoder, "_step") if mode == "eager" else (CompiledStep, "__call__")
    original, original_run = StaticDecoder.launch, getattr(owner, name)
    steps = [0]
    if mode == "eager":
        counter = _Count()
        restore = _count_triton(counter)

        def launch(self, batch):
            steps[0] += 1
            with counter:
                finish = original(self, batch)
                return _finish_counted(finish, counter)

        def step_fn(self, *a, **k):
            counter.inside = True
            try:
                return original_run(self, *a, **k)
            finally:
                counter.inside = False

        StaticDecoder.launch = launch
        setattr(owner, name, step_fn)
        try:
            run()
        finally:
            StaticDecoder.launch = original
            setattr(owner, name, original_run)
            if restore:
                restore()
        return sum(counter.ops.values()) / steps[0], sum(counter.outside.values()) / steps[0], counter.ops
    from torch.profiler import ProfilerActivity, profile, record_function

    def launch(self, batch):
        steps[0] += 1
        with record_function("decode_step"):
            finish = original(self, batch)
            return finish

    def step_fn(self, *a, **k):
        with record_function("step_fn"):
            return original_run(self, *a, **k)

    StaticDecoder.launch = launch
    setattr(owner, name, step_fn)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    finally:
        StaticDecoder.launch = original
        setattr(owner, name, original_run)
    ops: Counter = Counter()
    outside: Counter = Counter()
    for event in prof.events():
        if event.name == "decode_step":
            _walk(event, outside, ops)
    return sum(ops.values()) / steps[0], sum(outside.values()) / steps[0], ops


def _finish_counted(finish, counter):
    def done():
        with counter:
            return finish()
    return done


def _walk(event, ops: Counter, inner_ops: Counter | None = None) -> int:
    """Kernels under a profiler range: inductor's C++ kernels (`cpp_fused_*`), the library calls its code makes
    (`aoti_torch_*`: GEMMs, cumsum, ...), and operators that call no other kernel (the leaves); views and
    allocations count none. Those under a `step_fn` range go to `inner_ops` (when given)."""
    found = 0
    for child in event.cpu_children:
        name = child.name
        if name == "step_fn" and inner_ops is not None:
            found += _walk(child, inner_ops)
        elif "cpp_fused" in name:
            ops["inductor:cpp_fused"] += 1
            found += 1
        elif name.startswith("aoti_torch_"):
            ops[name] += 1
            found += 1
        elif name in NO_KERNEL_NAMES:
            continue
        else:
            inner = _walk(child, ops)
            if not inner and name.startswith(("aten::", "trl_infinite::")):
                ops[name] += 1
                inner = 1
            found += inner
    return found


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    device = pick_device(args.device)
    depth = model_config(args.config).num_hidden_layers
    l1, l2 = args.layers
    table = Table(["mode", "backend", "per_layer", "rest_of_step_fn", "outside_step_fn", f"step_at_{depth}_layers",
                   "top_ops_per_layer"])
    rows = []
    for mode in args.modes:
        for backend in args.backend:
            if mode == "compiled" and backend == "triton":
                continue  # inductor's CPU code cannot call Triton kernels
            c1, out1, ops1 = count_step(args, l1, mode, backend, device)
            c2, out2, ops2 = count_step(args, l2, mode, backend, device)
            per_layer = (c2 - c1) / (l2 - l1)
            rest = c1 - l1 * per_layer
            outside = (out1 + out2) / 2
            diff = Counter({k: (ops2[k] - ops1[k]) for k in ops2})
            steps = args.new_tokens - 1
            top = ", ".join(f"{k.split('.')[-1]} {v / steps / (l2 - l1):.0f}" for k, v in diff.most_common(8) if v > 0)
            row = dict(mode=mode, backend=backend, per_layer=per_layer, rest_of_step_fn=rest, outside_step_fn=outside,
                       **{f"step_at_{depth}_layers": rest + outside + depth * per_layer}, top_ops_per_layer=top)
            table.add(**row)
            rows.append(row)
    header = run_header(device, "python benchmarks/launch_count.py " + " ".join(argv or sys.argv[1:]))
    extra = {"config": args.config, "layers": args.layers, "rows": args.rows, "prompt_len": args.prompt_len,
             "new_tokens": args.new_tokens, "depth": depth}
    header.update(extra)
    write_results(args.json, header, table, extra)


if __name__ == "__main__":
    main()
