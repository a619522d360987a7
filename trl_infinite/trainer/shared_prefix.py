"""The shared-prefix training forward: each group's prompt encoded once in the loss's forward and backward.

`SharedPrefixForward.install(model, ...)` checks that the model can be run this way exactly (the support contract
below) and, if so, wraps the causal LM's `forward` (the module TRL gave its fused LM head) so that
`model(prefix_groups=GroupedContext(...))` runs the backbone over the packed batch of `packing.py` with the grouped
attention of `grouped_attention.py` and returns TRL's `FusedCausalLMOutput` with `[B, C]` log-probs and entropies in
TRL's row layout (zero where the completion is masked, as TRL's fused head gives). Any other call runs the previous
`forward` unchanged. Calling through the outer module keeps DDP's / FSDP's / DeepSpeed's forward hooks in place.

The contract, checked once with the model in training mode and under the trainer's autocast:
1. structure: the engine's check (no recurrent / convolutional / linear-attention mixers, layer types it knows), a
   text-only model whose attention implementation is one the dispatcher stands in for (`sdpa`, `eager`);
2. routing: the engine's routing probe (`engine/model/probe.py`): every attention module calls transformers'
   `AttentionInterface` once per forward with the kwargs reaching it and a causal / sliding-window / chunked mask;
3. determinism: two identical training forwards agree (dropout or router noise would draw one mask for the G rows'
   shared prompt where TRL draws G);
4. exactness: the packed forward of a probe batch (two groups, left-padded prompts, ragged completions, a prompt
   longer than the sliding window, padding that is not a multiple of an attention chunk) gives the log-probs and
   entropies of the model's own padded forward.
A model that fails is trained with TRL's forward; the trainer's warning names the reason.

The decision is made in float32 whatever dtype the run uses, so that a 16-bit run is not accepted by the looser
bound of its own comparison (OPT, whose positions come from the attention mask, was 8% off under bf16 autocast and
accepted by a fixed 5e-2 tolerance). For a run in a 16-bit dtype (16-bit weights, or float32 weights under the
trainer's autocast) the whole contract is first checked, without autocast and at the float32 tolerance
(`FLOAT32_TOLERANCE`), on the float32 model the engine's `replica.float32_reference` gives (the model itself with
autocast off, a float32 copy, or a float32 replica built from its config); then the run's own check is held to a
bound derived as the engine's `exactness.rounding_bound`: `NOISE_MULTIPLE` x the distance of the padded forward's
16-bit log-probs from its float32 ones on the probe batch, within `FLOOR_ULPS` to `CAP_ULPS` units of the dtype.
"""

from __future__ import annotations

import functools
import types
import weakref
from contextlib import nullcontext

import torch
from trl.trainer.utils import FusedCausalLMOutput

from trl_infinite.engine.attention import LayerSpec, attention_configs, temperature_tuned
from trl_infinite.engine.config.inputs import model_vocab_size, text_config
from trl_infinite.engine.model.exactness import RoundingBound, is_16bit
from trl_infinite.engine.model.probe import probe_tokens, record_attention_calls
from trl_infinite.engine.model.support import UnsupportedModelError, check_structure, model_name, probe_length, verdict
from trl_infinite.engine.runner.eval_mode import eval_mode
from trl_infinite.trainer.grouped_attention import ORIGINALS, GroupedContext, grouped_name, original_of, packed_forward
from trl_infinite.trainer.logprobs import HeadSpec, selected_logprobs
from trl_infinite.trainer.packing import GroupedLayout, pack_rows
from trl_infinite.trainer.positions import length_dependent_rope
from trl_infinite.trainer.prefix_probe import (  # noqa: F401  (FLOAT32_TOLERANCE, SharedPrefixUnsupported: re-exported)
    FLOAT32_TOLERANCE,
    SharedPrefixUnsupported,
    float32_decision,
    padded_reference,
    probe_batch,
    run_dtype,
)


