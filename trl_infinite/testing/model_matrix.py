"""Model matrix: every causal-LM model type of `transformers`, through the engine against `model.generate`.

    python -m trl_infinite.testing.model_matrix --out docs/models.md [--types llama gemma2 ...]

For each model type it builds a tiny random-weight float32 model (`tiny_configs`), then either records the
`ValueError` with which `RolloutEngine` refuses it, or runs greedy decoding in `fixed_slot` and `full_group` mode
with block sizes 16 and 5 (G = 3, prompts of 3, 8, 9 and 17 tokens, 12 new tokens, an EOS id that greedy decoding
emits early on some prompts) and compares every completion with `model.generate(do_sample=False)` cut at that EOS.

Verdicts: `token-identical`; `refused` (the engine's `ValueError`); `identical to forward` (the engine's tokens
differ from `model.generate` but equal greedy decoding with the model's own full forward, no KV cache: transformers'
cached generation disagrees with its own forward for that configuration); `MISMATCH` (a silent difference: the
engine accepted the model and returned tokens neither reference gives); `engine error` (accepted, then failed);
`not built` (no tiny model could be built from the config, or its own forward / `generate` fails; reason shown).
"""

from __future__ import annotations

import argparse
import os
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import torch

from trl_infinite.testing.tiny_configs import SIZES, VOCAB, build_tiny_model, sizes

PROMPT_LENS = (3, 8, 9, 17)
MAX_NEW = 12
G = 3
MODES = ("fixed_slot", "full_group")
BLOCK_SIZES = (16, 5)
VERDICTS = ("token-identical", "refused", "identical to forward", "MISMATCH", "engine error", "not built")


@dataclass
class Row:
    model_type: str
    verdict: str
    detail: str = ""
    seconds: float = 0.0


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def reference(model, prompt: list[int], eos: int | None) -> list[int]:
    """`model.generate(do_sample=False)` of MAX_NEW tokens, cut after the first `eos` (kept)."""
    # greedy with no logits processor from the model's own generation defaults (beams, n-gram bans, penalties)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=MAX_NEW, do_sample=False, num_beams=1, repetition_penalty=1.0,
                         no_repeat_ngram_size=0, pad_token_id=0, eos_token_id=eos)[0, len(prompt):].tolist()
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    return out


def forward_greedy(model, prompt: list[int], eos: int | None) -> list[int]:
    """Greedy decoding by full forwards of the whole sequence (no KV cache), cut after the first `eos`."""
    ids = list(prompt)
    for _ in range(MAX_NEW):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        if ids[-1] == eos:
            break
    return ids[len(prompt):]


def early_eos(model, ps: list[list[int]]) -> int | None:
    """A token greedy decoding emits after the first step on some prompt but not on all (an early EOS)."""
    full = [reference(model, p, None) for p in ps]
    seen = Counter(t for row in full for t in row[1:])
    for t, _ in seen.most_common():
        if any(t not in row for row in full):
            return t
    return max(seen, key=seen.get) if seen else None


def refusal_pattern(model_type: str) -> str:
    """A regex for the engine's clear refusal of `model_type`: the type named, a reason, the vLLM fallback."""
    return rf"cannot run `{re.escape(model_type)}` \(\w+\) exactly: .+ \(`use_vllm=True` in the trainer\)"


@dataclass
class Judgement:
    """The contract's verdict on one model: `refusal` (the engine's `ValueError` message) or, when it was served,
    the engine's completions and `model.generate`'s for the same prompts."""

    refusal: str | None = None
    got: list[list[int]] | None = None
    want: list[list[int]] | None = None


def judge(model, engine_config, ps: list[list[int]], n: int, max_new: int = MAX_NEW) -> Judgement:
    """Build the engine for `model`; if it raises `ValueError`, return the message; else greedy-decode each of `ps`
    `n` times through it (`max_new` tokens, no EOS) and return that with `model.generate`'s greedy tokens."""
    from trl_infinite.engine import RolloutEngine, SamplingParams

    try:
        engine = RolloutEngine(model, engine_config)
    except ValueError as exc:
        return Judgement(refusal=str(exc))
    with torch.no_grad():
        got = engine.generate(ps, n, SamplingParams(max_new_tokens=max_new, temperature=0.0)).completion_ids
    want = [reference(model, p, None)[:max_new] for p in ps for _ in range(n)]
    return Judgement(got=got, want=want)


