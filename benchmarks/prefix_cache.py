"""Prefill tokens per rollout with the prefix cache on and off (device-independent counts, issue 28).

    python benchmarks/prefix_cache.py [--prompts 32] [--group 4] [--block-size 16]

Two workloads on a tiny random model (the counts depend on token ids and lengths only, not on the weights;
completion lengths are forced so both runs generate the same number of tokens):

- `tool-3turn`: a tool loop as TRL's `_tool_call_loop` runs it: turn 1 = G samples of each chat-templated prompt
  (system prompt with a tool's JSON schema, qwen3 template, byte tokenizer); turns 2 and 3 = one row per sample,
  prompt + its previous completion + a tool result rendered as the template does, `num_generations=1`. The cache run
  passes `keep_pool=True` between turns (what the trainer does inside one rollout).
- `gsm8k-header`: GSM8K train questions behind one shared 200-token few-shot header (SmolLM2's tokenizer when its
  offline copy is there, else the byte tokenizer), G samples each, one call.

"new to cache" is the ideal: tokens of the calls' prompts whose KV no earlier prompt or written completion of the
rollout holds (a token-level trie, no block granularity, unbounded memory). Targets (issue 28): prefill with the
cache <= 1.1x the new tokens; 3-turn prefill at least 2x smaller than without the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import git_commit  # noqa: E402
from trl_infinite import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from trl_infinite.testing.offline_models import byte_tokenizer  # noqa: E402
from trl_infinite.testing.shared_data import dataset_file  # noqa: E402
from trl_infinite.testing.tools import multiply  # noqa: E402

HEADER_TOKENS = 200
TOOL_SYSTEM = [{"role": "system", "content": "You are a careful assistant. Use the calculator tool for every "
                "arithmetic step and answer with the final number only."}]


class Trie:
    """Token prefixes whose KV exists; `add` returns how many of a sequence's tokens are new."""

    def __init__(self) -> None:
        self.root: dict = {}

    def add(self, ids: list[int]) -> int:
        node, new = self.root, 0
        for t in ids:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                new += 1
            node = nxt
        return new


