"""The exactness check of the support contract: the engine's prefill + decode against the model's own forward.

A prompt is prefilled into a small pool of its own and `DECODE_TOKENS` tokens are decoded one per forward through the
selected attention backend, exactly as the engine runs them: each token once as an eager segment (the path of
prefill, verification and row-by-row decoding) and once through the static decode step's metadata (with the group
slots of the torch backend's cascade decode where the static step passes them, `ModelRunner.cascade_decode`, and
through the C++ decode kernel when it is checked). The logits
must equal those of one plain forward of the whole sequence (no KV cache) up to `exactness_tolerance` of the dtype
the model computes in (`ModelSupport.compute_dtype`: the autocast dtype under autocast). Everything runs under the
caller's autocast state, which the engine then keeps for every `generate` (`autocast.py`). It catches what the
structural and routing checks cannot see: state kept outside the KV cache, positions the model numbers differently,
attention the engine reproduces wrongly. When it fails, `_diagnose` tells those apart from a model whose own forward
is inconsistent (its own KV-cached decode, what `generate` runs, differs from its full forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import Segment, decode_metadata
from .autocast import describe
from .config import EngineConfig
from .kv_pool import KVCachePool
from .model_runner import ModelRunner

if TYPE_CHECKING:
    from .support import ModelSupport

DECODE_TOKENS = 3
NO_AUTOCAST = "in TRL / accelerate: `bf16=False` and `fp16=False`"  # how a trainer user turns autocast off


def exactness_tolerance(dtype: torch.dtype) -> float:
    """Largest relative logit error (max |engine - model| / max |model|) accepted for a model computing in `dtype`
    (its parameter dtype, or the autocast dtype under autocast): float32 round-off, or the noise of 16-bit formats
    over a deep model, where two exact computations of the same logits differ by their rounding order
    (SmolLM2-135M, 30 layers: 1.5e-2 in bfloat16, 1.6e-3 in float16, 1.6e-6 in float32; float32 weights under
    bfloat16 autocast 7e-3 to 1.1e-2, the model's own KV-cached decode against its forward 7e-3 to 9e-3:
    `benchmarks/RESULTS.md`, "Exactness under autocast"). Adjacent bfloat16 values are 2^-8 to 2^-7 of their size
    apart, so one rounding step of a large logit already exceeds the float32 tolerance. A layer whose state is lost
    between forwards gives errors of order 1."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 1e-1


