"""The exactness check of the support contract: the engine's prefill + decode against the model's own forward.

A prompt is prefilled into a small pool of its own and `DECODE_TOKENS` tokens are decoded one per forward through the
selected attention backend, exactly as the engine runs them; the logits must equal those of one plain forward of the
whole sequence (no KV cache) up to `exactness_tolerance`. It catches what the structural and routing checks cannot
see: state kept outside the KV cache, positions the model numbers differently, attention the engine reproduces
wrongly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import Segment
from .config import EngineConfig
from .kv_pool import KVCachePool
from .model_runner import ModelRunner

if TYPE_CHECKING:
    from .support import ModelSupport

DECODE_TOKENS = 3


class NonFiniteModelError(ValueError):
    """The model's own forward gives NaN / inf logits on the probe: not a model the engine cannot run, a model
    nothing can sample from (its weights or buffers hold non-finite values, or it overflows in its dtype)."""


def exactness_tolerance(dtype: torch.dtype) -> float:
    """Largest relative logit error (max |engine - model| / max |model|) accepted: float32 round-off, or the noise of
    16-bit formats over a deep model (SmolLM2-135M, 30 layers: 1.5e-2 in bfloat16, 1.6e-3 in float16, 1.6e-6 in
    float32). A layer whose state is lost between forwards gives errors of order 1."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 1e-1


@torch.no_grad()
def exactness_problem(
    model: torch.nn.Module, support: ModelSupport, attention_backend: str, ids: torch.Tensor,
    cpu_decode_kernel: bool = False,
) -> str | None:
    """Prefill `ids[:-DECODE_TOKENS]` ([1, N]), decode the rest one token per forward through a small pool; the
    logits must match the model's own forward of `ids` (positions P-1 .. N-1). Returns what went wrong, or None.
    `support` holds the pool layout and layer specs the routing probe found."""
    param = next(model.parameters())
    tokens = ids[0].tolist()
    n, p, block = len(tokens), len(tokens) - DECODE_TOKENS, 4
    pool = KVCachePool(support.kv, EngineConfig(kv_cache_tokens=2 * n + 8 * block, block_size=block),
                       dtype=param.dtype, device=param.device)
    runner = ModelRunner(model, pool, attention_backend, support.layers, cpu_decode_kernel)
    prompt_blocks = pool.allocator.allocate(-(-p // block))
    own_blocks = pool.allocator.allocate(-(-DECODE_TOKENS // block))
    try:
        rows = [runner.forward([Segment(p, prompt_blocks, [], 0, tokens[:p])], torch.tensor([p - 1]))[0]]
        for j in range(DECODE_TOKENS):
            seg = Segment(p, prompt_blocks, own_blocks, p + j, [tokens[p + j]])
            rows.append(runner.forward([seg], torch.tensor([0]))[0])
    except Exception as exc:  # noqa: BLE001
        return f"prefill and decode through the paged KV cache failed ({type(exc).__name__}: {str(exc)[:200]})"
    got = torch.cat(rows).float()  # [DECODE_TOKENS + 1, V]
    try:
        ref = model(input_ids=ids, use_cache=False).logits[0, p - 1 :].float()
    except Exception as exc:  # noqa: BLE001
        return f"its own forward fails ({type(exc).__name__}: {str(exc)[:200]})"
    if not torch.isfinite(ref).all():
        raise NonFiniteModelError(
            f"the model's own forward produced NaN/inf logits on the engine's support probe ({param.dtype}, "
            f"{ids.shape[1]} tokens): its weights or buffers hold non-finite values, or it overflows in this dtype. "
            "Nothing can be sampled from it (`generate` raises 'probability tensor contains either `inf`, `nan` or "
            "element < 0')."
        )
    err = _relative_error(got, ref)
    if not err <= exactness_tolerance(param.dtype):
        return (f"prefill + decode through the paged KV cache does not reproduce the model's own forward (relative "
                f"logit error {err:.2e} > {exactness_tolerance(param.dtype):.0e}): {_diagnose(model, ids, ref)}")
    return None


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def _diagnose(model: torch.nn.Module, ids: torch.Tensor, ref: torch.Tensor) -> str:
    """Why the exactness check failed, when the model's positions explain it."""
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    tol = exactness_tolerance(next(model.parameters()).dtype)
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
    return "some layer keeps state between forwards or attends in a way the engine does not reproduce"
