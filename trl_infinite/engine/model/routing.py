"""The routing verdict of the support contract (`support.check_support`, step 2), and the types it shares.

`verdict(model, record)` turns the routing probe's record (`probe.record_attention_calls`: every call of
transformers' `AttentionInterface` in one forward) into the engine's layout of the model, or refuses it naming the
first problem: a forward that failed or never called the interface, kwargs that do not reach the attention function,
a module calling it twice, shared K/V heads that do not divide the query heads, attention features the engine does
not implement (position biases, sparse indices, non-causal attention, dropout), a decoder layer that runs no
attention (a mixer whose state the engine would not keep), or a mask other than the causal / sliding-window / chunked
pattern of the layer's spec. It returns the `ModelSupport`: the pool layout (`KVLayout`), one `LayerSpec` per
`layer_idx`, the K/V dtype and the autocast state seen inside the attention calls.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch

from trl_infinite.engine.attention import LayerSpec, allowed
from trl_infinite.engine.config.inputs import text_config
from trl_infinite.engine.decode.output_capture import capturing_models
from trl_infinite.engine.model.probe import AttentionCall, ProbeRecord
from trl_infinite.engine.runner.autocast import describe
from trl_infinite.engine.runner.kv_layout import KVLayout

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
STATELESS_LAYER_TYPES = ("mlp", "moe")
# kwargs of the attention call the engine implements, and those that carry no attention semantics
HANDLED_KWARGS = ("scaling", "dropout", "sliding_window", "softcap", "s_aux")
NEUTRAL_KWARGS = ("position_ids", "use_cache", "output_attentions", "output_router_logits", "output_hidden_states",
                  "return_dict", "cache_position", "logits_to_keep", "is_causal")
KWARG_FEATURES = {
    "position_bias": "an additive position bias (relative positions or ALiBi)",
    "indices": "sparse indexed attention (top-k key selection)",
    "sinks": "attention sinks passed as `sinks`",
    "head_mask": "a head mask",
}


@dataclass(frozen=True)
class ModelSupport:
    """What the contract found: the pool layout and one `LayerSpec` per attention `layer_idx`; the dtype the pool
    stores K/V in (`kv_dtype`: the dtype the model's attention consumes them in, the autocast dtype under autocast);
    the dtype its logits are computed in (`compute_dtype`: the autocast dtype, else the parameters', which sets the
    exactness tolerance); the autocast dtype its forward runs under (None: off); whether decode attention runs
    through the C++ CPU kernel (built and checked exact on this model); the models a forward asking for hidden
    states installs transformers' capturing hooks from (`output_capture.capturing_models`); the attention backend
    the checks passed on (`attention_backend`: "auto" resolved, see `support.check_support`; None: the one asked)."""

    kv: KVLayout
    layers: dict[int, LayerSpec]
    kv_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    decode_kernel: bool = False
    capture_models: tuple[torch.nn.Module, ...] = ()
    attention_backend: str | None = None


def model_name(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    return f"`{getattr(config, 'model_type', '?')}` ({type(model).__name__})"


class UnsupportedModelError(ValueError):
    """The engine cannot run this model exactly (the message names the model type and the feature; `feature` is
    the reason alone, for callers that run the same checks for another purpose)."""

    def __init__(self, message: str, feature: str = ""):
        super().__init__(message)
        self.feature = feature or message


def refusal(model: torch.nn.Module, feature: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"The rollout engine cannot run {model_name(model)} exactly: {feature}. Generate with vLLM instead "
        f"(`use_vllm=True` in the trainer) or with `model.generate`.", feature,
    )


def verdict(model: torch.nn.Module, record: ProbeRecord) -> ModelSupport:
    """The layout of a model whose probe forward routed cleanly; `ValueError` naming the first problem otherwise."""
    if record.error is not None:
        err = record.error
        raise refusal(model, f"running it through the engine's attention interface failed "
                      f"({type(err).__name__}: {str(err)[:200]})") from err
    if not record.calls:
        raise refusal(model, "it computes attention inside its own modules instead of calling transformers' "
                      "`AttentionInterface`, so the paged KV cache never reaches it")
    calls = record.calls
    _check_calls(model, calls)
    _check_kwargs(model, calls)
    _check_coverage(model, calls)
    ordered = sorted(calls, key=lambda c: c.layer_idx)
    specs = {c.layer_idx: _layer_spec(model, c, i, record.num_tokens) for i, c in enumerate(ordered)}
    kv = KVLayout(tuple(c.key_shape[1] for c in ordered), tuple(c.key_shape[3] for c in ordered),
                  tuple(c.value_shape[3] for c in ordered))
    kv_dtype, autocast = _dtypes(model, calls)
    param_dtype = next(model.parameters()).dtype
    return ModelSupport(kv=kv, layers=specs, kv_dtype=kv_dtype, compute_dtype=autocast or param_dtype,
                        autocast=autocast, capture_models=capturing_models(model, (c.module for c in calls)))


def _dtypes(model, calls: list[AttentionCall]) -> tuple[torch.dtype, torch.dtype | None]:
    """(pool dtype, autocast dtype or None). Under autocast the model's attention (SDPA, matmul: ops on autocast's
    list) consumes K and V in the autocast dtype whatever dtype they arrive in (float32 after a float32 norm or
    RoPE table), so the pool stores them in it, losing nothing the model's own attention keeps. Without autocast,
    the dtype K and V arrive in (the wider of the two)."""
    states = {c.autocast for c in calls}
    if len(states) > 1:
        found = ", ".join(sorted(describe(s) for s in states))
        raise refusal(model, f"its attention layers run under different autocast states ({found}); the engine keeps "
                      "one KV pool dtype for all layers")
    autocast = states.pop()
    if autocast is not None:
        return autocast, autocast
    return functools.reduce(torch.promote_types, (d for c in calls for d in (c.key_dtype, c.value_dtype))), None


def _check_calls(model, calls: list[AttentionCall]) -> None:
    lost = sorted({type(c.module).__name__ for c in calls if not c.got_context})
    if lost:
        raise refusal(model, f"its layers do not pass the attention kwargs on to the attention function ({lost[0]} "
                      "receives no `paged_ctx`), so the paged KV cache never reaches it")
    per_module = Counter(id(c.module) for c in calls)
    twice = [c for c in calls if per_module[id(c.module)] > 1]
    if twice:
        raise refusal(model, f"{type(twice[0].module).__name__} calls the attention function "
                      f"{per_module[id(twice[0].module)]} times per forward (e.g. differential attention); the engine "
                      "caches one key/value per layer and call")
    idx = [c.layer_idx for c in calls]
    if None in idx or len(set(idx)) != len(idx):
        raise refusal(model, "its attention modules do not carry a unique integer `layer_idx`")
    for c in calls:
        kv_heads, v_heads = c.key_shape[1], c.value_shape[1]
        if kv_heads != v_heads or c.query_heads % kv_heads:
            raise refusal(model, f"layer {c.layer_idx} has {c.query_heads} query heads for {kv_heads} key and "
                          f"{v_heads} value heads (query heads must be a multiple of the shared K/V heads)")


def _check_kwargs(model, calls: list[AttentionCall]) -> None:
    for c in calls:
        unknown = [k for k in c.kwargs if k not in HANDLED_KWARGS + NEUTRAL_KWARGS]
        if unknown:
            what = "; ".join(f"`{k}`: {KWARG_FEATURES.get(k, 'an attention argument it does not implement')}"
                             for k in unknown)
            raise refusal(model, f"layer {c.layer_idx} passes attention features the engine does not implement ({what})")
        if c.kwargs.get("is_causal", True) is False:
            raise refusal(model, f"layer {c.layer_idx} uses non-causal (bidirectional) attention")
        if c.kwargs.get("dropout", 0.0):
            raise refusal(model, f"layer {c.layer_idx} applies attention dropout in eval mode")


def _decoder_layers(model, num_layers: int, called: set[int]):
    """The ModuleList of `num_layers` decoder layers: of the lists of that length, the one holding most of the
    modules that called attention (None if no list holds any)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    hits = [sum(1 for sub in m.modules() if id(sub) in called) for m in lists]
    return lists[hits.index(max(hits))] if hits and max(hits) > 0 else None