@torch.no_grad()
def exactness_problem(
    model: torch.nn.Module, support: ModelSupport, attention_backend: str, ids: torch.Tensor,
    cpu_decode_kernel: bool = False,
) -> str | None:
    """Prefill `ids[:-DECODE_TOKENS]` ([1, N]), decode the rest one token per forward through a small pool; the
    logits must match the model's own forward of `ids` (positions P-1 .. N-1). Returns what went wrong, or None.
    `support` holds the pool layout, dtypes and layer specs the routing probe found."""
    tokens = ids[0].tolist()
    n, p, block = len(tokens), len(tokens) - DECODE_TOKENS, 4
    device = ids.device
    pool = KVCachePool(support.kv, EngineConfig(kv_cache_tokens=2 * n + 12 * block, block_size=block),
                       dtype=support.kv_dtype, device=device)
    runner = ModelRunner(model, pool, attention_backend, support.layers, cpu_decode_kernel)
    prompt_blocks = pool.allocator.allocate(-(-p // block))
    # the two decode paths write their own blocks (a token's K/V in later layers depends on the path's rounding)
    eager_blocks, static_blocks = (pool.allocator.allocate(-(-DECODE_TOKENS // block)) for _ in range(2))
    cascade = runner.cascade_decode  # the static step passes group slots then
    as_row = lambda blocks: torch.tensor([blocks], dtype=torch.long, device=device)  # noqa: E731
    one = lambda v: torch.tensor([v], dtype=torch.long, device=device)  # noqa: E731
    eager, static = [], []
    try:
        first = runner.forward([Segment(p, prompt_blocks, [], 0, tokens[:p])], torch.tensor([p - 1]))[0]
        for j in range(DECODE_TOKENS):
            seg = Segment(p, prompt_blocks, eager_blocks, p + j, [tokens[p + j]])
            eager.append(runner.forward([seg], torch.tensor([0]))[0])
        for j in range(DECODE_TOKENS):
            meta = decode_metadata(one(p + j), one(p), as_row(prompt_blocks), as_row(static_blocks), one(0), block,
                                   one(0) if cascade else None, as_row(prompt_blocks) if cascade else None)
            with runner.routed():
                static.append(runner.run(one(tokens[p + j])[None], one(p + j)[None], meta, 0)[0])
    except Exception as exc:  # noqa: BLE001
        return (f"prefill and decode through the paged KV cache failed {describe(support.autocast)} "
                f"({type(exc).__name__}: {str(exc)[:200]})")
    try:
        ref = model(input_ids=ids, use_cache=False).logits[0, p - 1 :].float()
    except Exception as exc:  # noqa: BLE001
        return f"its own forward fails {describe(support.autocast)} ({type(exc).__name__}: {str(exc)[:200]})"
    tol = exactness_tolerance(support.compute_dtype)
    for path, rows in (("eager", eager), ("static decode step", static)):
        err = _relative_error(torch.cat([first, *rows]).float(), ref)
        if not err <= tol:
            return (f"prefill + decode through the paged KV cache ({path} path, {describe(support.autocast)}) does "
                    f"not reproduce the model's own forward (relative logit error {err:.2e} > {tol:.0e}): "
                    f"{_diagnose(model, ids, ref, support)}")
    return None


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def _diagnose(model: torch.nn.Module, ids: torch.Tensor, ref: torch.Tensor, support: ModelSupport) -> str:
    """Why the exactness check failed: positions the model numbers its own way, or a model whose own forward is
    inconsistent (its KV-cached decode differs from its full forward: state outside the cache, or rounding under
    autocast that it does not show without autocast), or attention the engine does not reproduce."""
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    tol = exactness_tolerance(support.compute_dtype)
    try:
        with_pos = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, -ref.shape[0] :]
        shifted = model(input_ids=ids, position_ids=pos + 7, use_cache=False).logits[0, -ref.shape[0] :]
    except Exception:  # noqa: BLE001
        with_pos = shifted = None
    if with_pos is not None and torch.equal(with_pos, shifted):
        return "it ignores `position_ids` (positions come from the input or its cache), so the tokens of a packed " \
               "batch get wrong positions"
    if with_pos is not None and _relative_error(with_pos, ref) > tol:
        return "its own forward does not number positions 0, 1, 2, ... as the `position_ids` the engine passes " \
               "(e.g. an offset after the padding index)"
    own = own_cache_error(model, ids, ref.shape[0] - 1)
    if own is None or own <= tol:
        consistent = "" if own is None else f" (its own KV cache reproduces its forward: relative error {own:.1e})"
        return f"some layer attends in a way the engine does not reproduce{consistent}"
    state = (f"the model's own forward is inconsistent {describe(support.autocast)}: with its own KV cache (what "
             f"`generate` runs) it gives other logits than without one (relative error {own:.2e})")
    if support.autocast is None:
        return f"{state}, so some layer keeps state between forwards outside the KV cache"
    plain = _without_autocast(model, ids, ref.shape[0] - 1)
    if plain == "forced":
        return (f"{state}; its forward turns autocast on by itself (e.g. accelerate's mixed-precision wrapper), so it "
                f"was not checked without: if it is consistent there, run it without autocast ({NO_AUTOCAST})")
    if plain is not None and plain <= exactness_tolerance(next(model.parameters()).dtype):
        return (f"{state} and consistent without autocast (relative error {plain:.1e}); run it without autocast "
                f"({NO_AUTOCAST})")
    return f"{state}, and without autocast too, so some layer keeps state between forwards outside the KV cache"


def own_cache_error(model: torch.nn.Module, ids: torch.Tensor, decode: int) -> float | None:
    """Relative error of the model's own KV-cached forward (prefill of `ids[:, :-decode]`, then one token per
    forward, as `generate` runs it) against its plain forward of `ids`, over the last `decode + 1` logits; None if
    the model does not run with its own cache."""
    p = ids.shape[1] - decode
    try:
        ref = model(input_ids=ids, use_cache=False).logits[0, p - 1 :]
        out = model(input_ids=ids[:, :p], use_cache=True)
        rows, past = [out.logits[0, -1:]], out.past_key_values
        for j in range(decode):
            out = model(input_ids=ids[:, p + j : p + j + 1], past_key_values=past, use_cache=True)
            rows.append(out.logits[0, -1:])
            past = out.past_key_values
    except Exception:  # noqa: BLE001
        return None
    return _relative_error(torch.cat(rows), ref)


def _without_autocast(model: torch.nn.Module, ids: torch.Tensor, decode: int) -> float | str | None:
    """`own_cache_error` with autocast turned off around the model; "forced" if its forward turns it back on."""
    device_type = ids.device.type
    seen = []
    inner = next((m for m in model.children()), model)
    hook = inner.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled(device_type)))
    try:
        with torch.autocast(device_type, enabled=False):
            err = own_cache_error(model, ids, decode)
    finally:
        hook.remove()
    return "forced" if any(seen) else err
