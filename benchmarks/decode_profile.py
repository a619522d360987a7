"""Where a decode step's time goes: `torch.profiler` over one `RolloutEngine.generate` call, per operator.

One prompt of `--prompt-len` random tokens x `--seqs` samples, `--new-tokens` tokens each (forced lengths, so every
step has the same rows), temperature 1. The engine is warmed up first (with `--compile`: compiled; inductor's C++
kernels are recorded one by one, `torch._inductor.config.cpp.enable_kernel_profile`). The table lists the operators
with the most self CPU time, as microseconds and calls per decode step (the call's totals divided by its decode
steps: prefill is in the totals, a small share at these sizes). Profiling adds its own overhead to every recorded
call, so the figures are for comparing operators with each other; `host_overhead.py` gives step times.

    python benchmarks/decode_profile.py --layers 4 --seqs 32 --compile
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import Table, pick_device, run_header, write_results
from torch.profiler import ProfilerActivity, profile

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.testing.model_zoo import model_config


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3-28l-h64", help="model_zoo name (random weights)")
    ap.add_argument("--layers", type=int, default=None, help="override the config's number of layers")
    ap.add_argument("--seqs", type=int, default=32, help="samples decoding at once")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--compile", action="store_true", help="EngineConfig(compile=True)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=15, help="operators listed")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    if args.compile:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    config = model_config(args.config)
    if args.layers is not None:
        config.num_hidden_layers = args.layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[: args.layers]
    torch.manual_seed(0)
    with torch.device(device):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    n, new = args.seqs, args.new_tokens
    engine = RolloutEngine(model, EngineConfig(max_active_sequences=n, kv_cache_tokens=n * (args.prompt_len + new) + 64,
                                               compile=args.compile))
    prompt = torch.randint(2, config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0, eos_token_ids=[1])

    def run():
        return engine.generate([prompt.tolist()], n, sampling, forced_lengths=[[new] * n]).stats

    for _ in range(2):  # warm-up (and compilation)
        run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        stats = run()
    steps = stats.decode_steps
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    table = Table(["operator", "us_per_step", "calls_per_step", "share"])
    for e in events[: args.top]:
        table.add(operator=e.key[:70], us_per_step=e.self_cpu_time_total / steps, calls_per_step=e.count / steps,
                  share=e.self_cpu_time_total / total)
    header = run_header(device, "python benchmarks/decode_profile.py " + " ".join(argv or sys.argv[1:]))
    extra = {"config": args.config, "layers": config.num_hidden_layers, "seqs": n, "prompt_len": args.prompt_len,
             "new_tokens": new, "compile": args.compile, "threads": args.threads, "decode_steps": steps,
             "profiled_us_per_step": total / steps}
    header.update(extra)
    write_results(args.json, header, table, extra)


if __name__ == "__main__":
    main()
