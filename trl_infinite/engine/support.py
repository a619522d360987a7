"""The support contract: a model the engine cannot run exactly is refused up front, naming what is missing.

`check_support(model, attention_backend)` runs once when a `RolloutEngine` is built, with the model in eval mode:

1. structure: every entry of the config's `layer_types` is an attention type the engine implements (or a stateless
   MLP / MoE layer), and no module is a recurrent, convolutional or linear-attention mixer (their state between
   forwards is not kept by a KV cache);
2. routing (`probe.py`): one short forward with a recording attention function shows that every attention module
   routes through transformers' `AttentionInterface`, exactly once per forward, with a unique `layer_idx` and the
   `paged_ctx` kwarg reaching it; that every decoder layer has such a module; that every kwarg the model passes is
   one the engine implements (scale, sliding window, soft-cap, sinks); that the mask the model builds for each layer
   is the causal / sliding-window / chunked pattern the engine reproduces. The K / V shapes seen give the pool's
   per-layer widths (`KVLayout`: MQA, GQA, MLA's K wider than V), and the dtypes and autocast state seen inside the
   forward give the pool's dtype (`ModelSupport.kv_dtype`: the autocast dtype under autocast, see `autocast.py`);
3. exactness (`exactness.py`): a prompt prefilled into a small pool and three tokens decoded one at a time through
   the selected attention backend give the logits of the model's own forward.

Before the probe, a rotary embedding whose rotation of a position depends on the forward's other positions is
refused (`rope_length.py`: dynamic NTK, `longrope`). For a model that computes in a 16-bit dtype (bf16 / fp16
weights, or autocast), the structural decision is made in float32 first: checks 2 and 3 on the float32 model of
`replica.float32_reference` (its own weights with autocast off, a float32 copy, or a replica from its config) at the
float32 tolerance; then check 3 on the run itself against the bound derived from its own rounding noise
(`exactness.rounding_bound`). So a model is served or refused alike in every dtype. A model whose own forward fails
in the run's dtype is refused saying so.

Any failure raises `ValueError` naming the model type, the unsupported feature and what to use instead. Only then,
and only where it would serve a layer (CPU, torch backend, float32 pool, head dims of its vector width), the C++
decode kernel is built (`attention/cpu_decode.py`, half a minute once per machine) and the exactness check is run
again through it (`ModelSupport.decode_kernel`); a kernel that fails it is left out with a warning (the torch path
already passed).
"""

from __future__ import annotations

import copy
import functools
import logging
import re
from collections import Counter
from dataclasses import dataclass, replace

import torch

from .attention import LayerSpec, allowed, cpu_decode
from .autocast import autocast_dtype, describe
from .eval_mode import eval_mode
from .exactness import DECODE_TOKENS, exactness_problem
from .inputs import model_vocab_size
from .kv_pool import KVLayout
from .model_runner import decode_kernel_serves
from .output_capture import capturing_models
from .probe import AttentionCall, ProbeRecord, probe_tokens, record_attention_calls
from .replica import Float32ReferenceError, float32_reference
from .rope_length import length_dependent_rope

logger = logging.getLogger(__name__)

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
# class names of recurrent / convolutional / linear-attention mixers (state carried between tokens outside any KV)
STATEFUL_MODULE = re.compile(r"Mamba|Mixer|SSM|Rwkv(SelfAttention|FeedForward)|DeltaNet|LinearAttention"
                             r"|LightningAttention|ShortConv|Recurrent|Rglru|RgLru|LSTM|Lstm")
PROBE_TOKENS = 24  # shortest probe sequence
MAX_PROBE_TOKENS = 512  # the probe grows to show a window / chunk of the config up to this length


@dataclass(frozen=True)
class ModelSupport:
    """What the contract found: the pool layout and one `LayerSpec` per attention `layer_idx`; the dtype the pool
    stores K/V in (`kv_dtype`: the dtype the model's attention consumes them in, the autocast dtype under autocast);
    the dtype its logits are computed in (`compute_dtype`: the autocast dtype, else the parameters', which sets the
    exactness tolerance); the autocast dtype its forward runs under (None: off); whether decode attention runs
    through the C++ CPU kernel (built and checked exact on this model); the models a forward asking for hidden
    states installs transformers' capturing hooks from (`output_capture.capturing_models`)."""

    kv: KVLayout
    layers: dict[int, LayerSpec]
    kv_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    decode_kernel: bool = False
    capture_models: tuple[torch.nn.Module, ...] = ()


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


