"""Start-up cost of the support contract's float32 decision and length-dependent-RoPE probe (`engine/model/support.py`).

    python benchmarks/support_startup.py [--repeats 3] [--no-smollm2]

Times `check_support` (what building a `RolloutEngine` runs, the C++ kernel left out) on SmolLM2-135M-Instruct (real
weights, `trl_infinite.testing.offline_models`) and on the model matrix's tiny Llama, in float32, with bf16 weights
and with float32 weights under bf16 autocast: whole, and with the two additions switched off (the float32 decision
`_float32_decision`, the RoPE probe `length_dependent_rope`), so the difference is what they add. Best of
`--repeats` runs each, one torch thread.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from common import quiet_offline_cpu  # noqa: E402

SETTINGS = ("float32", "bf16 weights", "bf16 autocast")


def seconds(model, setting: str, repeats: int, additions: bool) -> float:
    from trl_infinite.engine.model import support

    saved = support._float32_decision, support.length_dependent_rope
    if not additions:
        support._float32_decision, support.length_dependent_rope = (lambda *a, **k: None), (lambda *a: None)
    best = float("inf")
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "bf16 autocast"):
                support.check_support(model)
            best = min(best, time.perf_counter() - start)
    finally:
        support._float32_decision, support.length_dependent_rope = saved
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-smollm2", action="store_true")
    args = parser.parse_args(argv)
    quiet_offline_cpu()
    from trl_infinite.testing.tiny_configs import build_tiny_model

    models = [("tiny llama (2 layers, hidden 32)", lambda: build_tiny_model("llama"))]
    if not args.no_smollm2:
        from trl_infinite.testing.offline_models import load_smollm2

        models.append(("SmolLM2-135M-Instruct (30 layers)", lambda: load_smollm2()[0].eval()))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, CPU, one thread, best of "
          f"{args.repeats}\n")
    print("| model | setting | check_support s | without the additions s | added s |")
    print("|---|---|---|---|---|")
    for name, make in models:
        base = make()
        for setting in SETTINGS:
            model = base.to(torch.bfloat16) if setting == "bf16 weights" else base.float()
            full = seconds(model, setting, args.repeats, True)
            bare = seconds(model, setting, args.repeats, False)
            print(f"| {name} | {setting} | {full:.2f} | {bare:.2f} | {full - bare:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
