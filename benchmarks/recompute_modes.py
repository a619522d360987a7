"""Forward + backward of a decoder under the three recomputation modes of `trl_infinite/trainer/recompute.py`.

A random-weight `LlamaForCausalLM` of SmolLM2-135M's shape (float32, one torch thread), `--rows` x `--tokens` random
ids, the decoder's forward (not the head) and the backward of the mean square of its output, in each mode:
- `full`: TRL's gradient checkpointing (`use_reentrant=False`): each layer's input kept, the layer run again;
- `selective`: `selective_recompute` (the matrix products' outputs kept, the rest recomputed);
- `none`: `no_recompute` (every activation kept).
Each mode runs in its own process (this script re-invokes itself with `--mode`): a short warm-up pass, then `--reps`
measured passes. Columns: the fastest pass's process CPU seconds, and the rise of peak RSS over the warm-up's
(activations and temporaries of the pass; the gradients exist after the warm-up).

    python benchmarks/recompute_modes.py --rows 16 --tokens 140
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

MODES = ("full", "selective", "none")


def measure(mode: str, rows: int, tokens: int, reps: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trl_infinite.trainer.recompute import no_recompute, selective_recompute

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    context = {"full": None, "selective": selective_recompute, "none": no_recompute}[mode]
    body = model.get_decoder()

    def one_pass(shape):
        ids = torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(1))
        with context(model) if context else torch.enable_grad():
            out = body(input_ids=ids, use_cache=False).last_hidden_state
        out.pow(2).mean().backward()

    one_pass((1, 64))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(reps):
        start = time.process_time()
        one_pass((rows, tokens))
        times.append(time.process_time() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "cpu_s": min(times), "peak_rise_GB": (peak - base) * 1024 / 1e9}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=140)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--mode", choices=MODES, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.mode:
        print(json.dumps(measure(a.mode, a.rows, a.tokens, a.reps)))
        return
    rows = []
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--rows", str(a.rows), "--tokens",
                              str(a.tokens), "--reps", str(a.reps)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    full = rows[0]["cpu_s"]
    print(f"{a.rows} rows x {a.tokens} tokens, SmolLM2-135M shape, float32, one thread\n")
    print("| mode | cpu_s | x_full | peak_rise_GB |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['cpu_s']:.2f} | {r['cpu_s'] / full:.3f} | {r['peak_rise_GB']:.2f} |")


if __name__ == "__main__":
    main()
