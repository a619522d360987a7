"""Decode step time of `RolloutEngine` at a fixed number of active sequences, against the memory roofline.

Each case keeps N samples decoding together from the first decode step to the last (`fixed_slot` with N slots, every
sample forced to exactly `--new-tokens` tokens), prompts of P random tokens:
- `cascade`: one prompt, G = N samples: its KV blocks are shared, and the Triton backend reads them once per step;
- `no_share`: N distinct prompts of P tokens, one sample each: the same contexts, nothing shared.

Per case a warm-up call (4 tokens per sample: compiles the kernels and captures the CUDA graph of the bucket), then
the measured call. Step times come from `RolloutEngine.generate(on_decode_step=...)` (see `engine_path.py`): only
decode-only steps with exactly N rows are used. Columns:

| column | meaning |
|---|---|
| `steps` | decode steps used |
| `step_ms` | mean wall time of those steps (host upload + forward + sampling + the tokens' read-back) |
| `fwd_ms` | `RolloutStats.decode_forward_s` per decode step: the forward (graph replay) up to the read-back |
| `host_ms` | `RolloutStats.host_ms_per_step`: scheduling, postprocess, upload and read-back bookkeeping per step |
| `kv_GB` | KV bytes one step reads, mean over the steps (cascade: the prompt once; no_share: every row's prompt) |
| `roofline_ms` | (weight bytes + KV bytes) / datasheet HBM bandwidth (`--hbm-gbps`, default 3350 H100 / 4800 H200) |
| `x_roofline` | step_ms / roofline_ms (1.0 = bandwidth bound; the issue's target is <= 2 at 32 active) |
| `x_copy` | the same against the device-to-device copy bandwidth measured at the start (the achievable ceiling) |
| `tok/s` | N / step time |

    python benchmarks/decode_step.py --model qwen3-1.7b --active 32 128 --prompt-len 128 1024 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys

import torch
from common import (
    Table,
    Workload,
    copy_bandwidth_gbps,
    default_hbm_gbps,
    dtype_for,
    load_model,
    pick_device,
    run_header,
    save_json,
    weight_bytes,
    write_results,
)
from engine_path import StepTimes, make_engine, roofline, run_engine, shares_prefix

COLUMNS = ["model", "active", "prompt_len", "sharing", "graphs", "steps", "step_ms", "fwd_ms", "host_ms", "kv_GB",
           "roofline_ms", "x_roofline", "x_copy", "tok/s"]
SHARING = ("cascade", "no_share")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", help="model_zoo name (random weights)")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--active", type=int, nargs="+", default=[32, 128], help="samples decoding at once (N)")
    p.add_argument("--prompt-len", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--new-tokens", type=int, default=256, help="tokens per sample (decode steps = this - 1)")
    p.add_argument("--sharing", nargs="+", default=list(SHARING), choices=SHARING)
    p.add_argument("--eager-active", type=int, nargs="*", default=[32, 128],
                   help="sizes that also get a row with CUDA graphs off (cascade, first prompt length)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="engine KV pool; default: EngineConfig's")
    p.add_argument("--backend", default="auto", help="auto = Triton cascade on CUDA, torch reference elsewhere")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hbm-gbps", type=float, default=None, help="default: 3350 on H100, 4800 on H200, none else")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name in ("active", "prompt_len"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} values must be >= 1")
    if args.new_tokens < 3:
        p.error("--new-tokens must be >= 3 (at least two decode steps)")
    return args


def case_workload(n: int, prompt_len: int, new_tokens: int, sharing: str, vocab: int, seed: int) -> Workload:
    g = torch.Generator().manual_seed(seed)
    num_prompts, group = (1, n) if sharing == "cascade" else (n, 1)
    prompts = [torch.randint(2, vocab, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
    return Workload(prompts, [[new_tokens] * group for _ in prompts], f"{new_tokens} tokens each", eos_id=1, pad_id=0)


def cases(args) -> list[tuple[int, int, str, bool]]:
    """(active, prompt_len, sharing, cuda_graphs) of every row, in order."""
    out = [(n, p, s, True) for n in args.active for p in args.prompt_len for s in args.sharing]
    return out + [(n, args.prompt_len[0], "cascade", False) for n in args.eager_active]


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    dtype = dtype_for(args.dtype, device)
    model, _ = load_model(args.model, dtype, device)
    vocab = model.config.get_text_config().vocab_size
    wbytes = weight_bytes(model)
    hbm = args.hbm_gbps or default_hbm_gbps(device)
    copy = copy_bandwidth_gbps(device)
    header = run_header(device, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    header.update({"dtype": str(dtype), "weight_GB": wbytes / 1e9, "hbm_gbps": hbm, "copy_gbps": copy,
                   "new_tokens": args.new_tokens, "backend": args.backend})
    table = Table(COLUMNS)
    for n, plen, sharing, graphs in cases(args):
        work = case_workload(n, plen, args.new_tokens, sharing, vocab, args.seed)
        engine = make_engine(model, "fixed_slot", "fifo", n, args.kv_cache_gb, args.backend, args.block_size,
                             cuda_graphs=graphs)
        warm = Workload(work.prompt_ids, [[4] * len(g) for g in work.lengths], "warmup", work.eos_id, work.pad_id)
        run_engine(engine, warm, args.new_tokens, args.seed)
        times = StepTimes(shared_prefix=shares_prefix(engine))
        stats = run_engine(engine, work, args.new_tokens, args.seed, on_decode_step=times).stats
        kv_per_token = engine.pool.block_bytes // engine.pool.block_size
        r = roofline(times, wbytes, kv_per_token, hbm, copy, rows=n)
        step = r.get("decode_step_ms")
        table.add(model=args.model, active=n, prompt_len=plen, sharing=sharing,
                  graphs=("on" if graphs else "off") if device.type == "cuda" else "-", steps=r.get("steps_used", 0),
                  step_ms=step, fwd_ms=1e3 * stats.decode_forward_s / max(stats.decode_steps, 1),
                  host_ms=stats.host_ms_per_step, kv_GB=r.get("kv_GB"), roofline_ms=r.get("roofline_ms"),
                  x_roofline=r.get("x_roofline"), x_copy=r.get("x_copy"), **{"tok/s": 1e3 * n / step if step else None})
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save_json(args.json, header, table, {"partial": True})
    write_results(args.json, header, table, {"args": vars(args)})


if __name__ == "__main__":
    main()
