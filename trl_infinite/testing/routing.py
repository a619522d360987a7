"""Whether the installed transformers routes a model's attention through its `AttentionInterface` with the kwargs of
the model's own `forward`: the precondition of the engine's serving a model type (it hands each attention call its
paged context as such a kwarg). Some types route on one release and not on another (on transformers 5.0,
`GPT2LMHeadModel` and `GPTBigCodeForCausalLM` keep their `forward`'s kwargs for the loss, and GPT-J computes
attention inside its own module; transformers 5.24 routes all three), so a test that requires a type served asks this
first. Independent of the engine's own routing probe: a recording function that only counts the calls the marker
reaches, nothing else of the engine's contract.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from trl_infinite.engine.attention import attention_implementation

_NAME = "trl_infinite_testing_routing"
_MARKER = "trl_infinite_routing_marker"
_seen: list[bool] = []


def _recording(module, query, key, value, attention_mask, **kwargs):
    """Records whether the marker arrived, then plain attention under the model's mask (what it computes does not
    matter here; the model's other kwargs, soft-caps, sinks, scales, are ignored)."""
    _seen.append(kwargs.get(_MARKER) is True)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    mask = attention_mask[..., -key.shape[2]:] if attention_mask is not None else None
    out = F.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask,
                                         is_causal=mask is None and query.shape[2] > 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(_NAME, _recording)
ALL_MASK_ATTENTION_FUNCTIONS.register(_NAME, sdpa_mask)


@torch.no_grad()
def kwargs_reach_attention(model: torch.nn.Module, num_tokens: int = 6) -> bool:
    """A kwarg given to `model(...)` reaches an `AttentionInterface` call of every decoder layer of `model` (one
    short forward; the model's attention implementation restored after)."""
    layers = int(getattr(model.config.get_text_config(), "num_hidden_layers", 1))
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(num_tokens, device=next(model.parameters()).device)[None] % vocab
    _seen.clear()
    try:
        with attention_implementation(model, _NAME):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **{_MARKER: True})
    except TypeError as exc:  # a forward without `**kwargs` refuses the marker
        if _MARKER not in str(exc):
            raise
        return False
    return len(_seen) >= layers and all(_seen)
