"""The support contract's decision (exact / refused) for every causal-LM model type, in float32 and in bf16.

    python benchmarks/support_table.py [--types llama opt ...] [--no-replica]

For each model type of the installed transformers (`trl_infinite.testing.model_matrix.causal_lm_types`) it builds
the matrix's tiny random-weight float32 model and runs the support contract (`engine.support.check_support`, what
building a `RolloutEngine` runs) four ways: float32; bf16 weights (`model.to(bfloat16)`); float32 weights under
`torch.autocast("cpu", bfloat16)` (TRL's default `bf16=True`); and bf16 weights with the float32 copy disabled, so
that the structural decision is made on the float32 replica built from the config (`engine/model/replica.py`, the path of
16-bit models on an accelerator or too large to copy; `--no-replica` leaves it out). It prints one row per model
type (`exact`, or `refused: <reason in a few words>`), then the number of model types whose decision differs
between the settings. Model types with no tiny model (its config, or its own forward, fails) are listed apart.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from common import quiet_offline_cpu  # noqa: E402

SETTINGS = ("float32", "bf16 weights", "bf16 autocast", "bf16 replica")
REASONS = (  # (pattern of the refusal message, the few words shown), first match wins
    (r"its own forward fails", "own forward fails in this dtype"),
    (r"rotary position embedding", "length-dependent RoPE"),
    (r"layer types", "non-attention layer types"),
    (r"stateful non-attention mixers", "stateful mixers"),
    (r"computes attention inside its own modules", "attention outside AttentionInterface"),
    (r"receives no `paged_ctx`", "attention kwargs dropped"),
    (r"times per forward", "attention called twice per layer"),
    (r"ignores `position_ids`", "ignores position_ids"),
    (r"does not number positions", "own position numbering"),
    (r"additive bias", "additive attention bias"),
    (r"attention features the engine does not implement", "unimplemented attention kwargs"),
    (r"run no attention through", "layers without attention"),
    (r"mask of layer .* is not the", "unsupported mask pattern"),
    (r"keeps state between forwards", "state outside the KV cache"),
    (r"attends in a way the engine does not reproduce", "attention not reproduced"),
    (r"cannot be checked in float32", "no float32 replica"),
    (r"failed \(", "probe forward fails"),
)


def short_reason(message: str) -> str:
    for pattern, words in REASONS:
        if re.search(pattern, message):
            return words
    return " ".join(message.split("exactly: ", 1)[-1].split())[:60]


def decide(model, setting: str) -> str:
    from trl_infinite.engine.model.support import check_support

    if setting in ("bf16 weights", "bf16 replica"):
        model = model.to(torch.bfloat16)
    if setting == "bf16 replica":
        from trl_infinite.engine.model import replica

        limit, replica.FLOAT32_COPY_MAX_PARAMS = replica.FLOAT32_COPY_MAX_PARAMS, 0
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "bf16 autocast"):
            check_support(model)
        return "exact"
    except ValueError as exc:
        return f"refused: {short_reason(str(exc))}"
    except Exception as exc:  # noqa: BLE001  (an error is a result too: reported, not hidden)
        return f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:60]}"
    finally:
        if setting == "bf16 replica":
            replica.FLOAT32_COPY_MAX_PARAMS = limit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="*")
    parser.add_argument("--no-replica", action="store_true")
    args = parser.parse_args(argv)
    quiet_offline_cpu()
    from trl_infinite.testing.model_matrix import causal_lm_types, prompts
    from trl_infinite.testing.tiny_configs import build_tiny_model

    settings = SETTINGS[:3] if args.no_replica else SETTINGS
    rows, unbuilt, start = [], [], time.perf_counter()
    for model_type in args.types or causal_lm_types():
        try:
            build_tiny_model(model_type)(torch.tensor([prompts()[0]]), use_cache=False)
        except Exception as exc:  # noqa: BLE001
            unbuilt.append((model_type, f"{type(exc).__name__}: {' '.join(str(exc).split())[:80]}"))
            continue
        t = time.perf_counter()
        row = [decide(build_tiny_model(model_type), s) for s in settings]
        rows.append((model_type, row))
        print(f"# {model_type}: {row} ({time.perf_counter() - t:.1f}s)", file=sys.stderr, flush=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, one thread; "
          f"{time.perf_counter() - start:.0f} s\n")
    print("| model type | " + " | ".join(settings) + " |")
    print("|---" * (len(settings) + 1) + "|")
    for model_type, row in rows:
        print(f"| `{model_type}` | " + " | ".join(row) + " |")
    differ = [t for t, row in rows if len({r.startswith("exact") for r in row}) > 1]
    own = [t for t in differ if any("own forward fails" in r for r in dict(rows)[t])]
    exact = {s: sum(row[i] == "exact" for _, row in rows) for i, s in enumerate(settings)}
    print(f"\n{len(rows)} model types built; exact per setting: " + ", ".join(f"{s} {n}" for s, n in exact.items()))
    print(f"model types whose decision differs between the settings: {len(differ)}"
          + (f" ({', '.join(differ)})" if differ else "") + f"; of which the model's own forward fails in a setting "
          f"(nothing to serve there): {len(own)}" + (f" ({', '.join(own)})" if own else ""))
    if unbuilt:
        print(f"\nno tiny model ({len(unbuilt)}): " + "; ".join(f"`{t}` ({why})" for t, why in unbuilt))


if __name__ == "__main__":
    main()