def tiny_model(vocab: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=8192,
                      tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval()


def make_engine(model, args, cache: bool) -> RolloutEngine:
    """The engine of one row: every sample of the call decoding at once, the cache on or off."""
    return RolloutEngine(model, EngineConfig(prefix_cache=cache, block_size=args.block_size,
                                             max_active_sequences=args.prompts * args.group,
                                             kv_cache_tokens=args.kv_tokens))


def run_tool(args) -> list[dict]:
    from trl.chat_template_utils import qwen3_chat_template

    tok = byte_tokenizer(qwen3_chat_template)
    questions = [f"What is {a} times {b}, then times {a + b}?" for a, b in zip(range(3, 3 + args.prompts),
                                                                                  range(7, 7 + args.prompts))]
    prompts = [tok.apply_chat_template(TOOL_SYSTEM + [{"role": "user", "content": q}], tools=[multiply],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for q in questions]
    suffix = tok("<|im_end|>\n<|im_start|>user\n<tool_response>\n{\"result\": 1234}\n</tool_response><|im_end|>\n"
                 "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    model = tiny_model(len(tok))
    rows = []
    for cache in (False, True):
        engine = make_engine(model, args, cache)
        sampling = SamplingParams(max_new_tokens=args.completion, temperature=1.0, seed=0)
        trie, turns = Trie(), []
        current, g = prompts, args.group
        for turn in range(3):
            new = sum(trie.add(p) for p in current)
            out = engine.generate(current, g, sampling, forced_lengths=[[args.completion] * g] * len(current),
                                  keep_pool=cache)
            rows_prompts = [p for p in current for _ in range(g)]
            for p, c in zip(rows_prompts, out.completion_ids):
                trie.add(p + c[:-1])  # the KV the turn wrote (the last token's is never computed)
            turns.append((turn + 1, len(current) * g, sum(len(p) for p in current), new, out.stats.prefill_tokens,
                          out.stats.prefix_cache_hit_tokens))
            current, g = [p + c + suffix for p, c in zip(rows_prompts, out.completion_ids)], 1
        engine.release_pool()
        for t in turns:
            rows.append(dict(workload="tool-3turn", cache=cache, turn=t[0], rows=t[1], prompt_tokens=t[2],
                             new_tokens=t[3], prefill_tokens=t[4], hit_tokens=t[5]))
    return rows


def gsm8k_tokenizer():
    try:
        from transformers import AutoTokenizer

        from trl_infinite.testing.offline_models import smollm2_path

        return AutoTokenizer.from_pretrained(str(smollm2_path())), "SmolLM2-135M-Instruct"
    except Exception as err:  # noqa: BLE001 - no offline copy: the byte tokenizer
        print(f"(SmolLM2 tokenizer unavailable: {err}; byte tokenizer)", file=sys.stderr)
        return byte_tokenizer(), "byte"


def run_gsm8k(args) -> list[dict]:
    path = dataset_file("gsm8k", "train") if args.gsm8k is None else Path(args.gsm8k)
    records = [json.loads(line) for line in open(path)]
    tok, tok_name = gsm8k_tokenizer()
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in records[:8])
    header = tok(shots, add_special_tokens=False)["input_ids"][:HEADER_TOKENS]
    prompts = [header + tok(f"\n\nQuestion: {r['question']}\nAnswer:", add_special_tokens=False)["input_ids"]
               for r in records[8:8 + args.prompts]]
    model = tiny_model(len(tok))
    rows = []
    for cache in (False, True):
        engine = make_engine(model, args, cache)
        trie = Trie()
        new = sum(trie.add(p) for p in prompts)
        out = engine.generate(prompts, args.group, SamplingParams(max_new_tokens=args.completion, seed=0),
                              forced_lengths=[[args.completion] * args.group] * len(prompts))
        rows.append(dict(workload=f"gsm8k-header ({tok_name})", cache=cache, turn=1, rows=len(prompts) * args.group,
                         prompt_tokens=sum(len(p) for p in prompts), new_tokens=new,
                         prefill_tokens=out.stats.prefill_tokens, hit_tokens=out.stats.prefix_cache_hit_tokens))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion", type=int, default=32, help="forced completion tokens per turn")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=131072,
                        help="KV budget (tokens): room for a whole turn's rows, so the counts show the cache, not "
                        "evictions (a smaller budget evicts cached blocks before their reuse)")
    parser.add_argument("--gsm8k", default=None, help="GSM8K train.jsonl (default: the shared data folder)")
    args = parser.parse_args()
    rows = run_tool(args) + run_gsm8k(args)
    print(f"commit {git_commit()}; command: python benchmarks/prefix_cache.py {' '.join(sys.argv[1:])}".rstrip())
    print("\n| workload | cache | turn | rows | prompt tokens | new to cache | prefill tokens | cache hits |"
          " prefill / new |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {'on' if r['cache'] else 'off'} | {r['turn']} | {r['rows']} | {r['prompt_tokens']} "
              f"| {r['new_tokens']} | {r['prefill_tokens']} | {r['hit_tokens']} | "
              f"{r['prefill_tokens'] / r['new_tokens']:.2f} |")
    print("\n| workload | prefill off | prefill on | new to cache | on / new | off / on |")
    print("|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["workload"] for r in rows):
        tot = {c: sum(r["prefill_tokens"] for r in rows if r["workload"] == name and r["cache"] == c)
               for c in (False, True)}
        new = sum(r["new_tokens"] for r in rows if r["workload"] == name and r["cache"])
        print(f"| {name} | {tot[False]} | {tot[True]} | {new} | {tot[True] / new:.2f} | {tot[False] / tot[True]:.2f} |")


if __name__ == "__main__":
    main()