class SharedPrefixForward:
    """The shared-prefix forward installed on one causal LM (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, head: HeadSpec, layers: dict[int, LayerSpec]):
        self.model = model
        self.head = head
        self.layers = layers
        self._previous = model.forward
        self._hooks = _temperature_by_column(temperature_tuned(model))

    # ------------------------------------------------------------------ installation
    @classmethod
    def install(cls, model: torch.nn.Module, head: HeadSpec, autocast=None, outer: torch.nn.Module | None = None
                ) -> SharedPrefixForward:
        """Check the contract (raises `SharedPrefixUnsupported` naming the reason), then wrap `model.forward`.
        `outer`: the module the trainer calls (a PEFT model around `model`), checked for structure too."""
        autocast = autocast or nullcontext
        ids, layers = _structure(model, outer)
        dtype, forced = run_dtype(model, backbone(model), autocast, ids)
        bound = None
        if is_16bit(dtype):
            bound = float32_decision(model, head, autocast, dtype, forced, ids, outer, cls.install)
        forward = cls(model, head, layers)
        for c in attention_configs(model):
            if original_of(c._attn_implementation) is None:
                c._attn_implementation_internal = grouped_name(c._attn_implementation)
        model.forward = types.MethodType(forward._wrapped(), model)
        _INSTALLED[model] = forward
        try:
            with autocast():
                problem = forward.check(ids, bound)
        except Exception as exc:  # noqa: BLE001  (a failing probe forward is a refusal, named)
            problem = f"the packed forward failed ({type(exc).__name__}: {str(exc)[:200]})"
        except BaseException:  # interrupted: leave the model as it was
            forward.uninstall()
            raise
        if problem is not None:
            forward.uninstall()
            raise SharedPrefixUnsupported(problem)
        return forward

    def uninstall(self) -> None:
        """Give the model back its previous `forward` and attention implementation."""
        self.model.forward = self._previous
        for handle in self._hooks:
            handle.remove()
        for c in attention_configs(self.model):
            original = original_of(c._attn_implementation)
            if original is not None:
                c._attn_implementation_internal = original
        _INSTALLED.pop(self.model, None)

    def _wrapped(self):
        previous, run = self._previous, self._run

        @functools.wraps(type(self.model).forward)
        def forward(module, *args, prefix_groups: GroupedContext | None = None, **kwargs):
            if prefix_groups is None:
                return previous(*args, **kwargs)
            return run(module, prefix_groups)

        return forward

    # ------------------------------------------------------------------ the forward
    def context(self, layout: GroupedLayout, entropy: bool) -> GroupedContext:
        return GroupedContext(layout=layout, layers=self.layers, entropy=entropy)

    def _run(self, module: torch.nn.Module, ctx: GroupedContext) -> FusedCausalLMOutput:
        lay = ctx.layout
        with packed_forward():
            out = backbone(module)(input_ids=lay.input_ids, position_ids=lay.position_ids, use_cache=False,
                                   prefix_groups=ctx)
        hidden = out.last_hidden_state[0].index_select(0, lay.score_index)  # [M, hidden]
        logps, ent = selected_logprobs(hidden, module.get_output_embeddings(), lay.labels, self.head, ctx.entropy)
        B, C = lay.batch_shape
        index = (lay.out_rows, lay.out_cols)
        log_probs = logps.new_zeros(B, C).index_put(index, logps)
        entropy = ent.new_zeros(B, C).index_put(index, ent) if ent is not None else None
        mask = torch.zeros(B, C, dtype=torch.bool, device=logps.device).index_put(
            index, torch.ones_like(lay.labels, dtype=torch.bool))
        return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy, label_mask=mask)

    # ------------------------------------------------------------------ the exactness probe
    @torch.no_grad()
    def check(self, ids: torch.Tensor, bound: RoundingBound | None = None) -> str | None:
        """Steps 3 and 4 of the contract on a probe batch built from `ids` ([1, L]); None when both hold. `bound`:
        the 16-bit bound of a run in a 16-bit dtype (the module docstring); None: `FLOAT32_TOLERANCE`."""
        model = self.model
        was_training = model.training
        model.train()
        try:
            input_ids, mask, keep = probe_batch(ids[0], [s.chunk_size for s in self.layers.values()])
            ref = padded_reference(model, self._previous, input_ids, mask, keep, self.head)
            again = padded_reference(model, self._previous, input_ids, mask, keep, self.head)
            if not (torch.equal(ref[0], again[0]) and torch.equal(ref[1], again[1])):
                return ("its training forward is random (dropout or router noise): the packed forward would draw "
                        "one random mask for a group's shared prompt where TRL draws one per row; set "
                        "`disable_dropout=True` or turn the noise off")
            layout = pack_rows(input_ids, mask, keep)
            out = model(prefix_groups=self.context(layout, entropy=True))
        finally:
            model.train(was_training)
        valid = mask[:, -keep:].bool()
        scale = max(1.0, ref[0][valid].abs().max().item())
        err = max((out.log_probs - ref[0])[valid].abs().max().item(), (out.entropy - ref[1])[valid].abs().max().item())
        tol, why = (FLOAT32_TOLERANCE, f"{FLOAT32_TOLERANCE:.0e}") if bound is None else (bound.bound, bound.describe())
        if not err / scale <= tol:
            return (f"the packed forward does not reproduce the model's own padded forward (log-prob error "
                    f"{err / scale:.1e} > {why}, relative)")
        return None


def _structure(model: torch.nn.Module, outer: torch.nn.Module | None) -> tuple[torch.Tensor, dict[int, LayerSpec]]:
    """Steps 1 and 2 of the contract: (the probe tokens, the layer specs the routing probe found)."""
    originals = {c._attn_implementation for c in attention_configs(model)}
    if text_config(model) is not model.config:
        raise SharedPrefixUnsupported("it is not a text-only causal LM")
    rope = length_dependent_rope(model)
    if rope is not None:
        raise SharedPrefixUnsupported(
            f"its RoPE ({rope!r}) has frequencies that depend on the sequence length (the longest position of "
            "the forward), which in the packed forward is not the one of TRL's padded batch")
    odd = sorted(str(o) for o in originals if o not in ORIGINALS and original_of(o) is None)
    if odd:
        raise SharedPrefixUnsupported(f"its attention implementation {odd[0]!r} is not one of {list(ORIGINALS)}")
    head_module = model.get_output_embeddings()
    if type(head_module) is not torch.nn.Linear:
        raise SharedPrefixUnsupported(f"its LM head is a {type(head_module).__name__}, not a plain linear layer "
                                      "(e.g. an adapter on `lm_head`), whose weight alone is not the projection")
    try:
        check_structure(outer if outer is not None else model)
        ids = probe_tokens(model_vocab_size(model), probe_length(model), next(model.parameters()).device)
        backbone(model)
        with torch.no_grad(), eval_mode(model):  # attention dropout is the determinism check's to report
            layers = verdict(model, record_attention_calls(model, ids)).layers
    except UnsupportedModelError as err:
        raise SharedPrefixUnsupported(f"{model_name(model)}: {err.feature}") from err
    return ids, layers


def _temperature_by_column(modules: list[torch.nn.Module]) -> list:
    """Hooks on Llama 4's temperature-tuned NoPE attention modules (`engine.attention.temperature_tuned`): in a
    packed forward (a call carrying `prefix_groups`, gradient checkpointing's recomputation included) the module's
    own scaling, by the token's index in the forward, is off and the grouped attention applies the same expression
    from the token's column in TRL's batch (`position_ids`), which is the index TRL's padded forward scales by."""
    def before(module, args, kwargs):
        if kwargs.get("prefix_groups") is not None:
            module.attn_temperature_tuning, module.paged_temperature_tuning = False, True

    def after(module, args, kwargs, output):
        if kwargs.get("prefix_groups") is not None:
            module.attn_temperature_tuning, module.paged_temperature_tuning = True, False

    return [h for m in modules for h in (m.register_forward_pre_hook(before, with_kwargs=True),
                                         m.register_forward_hook(after, with_kwargs=True, always_call=True))]


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack under the LM head (hidden states out)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for candidate in (model.base_model, getattr(model, "model", None)):  # (Llama 4 names its prefix but not its stack)
        if decoder is None or decoder is model:
            decoder = candidate
    if decoder is None or decoder is model:
        raise SharedPrefixUnsupported(f"{type(model).__name__} exposes no decoder stack under its LM head")
    return decoder


_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # causal LM -> its SharedPrefixForward


def installed(model: torch.nn.Module) -> SharedPrefixForward | None:
    """The shared-prefix forward installed on `model` (the causal LM itself), if any."""
    return _INSTALLED.get(model)
