"""`trl_infinite.testing.routing.kwargs_reach_attention`: the engine's precondition, probed without the engine."""

from __future__ import annotations

import torch
from _models import tiny_model

from trl_infinite.testing.routing import kwargs_reach_attention


def test_a_model_that_routes_its_kwargs_is_seen_routing_them():
    model = tiny_model("qwen3")
    assert kwargs_reach_attention(model)
    assert model.config._attn_implementation == "sdpa"  # restored after the probe


def test_a_forward_that_keeps_its_kwargs_is_seen_not_routing_them():
    """A causal-LM `forward` that calls its backbone without the kwargs (what transformers 5.0's GPT-2 does), and one
    that takes no kwargs at all."""
    model = tiny_model("qwen3")
    inner = type(model).forward

    def keeps(self, input_ids=None, attention_mask=None, use_cache=None, **kwargs):
        return inner(self, input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)

    def takes_none(self, input_ids=None, attention_mask=None, use_cache=None):
        return inner(self, input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)

    for forward in (keeps, takes_none):
        model.forward = forward.__get__(model)
        assert not kwargs_reach_attention(model)


def test_a_layer_whose_attention_skips_the_interface_is_seen():
    """One layer of two computing attention itself: not every layer is reached."""
    model = tiny_model("qwen3", num_hidden_layers=2)
    attn = model.model.layers[1].self_attn

    def own(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return torch.zeros_like(hidden_states), None

    attn.forward = own
    assert not kwargs_reach_attention(model)
