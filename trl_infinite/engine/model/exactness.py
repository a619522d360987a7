"""The exactness check of the support contract: the engine's prefill + decode against the model's own forward.

A prompt is prefilled into a small pool of its own and `DECODE_TOKENS` tokens are decoded one per forward through the
selected attention backend, exactly as the engine runs them: each token once as an eager segment (the path of
prefill, verification and row-by-row decoding) and once through the static decode step's metadata (with the group
slots of the torch backend's cascade decode where the static step passes them, `ModelRunner.cascade_decode`, and
through the C++ decode kernel when it is checked). The logits must equal those of one plain forward of the whole
sequence (no KV cache): everything runs under the caller's autocast state, which the engine then keeps for every
`generate` (`autocast.py`). It catches what the structural and routing checks cannot see: state kept outside the KV
cache, positions the model numbers differently, attention the engine reproduces wrongly. When it fails, `_diagnose`
tells those apart from a model whose own forward is inconsistent (its own KV-cached decode, what `generate` runs,
differs from its full forward).

Two comparisons, two bounds (relative logit error: max |engine - model| / max |model|):

- float32 (`FLOAT32_TOLERANCE`, 1e-3): the structural decision. `support.check_support` always makes it in float32
  (`replica.float32_reference`: the model itself with autocast off, a float32 copy, or a float32 replica built
  from the config), so whether an architecture is served never depends on a 16-bit tolerance. float32 round-off
  between two exact computations of the same logits is ~1e-6 (SmolLM2-135M, 30 layers: 1.6e-6); a layer whose
  state is lost between forwards, or a position numbered differently, gives errors of order 1e-2 to 1.
- 16-bit (the run's dtype: bf16 / fp16 weights, or float32 weights under autocast): the run itself, after the
  float32 decision passed. Its bound is derived from this model's own rounding noise on the same probe
  (`rounding_bound`), the larger of two measures of it: the distance of its 16-bit forward from its float32 forward
  (the same weights without autocast, or their float32 copy; on a replica, the replica's own 16-bit forward against
  its float32 forward: the same architecture's noise in that setting), and the error of its own
  KV-cached decode (what `generate` runs, a known-good path that differs from the full forward by rounding order
  only) in the same dtype. The engine's 16-bit result and the model's are each about that far from the exact
  logits, so they differ by at most about twice it; a factor 2 on top covers the spread between paths and probes
  (measured: engine / own-cache error 1.0-1.5 on SmolLM2, bf16 weights and bf16 / fp16 autocast,
  `benchmarks/RESULTS.md` "Exactness under autocast"; the static decode step's cascade of tiny Gemma 4 models
  2.5-6.5 units of bf16 where their own cached decode is bit-identical to their forward, hence the float32
  measure). bound = `NOISE_MULTIPLE` (4) x noise, at least `FLOOR_ULPS` (2) units of the dtype's precision
  (`finfo.eps`: 2^-7 in bf16, 2^-10 in fp16; one rounding step of the largest logit is half a unit) and at most
  `CAP_ULPS` (12: 9.4e-2 in bf16, the old fixed tolerance), so that a model whose 16-bit forward is itself
  inconsistent cannot widen the bound without limit.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trl_infinite.engine.attention import Segment, decode_metadata
from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.runner.autocast import describe
from trl_infinite.engine.runner.kv_pool import KVCachePool
from trl_infinite.engine.runner.model_runner import ModelRunner

if TYPE_CHECKING:
    from trl_infinite.engine.model.support import ModelSupport

DECODE_TOKENS = 3
NO_AUTOCAST = "in TRL / accelerate: `bf16=False` and `fp16=False`"  # how a trainer user turns autocast off


class NonFiniteModelError(ValueError):
    """The model's own forward gives NaN / inf logits on the probe: not a model the engine cannot run, a model
    nothing can sample from (its weights or buffers hold non-finite values, or it overflows in its dtype)."""


FLOAT32_TOLERANCE = 1e-3
NOISE_MULTIPLE = 4.0
FLOOR_ULPS = 2.0
CAP_ULPS = 12.0


def is_16bit(dtype: torch.dtype) -> bool:
    return dtype not in (torch.float32, torch.float64)


def exactness_tolerance(dtype: torch.dtype) -> float:
    """The float32 tolerance for a model computing in float32 / float64; for a 16-bit dtype, the largest bound
    `rounding_bound` can give (`CAP_ULPS` units of its precision)."""
    return CAP_ULPS * torch.finfo(dtype).eps if is_16bit(dtype) else FLOAT32_TOLERANCE


@dataclass(frozen=True)
class RoundingBound:
    """The 16-bit bound of the module docstring: `bound` from the model's rounding noise `noise` (the larger of its
    own KV-cached decode's error and its 16-bit forward's distance from its float32 forward; None: neither could be
    measured, so the floor applies)."""

    dtype: torch.dtype
    noise: float | None
    bound: float

    def describe(self) -> str:
        eps = torch.finfo(self.dtype).eps
        name = str(self.dtype).removeprefix("torch.")
        seen = "its rounding noise could not be measured" if self.noise is None else \
            f"{NOISE_MULTIPLE:g} x its own 16-bit rounding noise {self.noise:.1e}"
        return f"{self.bound:.1e}: {seen}, within {FLOOR_ULPS:g} to {CAP_ULPS:g} units of {name} ({eps:.1e})"


def rounding_bound(model: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype, float32_noise: float | None = None
                   ) -> RoundingBound:
    """The bound for the engine's error on `ids` in the 16-bit `dtype` the model computes in (module docstring).
    `float32_noise`: the relative distance of the 16-bit forward from the float32 forward, where measured."""
    eps = torch.finfo(dtype).eps
    noises = [n for n in (own_cache_error(model, ids, DECODE_TOKENS), float32_noise) if n is not None]
    noise = max(noises, default=None)
    return RoundingBound(dtype, noise, min(max(NOISE_MULTIPLE * (noise or 0.0), FLOOR_ULPS * eps), CAP_ULPS * eps))


@torch.no_grad()
def exactness_problem(
    model: torch.nn.Module, support: ModelSupport, attention_backend: str, ids: torch.Tensor,
    cpu_decode_kernel: bool = False, float32_noise: float | None = None,
) -> str | None:
    """Prefill `ids[:-DECODE_TOKENS]` ([1, N]), decode the rest one token per forward through a small pool; the
    logits must match the model's own forward of `ids` (positions P-1 .. N-1). Returns what went wrong, or None.
    `float32_noise`: the 16-bit forward's distance from the float32 forward, for the 16-bit bound.
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
    if not torch.isfinite(ref).all():
        raise NonFiniteModelError(
            f"the model's own forward produced NaN/inf logits on the engine's support probe "
            f"({describe(support.autocast)}, {ids.shape[1]} tokens): its weights or buffers hold non-finite values, "
            "or it overflows in this dtype. Nothing can be sampled from it (`generate` raises 'probability tensor "
            "contains either `inf`, `nan` or element < 0')."
        )
    errors = [(path, _relative_error(torch.cat([first, *rows]).float(), ref))
               for path, rows in (("eager", eager), ("static decode step", static))]
    if all(err <= FLOAT32_TOLERANCE for _, err in errors):
        return None
    tol, why = FLOAT32_TOLERANCE, f"{FLOAT32_TOLERANCE:.0e}"
    if is_16bit(support.compute_dtype):
        bound = rounding_bound(model, ids, support.compute_dtype, float32_noise)
        tol, why = bound.bound, bound.describe()
    for path, err in errors:
        if not err <= tol:
            return (f"prefill + decode through the paged KV cache ({path} path, {describe(support.autocast)}) does "
                    f"not reproduce the model's own forward (relative logit error {err:.2e} > {why}): "
                    f"{_diagnose(model, ids, ref, support, tol)}")
    return None


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def _diagnose(model: torch.nn.Module, ids: torch.Tensor, ref: torch.Tensor, support: ModelSupport, tol: float
              ) -> str:
    """Why the exactness check failed: positions the model numbers its own way, or a model whose own forward is
    inconsistent (its KV-cached decode differs from its full forward: state outside the cache, or rounding under
    autocast that it does not show without autocast), or attention the engine does not reproduce."""
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
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
        name = _cache_kwarg(model)
        out = model(input_ids=ids[:, :p], use_cache=True)
        rows, past = [out.logits[0, -1:]], getattr(out, name)
        for j in range(decode):
            out = model(input_ids=ids[:, p + j : p + j + 1], use_cache=True, **{name: past})
            rows.append(out.logits[0, -1:])
            past = getattr(out, name)
    except Exception:  # noqa: BLE001
        return None
    return _relative_error(torch.cat(rows), ref)


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the KV-cache argument and output: `cache` (transformers 5.24 on), else `past_key_values`."""
    try:
        return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"


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