def check_model(model_type: str, head_dim: int = SIZES["head_dim"]) -> Row:
    """The verdict of one model type (see module docstring), built with `tiny_configs.sizes(head_dim)`."""
    from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams

    try:
        model = build_tiny_model(model_type, size=sizes(head_dim))
    except Exception as exc:  # noqa: BLE001
        return Row(model_type, "not built", _short(exc))
    ps = prompts()
    try:
        with torch.no_grad():
            model(torch.tensor([ps[0]]), use_cache=False)
    except Exception as exc:  # noqa: BLE001
        return Row(model_type, "not built", f"its own forward fails: {_short(exc)}")
    engines = []
    for block in BLOCK_SIZES:
        for mode in MODES:
            cfg = EngineConfig(sampling_mode=mode, max_active_sequences=2, kv_cache_tokens=64 * block * 4,
                               block_size=block, max_prefill_tokens=12)
            try:
                engines.append((f"{mode}, block {block}", RolloutEngine(model, cfg)))
            except ValueError as exc:
                return Row(model_type, "refused", str(exc))
            except Exception as exc:  # noqa: BLE001
                return Row(model_type, "engine error", f"building the engine: {_short(exc)}")
    try:
        eos = early_eos(model, ps)
        refs = [reference(model, p, eos) for p in ps]
    except Exception as exc:  # noqa: BLE001
        return Row(model_type, "not built", f"accepted, but `model.generate` fails: {_short(exc)}")
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[eos] if eos is not None else [])
    want = [r for r in refs for _ in range(G)]
    for name, engine in engines:
        try:
            got = engine.generate(ps, G, sampling).completion_ids
        except Exception as exc:  # noqa: BLE001
            return Row(model_type, "engine error", f"{name}: {_short(exc)}")
        if got != want:
            bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            detail = f"{name}, prompt {bad // G}: engine {got[bad]}, generate {want[bad]}"
            with torch.no_grad():
                by_forward = [r for p in ps for r in [forward_greedy(model, p, eos)] * G]
            if got == by_forward:
                return Row(model_type, "identical to forward", detail + " = greedy by full forwards")
            return Row(model_type, "MISMATCH", detail)
    stops = sum(1 for r in refs if len(r) < MAX_NEW)
    return Row(model_type, "token-identical", f"{stops} of {len(refs)} prompts stop at the early EOS")


def _short(exc: BaseException, n: int = 160) -> str:
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())[:n]


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


INTRO = """# Supported models

The rollout engine runs a Hugging Face causal LM exactly (greedy output token-identical to `model.generate`, sampled
distributions unchanged) or refuses it when the `RolloutEngine` is built, with a `ValueError` that names the model
type, the unsupported feature and what to use instead (`use_vllm=True` in the trainer). There is no silent path.

## The contract (`trl_infinite/engine/model/support.py`)

Checked once per engine, on the model in eval mode:

1. **Structure.** Every entry of the config's `layer_types` is `full_attention`, `sliding_attention` or
   `chunked_attention` (or a stateless `mlp` / `moe` layer), and no module is a recurrent, convolutional or
   linear-attention mixer (Mamba, RWKV, gated delta-net, short convolutions, ...): their state between forwards is
   not a KV cache, so hybrids and SSMs are refused. A rotary embedding whose rotation of a position depends on the
   other positions of the forward is refused too (`dynamic` NTK scaling and Phi-3's `longrope`: transformers
   recomputes their frequencies from each forward's longest sequence), found by calling each rotary module with and
   without a far position (`engine/model/rope_length.py`); `linear`, `yarn` and `llama3` scaling are served.
2. **Routing probe.** One short forward with a recording attention function: every attention module must route
   through `transformers.AttentionInterface`, once per forward (DiffLlama's two calls per layer are refused), with a
   unique `layer_idx` and the engine's `paged_ctx` kwarg reaching it (StableLM and Nemotron drop the kwargs; BLOOM,
   GPT-J, CodeGen, GPT-Neo, Falcon, MPT compute attention in their own modules); every decoder layer must hold such
   a module; every kwarg passed must be one the engine implements (scale, sliding window, soft-cap, `s_aux` sinks:
   relative position biases and sparse indexed attention are refused); the mask the model builds for each layer
   must be the causal / sliding-window / chunked pattern the engine reproduces. The key / value shapes seen give the
   pool's per-layer widths (MQA, GQA, MLA's 192-wide keys and 128-wide values).
3. **Exactness.** A prompt prefilled into a small pool and three tokens decoded one at a time through the selected
   attention backend must give the logits of the model's own forward (relative error below 1e-3 in float32).
   Models that number positions differently from the `position_ids` the engine passes (BART-style decoders,
   RoBERTa's padding offset) fail here, with that reason.
4. **In every dtype the same decision.** Whether a model is served is decided in float32 whatever the run's dtype:
   a model with bf16 / fp16 weights or under autocast (TRL's default `bf16=True`) is first put through the routing
   and exactness checks in float32 (its own float32 weights with autocast off, a float32 copy, or a float32 replica
   built from its config: `engine/model/replica.py`); then the run itself is checked against a bound derived from the
   model's own 16-bit rounding noise (4 x, within 2 to 12 units of the dtype's precision: `engine/model/exactness.py`).
   `benchmarks/support_table.py` lists the decision per model type in float32, bf16 weights, bf16 autocast and on
   the replica (`benchmarks/RESULTS.md`, "Support contract in float32 and bf16").

## Attention features implemented

In the torch reference backend and in the Triton cascade decode kernels (`attention_backend="triton"`, the default
on CUDA; multi-token forwards use the torch backend on every device): causal attention with GQA / MQA (any number of
query heads per KV head), keys wider than values (MLA: DeepSeek-V2/V3, MiniCPM3), per-layer sliding windows,
chunked attention (Llama 4's `attention_chunk_size`), logit soft-capping (Gemma 2, VaultGemma) and attention sinks
(gpt-oss `s_aux`).

## The matrix

"""