def _check_coverage(model, calls: list[AttentionCall]) -> None:
    """Every decoder layer holds a module that called attention (or is a stateless MLP / MoE layer by config)."""
    cfg = text_config(model)
    num_layers = getattr(cfg, "num_hidden_layers", None)
    called = {id(c.module) for c in calls}
    layers = _decoder_layers(model, num_layers, called) if isinstance(num_layers, int) else None
    if layers is None:
        return
    layer_types = getattr(cfg, "layer_types", None)
    layer_types = list(layer_types) if isinstance(layer_types, (list, tuple)) else []
    layer_types += [None] * (num_layers - len(layer_types))
    bare = [i for i, layer in enumerate(layers)
            if not any(id(m) in called for m in layer.modules()) and layer_types[i] not in STATELESS_LAYER_TYPES]
    if bare:
        held = sorted({type(m).__name__ for m in layers[bare[0]].children() if any(True for _ in m.parameters())})
        raise refusal(model, f"decoder layers {bare[:6]} run no attention through `AttentionInterface` (layer "
                      f"{bare[0]} holds {', '.join(held)}): a mixer whose state the engine does not cache")


def _window_candidates(cfg, call: AttentionCall, kind: str | None, has_types: bool) -> list[int | None]:
    """Possible sliding windows of a layer, most likely first: the kwarg the model passes; else the config's window
    where `layer_types` says sliding; else (no `layer_types`) the config's window, which some models put in the mask
    only (PhiMoE), or none. The mask check below keeps the first candidate the probe's mask agrees with."""
    window = call.kwargs.get("sliding_window")
    if window is not None:
        return [window]
    config_window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False or not config_window:
        return [None]
    if has_types:
        return [config_window if kind == "sliding_attention" else None]
    return [config_window, None]


