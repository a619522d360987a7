"""Rollout throughput and peak memory: TRL's generate path, TRL + transformers continuous batching, and
`RolloutEngine` in each sampling mode and scheduler, on the same prompts and the same forced completion lengths.

Prints a markdown table (one row per run, as it finishes) and writes JSON. Every path first runs a small warm-up
call (kernel compilation, CUDA context; for the engine, every CUDA-graph bucket), then the measured call. See
benchmarks/README.md for the commands.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys

import torch
from common import (
    GB,
    Table,
    Workload,
    check_lengths,
    default_hbm_gbps,
    dtype_for,
    load_model,
    make_workload,
    measure,
    pick_device,
    run_header,
    save_json,
    trace_lengths,
    weight_bytes,
    write_results,
)
from engine_path import StepTimes, bucket_warmup, make_engine, roofline, run_engine, shares_prefix
from trl_paths import grpo_generation_config, trl_continuous_batching, trl_generate

from trl_infinite.engine.config.engine_config import SAMPLING_MODES
from trl_infinite.engine.config.registry import SCHEDULERS

COLUMNS = ["model", "prompts", "G", "path", "mode", "scheduler", "graphs", "tokens", "seconds", "tok/s", "x_generate",
           "x_cb", "peak_GB", "pool_GB", "kv_peak_GB", "peak_used_GB", "decode_steps", "step_ms", "host_ms", "mean_batch",
           "x_roofline"]
TRL_PATHS = {"trl_generate": trl_generate, "trl_cb": trl_continuous_batching}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model_zoo name (random weights) or 'smollm2-real'")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--num-prompts", type=int, nargs="+", default=[1, 8])
    p.add_argument("--group-sizes", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--trace", default=None, help="JSONL length trace; lognormal lengths when absent")
    p.add_argument("--mean", type=float, default=256.0, help="lognormal mean completion length (tokens)")
    p.add_argument("--sigma", type=float, default=0.6, help="lognormal log-space spread")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of random-weight models")
    p.add_argument("--paths", nargs="+", default=["trl_generate", "trl_cb", "engine"],
                   choices=["trl_generate", "trl_cb", "engine"])
    p.add_argument("--modes", nargs="+", default=list(SAMPLING_MODES), choices=list(SAMPLING_MODES))
    p.add_argument("--schedulers", nargs="+", default=None, help=f"default: all registered {sorted(SCHEDULERS)}")
    p.add_argument("--slots", type=int, default=32, help="max_active_sequences (g) of micro_group / fixed_slot")
    p.add_argument("--cb-memory-percent", type=float, default=None,
                   help="max_memory_percent of transformers continuous batching; default TRL's 0.5 (of all free "
                        "memory: lower it on a shared CPU machine)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="engine KV pool; default: EngineConfig's")
    p.add_argument("--backend", default="auto", help="engine attention backend: auto / torch / triton")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--eager-modes", nargs="*", default=[], choices=list(SAMPLING_MODES),
                   help="modes that also get a row with EngineConfig.cuda_graphs=False (every mode gets one with "
                        "graphs on; no difference off CUDA)")
    p.add_argument("--hbm-gbps", type=float, default=None, help="default: 3350 on H100, 4800 on H200, none else")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _warmup_workload(workload: Workload) -> Workload:
    """One prompt, two short samples: compiles kernels and warms caches before the measured call."""
    return Workload([workload.prompt_ids[0]], [[4, 3]], "warmup", workload.eos_id, workload.pad_id)


def bench_trl(name, model, workload, args, device, table, base):
    gen_config, grpo_args = grpo_generation_config(
        workload, args.max_new_tokens, bf16=device.type == "cuda", cb_memory_percent=args.cb_memory_percent
    )
    fn = TRL_PATHS[name]
    fn(model, _warmup_workload(workload), gen_config, grpo_args)
    _free(device)
    m = measure(lambda: fn(model, workload, gen_config, grpo_args), device)
    check_lengths(m.value, workload, name)
    steps = max(n for g in workload.lengths for n in g) if name == "trl_generate" else None
    tps = workload.num_tokens / m.seconds
    table.add(**base, path=name, tokens=workload.num_tokens, seconds=m.seconds, **{"tok/s": tps},
              peak_GB=m.peak_bytes / GB if m.peak_bytes else None, decode_steps=steps)


def bench_engine(model, workload, args, device, table, base, mode, scheduler, graphs, wbytes, hbm):
    engine = make_engine(model, mode, scheduler, args.slots, args.kv_cache_gb, args.backend, args.block_size,
                         cuda_graphs=graphs == "on")
    run_engine(engine, bucket_warmup(workload), args.max_new_tokens)
    times = StepTimes(shared_prefix=shares_prefix(engine))
    _free(device)
    m = measure(lambda: run_engine(engine, workload, args.max_new_tokens, args.seed, on_decode_step=times), device)
    result = m.value
    check_lengths(result.completion_ids, workload, f"engine/{mode}/{scheduler}")
    st = result.stats
    pool = engine.pool.num_blocks * engine.pool.block_bytes
    kv_per_token = engine.pool.block_bytes // engine.pool.block_size
    # the CUDA graphs' private pool: replays use it without allocating, so max_memory_allocated misses its free part
    peak = m.peak_bytes + engine.decoder.graph_memory().unaccounted if m.peak_bytes else None
    # peak_used: the CUDA peak with the pool's never-used blocks taken out (what a pool of exactly the used size gives)
    used = (peak - pool + st.peak_kv_bytes) / GB if peak else None
    table.add(**base, path="engine", mode=mode, scheduler=scheduler, graphs=graphs if device.type == "cuda" else "-",
              tokens=st.generated_tokens, seconds=m.seconds,
              **{"tok/s": st.generated_tokens / m.seconds}, peak_GB=peak / GB if peak else None,
              pool_GB=pool / GB, kv_peak_GB=st.peak_kv_bytes / GB, peak_used_GB=used, decode_steps=st.decode_steps,
              host_ms=st.host_ms_per_step, **_rename(roofline(times, wbytes, kv_per_token, hbm)))


def _rename(r: dict) -> dict:
    return {"step_ms": r.get("decode_step_ms"), "mean_batch": r.get("mean_batch"), "x_roofline": r.get("x_roofline")}


def add_speedups(table: Table) -> None:
    """`x_generate` / `x_cb`: tok/s over trl_generate's / trl_cb's on the same prompts and G."""
    for column, path in (("x_generate", "trl_generate"), ("x_cb", "trl_cb")):
        base = {(r["prompts"], r["G"]): r["tok/s"] for r in table.rows if r["path"] == path}
        for r in table.rows:
            ref = base.get((r["prompts"], r["G"]))
            r[column] = r["tok/s"] / ref if ref else None


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    dtype = dtype_for(args.dtype, device)
    model, tokenizer = load_model(args.model, dtype, device)
    wbytes = weight_bytes(model)
    hbm = args.hbm_gbps or default_hbm_gbps(device)
    schedulers = args.schedulers or sorted(SCHEDULERS)
    header = run_header(device, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    table = Table(COLUMNS)
    sources = {}
    for num_prompts in args.num_prompts:
        for g in args.group_sizes:
            records, sources[f"{num_prompts}x{g}"] = trace_lengths(
                num_prompts, g, args.max_new_tokens, args.trace, args.mean, args.sigma, args.prompt_len, args.seed
            )
            workload = make_workload(model, tokenizer, records, sources[f"{num_prompts}x{g}"], args.seed)
            base = {"model": args.model, "prompts": num_prompts, "G": g}
            for name in args.paths:
                if name in TRL_PATHS:
                    bench_trl(name, model, workload, args, device, table, base)
                    save_json(args.json, header, table, {"partial": True})
                    continue
                for mode in args.modes:
                    for scheduler in schedulers:
                        for graphs in ["on", "off"] if mode in args.eager_modes else ["on"]:
                            bench_engine(model, workload, args, device, table, base, mode, scheduler, graphs, wbytes,
                                         hbm)
                            _free(device)  # the engine and its pool are gone
                            save_json(args.json, header, table, {"partial": True})
    add_speedups(table)
    extra = {"dtype": str(dtype), "weight_GB": wbytes / GB, "hbm_gbps": hbm, "lengths": sources,
             "slots": args.slots, "backend": args.backend}
    header.update({k: extra[k] for k in ("dtype", "weight_GB", "hbm_gbps", "slots", "backend")})
    write_results(args.json, header, table, extra)


if __name__ == "__main__":
    main()
