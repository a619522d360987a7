"""The support contract: a model the engine cannot run exactly is refused up front, naming what is missing.

`check_support(model, attention_backend)` runs once when a `RolloutEngine` is built, with the model in eval mode:

1. structure: every entry of the config's `layer_types` is an attention type the engine implements (or a stateless
   MLP / MoE layer), and no module is a recurrent, convolutional or linear-attention mixer (their state between
   forwards is not kept by a KV cache);
2. routing (`probe.py`, the verdict in `routing.py`): one short forward with a recording attention function shows that every attention module
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
import logging
import re
from dataclasses import replace

import torch

from trl_infinite.engine.attention import cpu_decode
from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.config.inputs import model_vocab_size, text_config
from trl_infinite.engine.model.exactness import DECODE_TOKENS, exactness_problem
from trl_infinite.engine.model.probe import probe_tokens, record_attention_calls
from trl_infinite.engine.model.replica import Float32ReferenceError, float32_reference
from trl_infinite.engine.model.rope_length import length_dependent_rope
from trl_infinite.engine.model.routing import (  # (also imported from here: the contract's types and verdict)
    ATTENTION_LAYER_TYPES,
    STATELESS_LAYER_TYPES,
    ModelSupport,
    UnsupportedModelError,
    model_name,
    refusal,
    verdict,
)
from trl_infinite.engine.runner.autocast import autocast_dtype, describe
from trl_infinite.engine.runner.eval_mode import eval_mode
from trl_infinite.engine.runner.kv_pool import KVCachePool
from trl_infinite.engine.runner.model_runner import ModelRunner, decode_kernel_serves

logger = logging.getLogger(__name__)

# class names of recurrent / convolutional / linear-attention mixers (state carried between tokens outside any KV)
STATEFUL_MODULE = re.compile(r"Mamba|Mixer|SSM|Rwkv(SelfAttention|FeedForward)|DeltaNet|LinearAttention"
                             r"|LightningAttention|ShortConv|Recurrent|Rglru|RgLru|LSTM|Lstm")
PROBE_TOKENS = 24  # shortest probe sequence
MAX_PROBE_TOKENS = 512  # the probe grows to show a window / chunk of the config up to this length


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
        if problem is not None and _auto_is_triton(attention_backend, param.device):
            # "auto" asked for the fastest exact backend: the torch reference where the Triton kernels are not exact
            fallback = exactness_problem(model, support, "torch", ids, float32_noise=noise)
            if fallback is None:
                logger.warning("attention_backend='auto': the Triton decode kernels do not run %s exactly (%s); the "
                               "torch backend does, and runs it.", model_name(model), problem)
                attention_backend, problem = "torch", None
                support = replace(support, attention_backend="torch")
        if problem is not None:
            raise refusal(model, problem)
        if cpu_decode_kernel and decode_kernel_serves(param.device, attention_backend, support.layers, support.kv,
                                                      support.kv_dtype):
            support = replace(support, decode_kernel=_kernel_checked(model, support, attention_backend, ids))
    return support


def build_runner(model: torch.nn.Module, config: EngineConfig, support: ModelSupport | None = None,
                 **pool_options) -> ModelRunner:
    """Support check -> KV pool -> model runner, for the engine's model and a draft model alike: `support` where the
    model was checked already (else `check_support` with `config`'s attention settings); `pool_options`:
    `KVCachePool`'s. The pool is the runner's `pool`."""
    decode = config.decode
    if support is None:
        support = check_support(model, decode.attention_backend, decode.cpu_decode_kernel)
    pool = KVCachePool(support.kv, config, dtype=support.kv_dtype, device=next(model.parameters()).device,
                       **pool_options)
    return ModelRunner(model, pool, support.attention_backend or decode.attention_backend, support.layers,
                       cpu_decode_kernel=support.decode_kernel, capture_models=support.capture_models,
                       autocast=support.autocast)


def _auto_is_triton(attention_backend: str, device: torch.device) -> bool:
    if attention_backend != "auto":
        return False
    from trl_infinite.engine.attention.backends import ATTENTION_BACKENDS, resolve_backend

    try:
        return resolve_backend("auto", device) is ATTENTION_BACKENDS.get_or_raise("triton")
    except ImportError:
        return False


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