def _layer_spec(model, call: AttentionCall, pool_index: int, num_tokens: int) -> LayerSpec:
    """The layer's mask pattern, checked against the mask the model built on the probe sequence."""
    cfg = text_config(model)
    layer_types = getattr(cfg, "layer_types", None)
    has_types = isinstance(layer_types, (list, tuple))
    kind = layer_types[call.layer_idx] if has_types and call.layer_idx < len(layer_types) else None
    chunk = getattr(cfg, "attention_chunk_size", None) if kind == "chunked_attention" else None
    if call.mask_per_head:
        raise refusal(model, f"the attention mask of layer {call.layer_idx} carries an additive bias or differs "
                      "between heads")
    pos = torch.arange(num_tokens)
    got = call.mask.cpu() if call.mask is not None else pos[None, :] <= pos[:, None]
    needs_scores = any(k in call.kwargs for k in ("softcap", "s_aux"))
    candidates = [LayerSpec(pool_index, w or None, chunk or None, needs_scores)
                  for w in _window_candidates(cfg, call, kind, has_types)]
    for spec in candidates:
        if got.shape == (num_tokens, num_tokens) and torch.equal(got, allowed(pos[:, None], pos[None, :],
                                                                              spec.sliding_window, spec.chunk_size)):
            return spec
    spec = candidates[0]
    pattern = "causal" + (f", sliding window {spec.sliding_window}" if spec.sliding_window else "") + \
        (f", chunks of {spec.chunk_size}" if spec.chunk_size else "")
    raise refusal(model, f"the attention mask of layer {call.layer_idx} is not the {pattern} pattern the engine "
                  "implements")
