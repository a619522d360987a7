"""Host cost of one decode step: `RolloutEngine` (eager and compiled) against `transformers` `generate`.

A 28-layer Qwen3 of hidden size 64 (`qwen3-28l-h64`: Qwen3-1.7B's depth, none of its width) makes a step's time
almost all host work (Python, dispatch, per-layer bookkeeping): the cost a GPU step pays when nothing is captured.
Every path decodes the same work: N sequences = one prompt of `--prompt-len` random tokens x G = N samples (TRL's
layout: `generate` gets the prompt repeated N times), exactly `--new-tokens` tokens each (EOS never sampled:
`min_new_tokens` for `generate`, forced lengths for the engine), temperature 1, no top-k / top-p.

ms per decode step = (t(T new tokens) - t(1 new token)) / (T - 1): prompt processing cancels out. Each figure is the
minimum over `--repeats` interleaved runs. `t` is this process's CPU time by default (`--clock process`: equal to
wall time on an idle machine with one torch thread, and unaffected by other processes sharing the cores); `--clock
wall` (always on CUDA) times wall seconds. The engine's `host` column is its host work per decode step
outside the forward (scheduling, postprocess, the decode batch's upload, the token read-back), from `RolloutStats`.
The compiled engine is warmed up (compiled) before timing: compilation time is not in the figures.

    python benchmarks/host_overhead.py --sizes 8 32 128 --json /tmp/host_overhead.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import Table, pick_device, run_header, write_results

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.testing.model_zoo import random_model

CLOCK = time.process_time


def generate_seconds(model, prompt: list[int], n: int, new_tokens: int) -> float:
    ids = torch.tensor([prompt] * n, device=model.device)
    start = CLOCK()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=1)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return CLOCK() - start


def engine_run(engine: RolloutEngine, prompt: list[int], n: int, new_tokens: int):
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=[1])
    start = CLOCK()
    result = engine.generate([prompt], n, sampling, forced_lengths=[[new_tokens] * n])
    return CLOCK() - start, result.stats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3-28l-h64")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 128], help="sequences decoding at once")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled engine (compilation takes minutes)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: host cost, not parallelism)")
    ap.add_argument("--clock", choices=["process", "wall"], default="process")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" or device.type == "cuda" else time.process_time
    model = random_model(args.config, dtype=torch.float32, device=device)
    prompt = torch.randint(2, model.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    header = run_header(device, "python benchmarks/host_overhead.py " + " ".join(argv or sys.argv[1:]))
    table = Table(["seqs", "generate_ms", "engine_ms", "x_generate", "host_ms", "compiled_ms", "x_generate_compiled",
                   "compiled_host_ms"])
    steps = args.new_tokens - 1
    for n in args.sizes:
        tokens = n * (args.prompt_len + args.new_tokens) + 64
        engines = {"engine": RolloutEngine(model, EngineConfig(max_active_sequences=n, kv_cache_tokens=tokens))}
        if not args.no_compile:
            engines["compiled"] = RolloutEngine(model, EngineConfig(max_active_sequences=n, kv_cache_tokens=tokens,
                                                                    compile=True))
        for engine in engines.values():  # warm-up (and compilation) outside the timed runs
            engine_run(engine, prompt, n, args.new_tokens)
        best: dict[str, float] = {}
        host: dict[str, float] = {}
        for _ in range(args.repeats):
            full = generate_seconds(model, prompt, n, args.new_tokens)
            best["generate"] = min(best.get("generate", 1e9), (full - generate_seconds(model, prompt, n, 1)) / steps)
            for name, engine in engines.items():
                full, stats = engine_run(engine, prompt, n, args.new_tokens)
                one, _ = engine_run(engine, prompt, n, 1)
                if (full - one) / steps < best.get(name, 1e9):
                    best[name] = (full - one) / steps
                    host[name] = stats.host_ms_per_step
        row = {"seqs": n, "generate_ms": 1e3 * best["generate"], "engine_ms": 1e3 * best["engine"],
               "x_generate": best["engine"] / best["generate"], "host_ms": host["engine"]}
        if "compiled" in best:
            row.update(compiled_ms=1e3 * best["compiled"], x_generate_compiled=best["compiled"] / best["generate"],
                       compiled_host_ms=host["compiled"])
        table.add(**row)
    extra = {"config": args.config, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
             "repeats": args.repeats, "threads": args.threads, "clock": CLOCK.__name__}
    header.update(extra)
    write_results(args.json, header, table, extra)


if __name__ == "__main__":
    main()
