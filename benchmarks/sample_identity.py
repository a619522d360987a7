"""A seed's samples with and without speculation, across sampling modes and schedulers: how many differ.

README promises that a seed's samples are token-identical whatever the drafter, the draft-length controller, the
sampling mode and the scheduler decide. This rolls the same prompts out with the same seed under each setting and
counts the samples (of `num_prompts x G`) whose token ids differ from the reference (plain decoding, every sample in
one batch: `fixed_slot` with `G * num_prompts` slots, no speculation), with the first position where each differs.

Default workload (the one of issue #40): SmolLM2-135M-Instruct with its real weights (float32, CPU), 4 chat-formatted
GSM8K test prompts x G=16, temperature 1, 256 new tokens, seed 0. A row per setting:
- `spec`: each drafter (suffix, ngram, draft_model, best_of_n; decoupled with a draft model), adaptive on and off;
  the draft model is a copy of the target (so most drafts are accepted: accepted drafts, bonus tokens and rejections
  all appear) unless `--draft tiny` (a 2-layer random Llama on the same vocabulary: almost every draft rejected);
- `mode`: the sampling modes with smaller batches (micro_group, fixed_slot with 8 slots, dynamic_slot, full_group),
  several schedulers, chunked prefill (`max_prefill_tokens=16`).

    python benchmarks/sample_identity.py                       # every row (CPU, 2 cores: about an hour)
    python benchmarks/sample_identity.py --rows suffix-on suffix-off --json /tmp/identity.json
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import Table, load_model, pick_device, run_header, save_json, write_results

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.testing.shared_data import dataset_file


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "spec" or "mode"
    config: dict = field(default_factory=dict)
    draft: bool = False  # needs the draft model


def rows(total: int) -> list[Row]:
    full = {"sampling_mode": "fixed_slot", "max_active_sequences": total}
    out = []
    for method in ("suffix", "ngram", "draft_model", "best_of_n"):
        for adaptive in (True, False):
            out.append(Row(f"{method}-{'on' if adaptive else 'off'}", "spec",
                           {**full, "speculative_method": method, "speculative_adaptive": adaptive},
                           draft=method in ("draft_model", "best_of_n")))
    out.append(Row("decoupled", "spec", {**full, "speculative_method": "draft_model", "speculative_decoupled": True},
                   draft=True))
    out += [
        Row("micro_group-16", "mode", {"sampling_mode": "micro_group", "max_active_sequences": 16}),
        Row("fixed_slot-8", "mode", {"sampling_mode": "fixed_slot", "max_active_sequences": 8}),
        Row("fixed_slot-8-fifo", "mode", {"sampling_mode": "fixed_slot", "max_active_sequences": 8,
                                          "scheduler": "fifo"}),
        Row("fixed_slot-8-sjf", "mode", {"sampling_mode": "fixed_slot", "max_active_sequences": 8,
                                         "scheduler": "sjf"}),
        Row("dynamic_slot", "mode", {"sampling_mode": "dynamic_slot"}),
        Row("full_group", "mode", {"sampling_mode": "full_group"}),
        Row("chunked_prefill-16", "mode", {**full, "max_prefill_tokens": 16}),
        Row("suffix-on-fixed_slot-8", "spec", {"sampling_mode": "fixed_slot", "max_active_sequences": 8,
                                               "speculative_method": "suffix"}),
    ]
    return out


def load_prompts(tokenizer, path: Path, n: int) -> list[list[int]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for r in lines]


def tiny_drafter(model) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    torch.manual_seed(0)
    small = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=cfg.max_position_embeddings,
                        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, tie_word_embeddings=True)
    return LlamaForCausalLM(small).eval()


def rollout(model, prompts, args, config: dict, eos: list[int]):
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=args.kv_cache_tokens, speculative_num_tokens=args.k,
                                               **config))
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, eos_token_ids=eos,
                              seed=args.seed)
    t0 = time.perf_counter()
    result = engine.generate(prompts, args.group_size, sampling)
    return result, time.perf_counter() - t0


def differing(ref: list[list[int]], out: list[list[int]]) -> list[int]:
    """First differing position of each sample that differs (a length difference counts at the shorter end)."""
    firsts = []
    for a, b in zip(ref, out):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return firsts


COLUMNS = ["row", "kind", "differ", "of", "first_diff", "decode_steps", "verify_steps", "drafted", "accepted",
           "tokens", "wall_s"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-real")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=5, help="speculative_num_tokens")
    p.add_argument("--kv-cache-tokens", type=int, default=40_000)
    p.add_argument("--draft", choices=["self", "tiny"], default="self",
                   help="draft model: a copy of the target, or a tiny random Llama on its vocabulary")
    p.add_argument("--rows", nargs="*", default=None, help="row names (default: all)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", type=Path, default=None, help="GSM8K test jsonl; default: shared data")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device("cpu")
    model, tok = load_model(args.model, torch.float32, device)
    prompts = load_prompts(tok, args.data or dataset_file("gsm8k"), args.num_prompts)
    eos = [tok.eos_token_id]
    header = run_header(device, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    header.update({"model": args.model, "G": args.group_size, "prompts": args.num_prompts, "T": args.temperature,
                   "max_new_tokens": args.max_new_tokens, "seed": args.seed, "k": args.k, "draft": args.draft,
                   "threads": torch.get_num_threads()})
    total = args.num_prompts * args.group_size
    table = Table(COLUMNS)
    ref, seconds = rollout(model, prompts, args, {"sampling_mode": "fixed_slot", "max_active_sequences": total}, eos)
    s = ref.stats
    table.add(row="plain (reference)", kind="-", differ=0, of=total, first_diff="-", decode_steps=s.decode_steps,
              verify_steps=0, drafted=0, accepted=0, tokens=s.generated_tokens, wall_s=seconds)
    drafter = None
    known = {row.name: row for row in rows(total)}
    unknown = [name for name in args.rows or [] if name not in known]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {list(known)}")
    for row in [known[name] for name in args.rows] if args.rows is not None else known.values():
        config = dict(row.config)
        if row.draft:
            if drafter is None:
                drafter = copy.deepcopy(model) if args.draft == "self" else tiny_drafter(model)
            config["speculative_draft_model"] = drafter
        out, seconds = rollout(model, prompts, args, config, eos)
        firsts = differing(ref.completion_ids, out.completion_ids)
        s = out.stats
        table.add(row=row.name, kind=row.kind, differ=len(firsts), of=total,
                  first_diff=" ".join(map(str, sorted(firsts)[:4])) or "-", decode_steps=s.decode_steps,
                  verify_steps=s.verify_steps, drafted=s.draft_tokens, accepted=s.accepted_tokens,
                  tokens=s.generated_tokens, wall_s=seconds)
        save_json(args.json, header, table, {"partial": True})
    write_results(args.json, header, table, {"args": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()