def _reason(message: str) -> str:
    """The feature part of a refusal message (between "exactly: " and the advice)."""
    text = message.split("exactly: ", 1)[-1].split(". Generate with vLLM")[0]
    if "relative logit error" in text:  # the exactness check: keep its diagnosis
        head, cause = text.split(" (relative logit error", 1)
        return f"{head}: {cause.split('): ', 1)[-1].split(' (')[0]}"
    for cut in (" (", ";", ":"):
        text = text.split(cut)[0]
    return text


def markdown(rows: list[Row], head_dim: int = SIZES["head_dim"]) -> str:
    import transformers

    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    lines = [
        INTRO.rstrip("\n"), "",
        f"`python -m trl_infinite.testing.model_matrix"
        f"{'' if head_dim == SIZES['head_dim'] else f' --head-dim {head_dim}'} --out docs/models.md` (transformers "
        f"{transformers.__version__}, torch {torch.__version__}, CPU, float32) builds every causal-LM model type of "
        "transformers as a tiny random-weight model (`trl_infinite/testing/tiny_configs.py`: 2 layers, hidden "
        f"{4 * head_dim}, head dim {head_dim}, sliding window 6, attention chunk 5) and runs greedy decoding in "
        "`fixed_slot` and `full_group` mode with block sizes 16 and 5 (G = 3, "
        "prompts of 3, 8, 9 and 17 tokens, 12 new tokens, an EOS that ends some samples early) against "
        "`model.generate`.",
        "",
        f"**{len(rows)} model types: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".**",
        "",
        "Refusals by reason:",
        "",
    ]
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r.verdict == "refused":
            reasons.setdefault(_reason(r.detail), []).append(r.model_type)
    for reason, types in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- {reason} ({len(types)}): " + ", ".join(f"`{t}`" for t in types))
    lines += ["", "| model type | verdict | detail |", "| --- | --- | --- |"]
    for r in rows:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{r.model_type}` | {r.verdict} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every causal-LM type of transformers)")
    parser.add_argument("--out", help="write the markdown table here (else print it)")
    parser.add_argument("--head-dim", type=int, default=SIZES["head_dim"],
                        help="attention head width of the tiny models (hidden = 4 x; 16 runs the CPU decode kernel in "
                             "the engine's decode steps, 8 the torch path)")
    args = parser.parse_args(argv)
    try:  # a bad width fails here, not once per model type
        sizes(args.head_dim)
    except ValueError as err:
        parser.error(f"--head-dim: {err}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny models: threads only add contention
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for model_type in args.types or causal_lm_types():
        start = time.perf_counter()
        row = check_model(model_type, args.head_dim)
        row.seconds = time.perf_counter() - start
        rows.append(row)
        print(f"{model_type:28s} {row.verdict:16s} {row.seconds:6.1f}s  {row.detail[:150]}", flush=True)
    table = markdown(rows, args.head_dim)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    else:
        print(table)


if __name__ == "__main__":
    main()
