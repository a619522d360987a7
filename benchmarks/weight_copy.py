"""Decode step time of `RolloutEngine` on float32 weights under 16-bit autocast, with and without the 16-bit weight
copy (`EngineConfig.weight_copy`, `engine/runner/weight_copy.py`).

Per mode ('off': every Linear casts its float32 weight at every forward; 'auto': the rollout runs on the copy) an engine
is built under `torch.autocast(device, --autocast)` on a random-weight float32 model, then a warm-up call and the
measured calls: `--active` samples of one `--prompt-len`-token prompt, each forced to exactly `--new-tokens` tokens
(`fixed_slot`, all samples decoding together). The modes alternate call by call (`--repeats` of each), so drift on a
shared machine hits both. Columns:

| column | meaning |
|---|---|
| `steps` | decode-only steps measured (all repeats) |
| `step_ms` | median wall time of a decode step (`generate(on_decode_step=...)`) |
| `cpu_s` | process CPU time of the measured calls, summed (on CPU the work itself, whatever the contention) |
| `cpu_vs_off`, `step_vs_off` | the same over the 'off' row |
| `copy_MB` | `RolloutStats.weight_copy_bytes` |
| `same_tokens` | the mode's completions equal the 'off' mode's |

    python benchmarks/weight_copy.py --model smollm2-135m --layers 4 --active 8 --new-tokens 32 --threads 1
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch
from common import Table, load_model, pick_device, run_header, write_results

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams

COLUMNS = ["model", "autocast", "mode", "active", "steps", "step_ms", "cpu_s", "step_vs_off", "cpu_vs_off", "copy_MB",
           "same_tokens"]
MODES = ("off", "auto")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model_zoo name (random float32 weights)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--device", default=None)
    p.add_argument("--autocast", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--active", type=int, default=8, help="samples decoding together")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="measured calls per mode (alternating)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _engine(model, mode: str, active: int) -> RolloutEngine:
    return RolloutEngine(model, EngineConfig(weight_copy=mode, sampling_mode="fixed_slot", max_active_sequences=active,
                                             prefix_cache=False, kv_cache_tokens=active * 1024))


def _call(engine: RolloutEngine, prompt: list[int], args) -> tuple[list[float], float, object]:
    steps: list[float] = []

    def timed(batch, seconds: float) -> None:
        if not (batch.prefill_groups or batch.recompute) and len(batch.decode) == args.active:
            steps.append(seconds)

    cpu = time.process_time()
    result = engine.generate([prompt], args.active, SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0),
                             forced_lengths=[[args.new_tokens] * args.active], on_decode_step=timed)
    return steps, time.process_time() - cpu, result


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    if args.threads and device.type == "cpu":
        torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, torch.float32, device)
    if args.layers is not None:
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
    dtype = getattr(torch, args.autocast)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    table = Table(COLUMNS)
    with torch.autocast(device.type, dtype=dtype):
        engines = {mode: _engine(model, mode, args.active) for mode in MODES}
        assert engines["auto"].weight_copy is not None, "no weight copy: float32 weights under 16-bit autocast needed"
        for engine in engines.values():
            _call(engine, prompt, args)  # warm-up
        steps = {m: [] for m in MODES}
        cpu = dict.fromkeys(MODES, 0.0)
        tokens, copy_bytes = {}, {}
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                s, c, result = _call(engine, prompt, args)
                steps[mode] += s
                cpu[mode] += c
                tokens[mode], copy_bytes[mode] = result.completion_ids, result.stats.weight_copy_bytes
    step_ms = {m: 1e3 * statistics.median(steps[m]) for m in MODES}
    for mode in MODES:
        table.add(model=args.model + (f"-{args.layers}l" if args.layers else ""), autocast=args.autocast, mode=mode,
                  active=args.active, steps=len(steps[mode]), step_ms=round(step_ms[mode], 3),
                  cpu_s=round(cpu[mode], 3), step_vs_off=round(step_ms[mode] / step_ms["off"], 3),
                  cpu_vs_off=round(cpu[mode] / cpu["off"], 3), copy_MB=round(copy_bytes[mode] / 1e6, 2),
                  same_tokens=tokens[mode] == tokens["off"])
    header = run_header(device, "python " + shlex.join(sys.argv))
    write_results(args.json, header, table, {"args": vars(args)})


if __name__ == "__main__":
    main()
