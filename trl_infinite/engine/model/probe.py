"""The routing probe: one short forward of the model with a recording attention function.

`record_attention_calls(model, input_ids)` runs `model(input_ids [1, N], position_ids, use_cache=False,
paged_ctx=<recorder>)` with every attention config pointed at `PROBE_ATTENTION_NAME`, registered in transformers'
`AttentionInterface` and (so the model builds its masks for it) in its mask interface, with the causal-skip
shortcut disabled. Each call of the function is recorded: which module, the key / value shapes and dtypes, the
autocast state the call runs under (inside the model's own `forward`, so an autocast wrapper on `forward` counts),
whether the `paged_ctx` kwarg reached it, the other kwargs, and the boolean mask the model built for that layer. The function
computes ordinary masked attention from the model's own mask, so the forward proceeds as usual. `support.py` turns
the record into a verdict.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from trl_infinite.engine.attention import attention_implementation
from trl_infinite.engine.runner.autocast import autocast_dtype

PROBE_ATTENTION_NAME = "trl_infinite_probe"


@dataclass
class AttentionCall:
    """One call of the attention function during the probe forward."""

    module: torch.nn.Module
    query_heads: int
    key_shape: tuple[int, ...]  # [1, Hkv, N, Dk]
    value_shape: tuple[int, ...]  # [1, Hkv, N, Dv]
    got_context: bool  # the `paged_ctx` kwarg reached the attention function
    kwargs: dict  # the other kwargs with a value (None dropped)
    mask: torch.Tensor | None  # [N, N] bool (query x key) as the model built it, None if it passed none
    mask_per_head: bool = False  # the model's mask differs between heads or batch rows
    key_dtype: torch.dtype = torch.float32
    value_dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None  # autocast's dtype during the call (None: off)

    @property
    def layer_idx(self) -> int | None:
        idx = getattr(self.module, "layer_idx", None)
        return idx if isinstance(idx, int) and not isinstance(idx, bool) else None


@dataclass
class ProbeRecord:
    """Everything the probe forward showed; `error` holds the exception if the forward itself failed."""

    num_tokens: int
    calls: list[AttentionCall] = field(default_factory=list)
    error: BaseException | None = None


# the record of the probe forward in progress, for this thread / context only (kwargs may not reach the function);
# set for the forward and reset after it, so nothing is left behind
_ACTIVE: ContextVar[ProbeRecord] = ContextVar("trl_infinite_probe_record")


def _as_bool_mask(mask: torch.Tensor | None, num_tokens: int) -> tuple[torch.Tensor | None, bool]:
    """[N, N] bool mask from the model's 4D mask (bool, or additive float with 0 / very negative entries)."""
    if mask is None:
        return None, False
    if mask.dtype != torch.bool:
        finite_zero = mask == 0
        very_negative = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((finite_zero | very_negative).all()):  # an additive bias (ALiBi, relative positions, ...)
            return mask.new_zeros((num_tokens, num_tokens), dtype=torch.bool), True
        mask = finite_zero
    mask = mask.reshape(-1, *mask.shape[-2:])[..., -num_tokens:, -num_tokens:]  # [B*H, N, N]
    return mask[0], bool((mask != mask[:1]).any())


def _probe_attention(module, query, key, value, attention_mask, paged_ctx=None, **kwargs):
    """Records the call, then plain masked attention with the model's own mask: ([1, N, H, Dv], None)."""
    record = _ACTIVE.get()
    num = query.shape[2]
    mask, per_head = _as_bool_mask(attention_mask, key.shape[2])
    record.calls.append(AttentionCall(
        module=module, query_heads=query.shape[1], key_shape=tuple(key.shape), value_shape=tuple(value.shape),
        got_context=paged_ctx is record, kwargs={k: v for k, v in kwargs.items() if v is not None},
        mask=mask, mask_per_head=per_head, key_dtype=key.dtype, value_dtype=value.dtype,
        autocast=autocast_dtype(query.device.type),
    ))
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads == 0:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    else:  # an odd layout: the verdict refuses it; keep the forward going with one KV head per query head
        key = key[:, :1].expand(-1, heads, -1, -1)
        value = value[:, :1].expand(-1, heads, -1, -1)
    causal = torch.ones(num, key.shape[2], dtype=torch.bool, device=query.device).tril(key.shape[2] - num)
    out = F.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype),
                                         attn_mask=mask if mask is not None else causal)
    return out.transpose(1, 2).contiguous(), None


def _probe_mask(*args, **kwargs):
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})


AttentionInterface.register(PROBE_ATTENTION_NAME, _probe_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_ATTENTION_NAME, functools.wraps(sdpa_mask)(_probe_mask))


def probe_tokens(vocab_size: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Fixed pseudo-random token ids [1, N] (the same on every call)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=gen).to(device)


@torch.no_grad()
def record_attention_calls(model: torch.nn.Module, input_ids: torch.Tensor) -> ProbeRecord:
    """One forward of `input_ids` ([1, N]) through the recording attention function."""
    record = ProbeRecord(num_tokens=input_ids.shape[1])
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    token = _ACTIVE.set(record)
    try:
        with attention_implementation(model, PROBE_ATTENTION_NAME):
            model(input_ids=input_ids, position_ids=positions, use_cache=False, paged_ctx=record, logits_to_keep=1)
    except Exception as exc:  # noqa: BLE001  (the verdict reports it, naming the model)
        record.error = exc
    finally:
        _ACTIVE.reset(token)
    return record