def text_config(model: torch.nn.Module):
    try:
        return model.config.get_text_config()
    except (AttributeError, ValueError):
        return model.config


def check_support(model: torch.nn.Module, attention_backend: str = "torch", cpu_decode_kernel: bool = False
                  ) -> ModelSupport:
    """Run the checks of the module docstring under the caller's autocast state; return what they found or raise
    `ValueError`. `cpu_decode_kernel`: use the C++ decode kernel where it serves, built only after the checks
    passed and checked exact itself (`ModelSupport.decode_kernel`)."""
    with eval_mode(model):
        check_structure(model)
        rope = length_dependent_rope(model, text_config(model))
        if rope is not None:
            raise refusal(model, rope)
        param = next(model.parameters())
        ids = probe_tokens(model_vocab_size(model), probe_length(model), param.device)
        support = _verdict_or_own_failure(model, ids)
        noise = None
        if support.compute_dtype not in (torch.float32, torch.float64):
            noise = _float32_decision(model, attention_backend, ids, forces_autocast=support.autocast is not None
                                      and autocast_dtype(param.device.type) is None)
        problem = exactness_problem(model, support, attention_backend, ids, float32_noise=noise)
        if problem is not None:
            raise refusal(model, problem)
        if cpu_decode_kernel and decode_kernel_serves(param.device, attention_backend, support.layers, support.kv,
                                                      support.kv_dtype):
            support = replace(support, decode_kernel=_kernel_checked(model, support, attention_backend, ids))
    return support


def _verdict_or_own_failure(model: torch.nn.Module, ids: torch.Tensor) -> ModelSupport:
    """`verdict` of the routing probe; where the probe forward failed and the model's own forward fails the same
    way in this setting (a model that cannot run under this autocast / dtype at all), the refusal says so."""
    record = record_attention_calls(model, ids)
    if record.error is not None:
        try:
            model(input_ids=ids, use_cache=False)
        except Exception as exc:  # noqa: BLE001
            state = describe(autocast_dtype(ids.device.type))
            weights = str(next(model.parameters()).dtype).removeprefix("torch.")
            raise refusal(model, f"its own forward fails {state} with {weights} weights "
                          f"({type(exc).__name__}: {str(exc)[:200]}), so there is nothing to reproduce") from exc
    return verdict(model, record)


def _float32_decision(model: torch.nn.Module, attention_backend: str, ids: torch.Tensor, forces_autocast: bool
                      ) -> float:
    """The structural decision for a model that runs in a 16-bit dtype, made in float32 (`replica.py`): the routing
    and exactness checks, without autocast, on the float32 model `float32_reference` gives, at the float32
    tolerance. Raises the refusal naming what failed and what it was checked on. Returns the 16-bit noise for the
    run's bound (`exactness.rounding_bound`): the relative distance of the model's forward in the run's setting from
    the float32 one (on a replica: the replica's, in the run's dtype and autocast state)."""
    try:
        ref, how = float32_reference(model, forces_autocast)
    except Float32ReferenceError as err:
        raise refusal(model, f"its structure cannot be checked in float32 ({err}); run it with float32 weights "
                      "(under autocast if wanted: those are checked directly)") from err
    device = next(ref.parameters()).device
    backend = attention_backend if ref is model else "torch"
    with torch.autocast(device.type, enabled=False), eval_mode(ref), torch.no_grad():
        try:
            if ref is not model:
                check_structure(ref)
            ref_ids = probe_tokens(model_vocab_size(ref), probe_length(ref), device)
            support = verdict(ref, record_attention_calls(ref, ref_ids))
            if support.autocast is not None and ref is model:  # its forward turns autocast on by itself
                return _float32_decision(model, attention_backend, ids, forces_autocast=True)
            problem = exactness_problem(ref, support, backend, ref_ids)
        except UnsupportedModelError as err:
            raise refusal(model, f"{err.feature} (checked in float32 on {how})") from err
        if problem is not None:
            raise refusal(model, f"in float32 (checked on {how}): {problem}")
        rows = DECODE_TOKENS + 1
        exact = ref(input_ids=ref_ids, use_cache=False).logits[0, -rows:].float()
    same_weights = not how.startswith("a float32 replica")
    run = model if same_weights else copy.deepcopy(ref).to(next(model.parameters()).dtype)
    run_ids = ids if same_weights else ref_ids
    with torch.no_grad(), eval_mode(run):
        got = run(input_ids=run_ids, use_cache=False).logits[0, -rows:].float().to(exact.device)
    return ((got - exact).abs().max() / exact.abs().max().clamp_min(1e-6)).item()


def _kernel_checked(model, support: ModelSupport, attention_backend: str, ids: torch.Tensor) -> bool:
    """Build the C++ decode kernel (once per machine) and run the exactness check through it: False, with a warning,
    when it cannot be built or does not reproduce the model (decode then takes the torch path, checked already)."""
    if not cpu_decode.build():
        return False
    problem = exactness_problem(model, support, attention_backend, ids, cpu_decode_kernel=True)
    if problem is not None:
        logger.warning("The CPU decode-attention kernel does not reproduce %s (%s); its decode steps use the torch "
                       "attention path.", model_name(model), problem)
        return False
    return True


def probe_length(model: torch.nn.Module) -> int:
    """Probe tokens: enough to see past the config's sliding window and attention chunk (2 more than the larger),
    between PROBE_TOKENS and MAX_PROBE_TOKENS. Longer windows are taken from the config and kwargs unverified."""
    cfg = text_config(model)
    sizes = [getattr(cfg, k, None) for k in ("sliding_window", "attention_chunk_size")]
    sizes = [n + 2 for n in sizes if isinstance(n, int) and not isinstance(n, bool) and 0 < n < MAX_PROBE_TOKENS - 1]
    return max([PROBE_TOKENS, *sizes])


# ---------------------------------------------------------------------------------------------------- 1. structure
def check_structure(model: torch.nn.Module) -> None:
    peft_config = getattr(model, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        kind = getattr(peft_config.peft_type, "value", peft_config.peft_type)
        raise refusal(model, f"PEFT prompt learning ({kind}) prepends virtual tokens the engine does not run")
    cfg = text_config(model)
    layer_types = getattr(cfg, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        odd = {t: [i for i, u in enumerate(layer_types) if u == t] for t in layer_types
               if t not in ATTENTION_LAYER_TYPES + STATELESS_LAYER_TYPES}
        if odd:
            kinds = ", ".join(f"{t!r} (layers {idx[:4]}{'...' if len(idx) > 4 else ''})" for t, idx in odd.items())
            raise refusal(model, f"its config has layer types {kinds}; the engine caches the keys and values of "
                          f"{list(ATTENTION_LAYER_TYPES)} layers only, not the state of recurrent, convolutional, "
                          "linear or sparse attention layers")
    mixers = sorted({type(m).__name__ for m in model.modules() if STATEFUL_MODULE.search(type(m).__name__)})
    if mixers:
        raise refusal(model, f"it has stateful non-attention mixers ({', '.join(mixers[:4])}) whose state between "
                      "forwards the engine does not keep")


# ---------------------------------------------------------------------------------------------------- 2. routing
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
    specs = {c.layer_idx: replace(_layer_spec(model, c, i, record.num_tokens),
                                  needs_scores=any(k in c.kwargs for k in ("softcap", "s_aux")))
             for i, c in enumerate(ordered)}
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
    best, best_hits = None, 0
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers:
            hits = sum(1 for sub in m.modules() if id(sub) in called)
            if hits > best_hits:
                best, best_hits = m, hits
    return best


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
    candidates = [LayerSpec(pool_index, w or None, chunk or None) for w in _window_candidates(cfg, call, kind, has_types)]
    for spec in candidates:
        if got.shape == (num_tokens, num_tokens) and torch.equal(got, allowed(pos[:, None], pos[None, :],
                                                                              spec.sliding_window, spec.chunk_size)):
            return spec
    spec = candidates[0]
    pattern = "causal" + (f", sliding window {spec.sliding_window}" if spec.sliding_window else "") + \
        (f", chunks of {spec.chunk_size}" if spec.chunk_size else "")
    raise refusal(model, f"the attention mask of layer {call.layer_idx} is not the {pattern} pattern the engine "
                  "implements")
