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
2. routing: the engine's routing probe (`engine/probe.py`): every attention module calls transformers'
   `AttentionInterface` once per forward with the kwargs reaching it and a causal / sliding-window / chunked mask;
3. determinism: two identical training forwards agree (dropout or router noise would draw one mask for the G rows'
   shared prompt where TRL draws G);
4. exactness: the packed forward of a probe batch (two groups, left-padded prompts, ragged completions, a prompt
   longer than the sliding window, padding that is not a multiple of an attention chunk) gives the log-probs and entropies of the model's own padded forward.
A model that fails is trained with TRL's forward; the trainer's warning names the reason.
"""

from __future__ import annotations

import functools
import types
import weakref
from contextlib import nullcontext

import torch
from trl.trainer.utils import FusedCausalLMOutput

from ..engine.attention import LayerSpec, attention_configs
from ..engine.eval_mode import eval_mode
from ..engine.inputs import model_vocab_size
from ..engine.probe import probe_tokens, record_attention_calls
from ..engine.support import UnsupportedModelError, check_structure, model_name, probe_length, verdict
from .grouped_attention import ORIGINALS, GroupedContext, grouped_name, original_of, packed_forward
from .logprobs import HeadSpec, selected_logprobs
from .packing import GroupedLayout, pack_rows
from .positions import length_dependent_rope


class SharedPrefixUnsupported(ValueError):
    """The shared-prefix forward cannot run this model exactly (the message says why)."""


def tolerance(dtype: torch.dtype) -> float:
    """Largest |log-prob difference| / max(1, max |log-prob|) accepted between the packed and the padded forward:
    float32 round-off (different reduction orders), or 16-bit noise."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


class SharedPrefixForward:
    """The shared-prefix forward installed on one causal LM (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, head: HeadSpec, layers: dict[int, LayerSpec]):
        self.model = model
        self.head = head
        self.layers = layers
        self._previous = model.forward
        self.index_limit = index_limit(model)

    # ------------------------------------------------------------------ installation
    @classmethod
    def install(cls, model: torch.nn.Module, head: HeadSpec, autocast=None, outer: torch.nn.Module | None = None
                ) -> SharedPrefixForward:
        """Check the contract (raises `SharedPrefixUnsupported` naming the reason), then wrap `model.forward`.
        `outer`: the module the trainer calls (a PEFT model around `model`), checked for structure too."""
        autocast = autocast or nullcontext
        originals = {c._attn_implementation for c in attention_configs(model)}
        if model.config.get_text_config() is not model.config:
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
        forward = cls(model, head, layers)
        for c in attention_configs(model):
            if original_of(c._attn_implementation) is None:
                c._attn_implementation_internal = grouped_name(c._attn_implementation)
        model.forward = types.MethodType(forward._wrapped(), model)
        _INSTALLED[model] = forward
        try:
            with autocast():
                problem = forward.check(ids)
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
    def fits(self, layout: GroupedLayout, width: int) -> bool:
        """Whether the packed forward computes TRL's function for this batch (`width`: TRL's `P + C`): always, but
        for a model that scales queries by the token's index in the forward (`index_limit`), only while both the
        packed index and TRL's column stay below the first index that scales (the scale is 1 for both there)."""
        limit = self.index_limit
        return limit is None or (layout.num_tokens < limit and width < limit)

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
    def check(self, ids: torch.Tensor) -> str | None:
        """Steps 3 and 4 of the contract on a probe batch built from `ids` ([1, L]); None when both hold."""
        model = self.model
        was_training = model.training
        model.train()
        try:
            input_ids, mask, keep = probe_batch(ids[0], [s.chunk_size for s in self.layers.values()])
            ref = _reference(model, self._previous, input_ids, mask, keep, self.head)
            again = _reference(model, self._previous, input_ids, mask, keep, self.head)
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
        tol = tolerance(next(model.parameters()).dtype if not torch.is_autocast_enabled(ids.device.type)
                        else torch.get_autocast_dtype(ids.device.type))
        if not err / scale <= tol:
            return (f"the packed forward does not reproduce the model's own padded forward (log-prob error "
                    f"{err / scale:.1e} > {tol:.0e} relative)")
        return None


def index_limit(model: torch.nn.Module) -> int | None:
    """First forward index whose query scale is not 1 in a model that scales queries by the token's index in the
    forward (Llama 4's attention temperature tuning on its NoPE layers: `log1p(floor((i + 1) / floor_scale))`, from
    `arange(seq_len)`, not from `position_ids`); None for other models."""
    limits = [int(m.floor_scale) - 1 for m in model.modules()
              if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)
              and isinstance(getattr(m, "floor_scale", None), (int, float))]
    return min(limits) if limits else None


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


def probe_batch(tokens: torch.Tensor, chunk_sizes=()) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A TRL-layout batch from probe tokens [L]: two prompts (the whole probe, and its first 5 or so tokens)
    left-padded, two rows each with completions of 4/2 and 3/1 tokens right-padded. The short prompt's padding is
    not a multiple of any attention chunk size in `chunk_sizes` (where one fits), so that chunks counted from column
    0 and from the row's first real token differ. Returns (input_ids, attention_mask, C)."""
    L = tokens.shape[0]
    chunks = [c for c in chunk_sizes if c and c > 1]
    short = next((n for n in (5, 4, 6, 3, 7, 2) if n <= L - 4 and all((L - 4 - n) % c for c in chunks)),
                 min(5, L - 4))
    prompts = [tokens[: L - 4], tokens[:short]]
    completions = [[tokens[-4:], tokens[-2:]], [tokens[1:4], tokens[2:3]]]
    P, C = max(len(p) for p in prompts), 4
    rows, masks = [], []
    for prompt, comps in zip(prompts, completions):
        for comp in comps:
            pad_p, pad_c = P - len(prompt), C - len(comp)
            rows.append(torch.cat([tokens.new_zeros(pad_p), prompt, comp, tokens.new_zeros(pad_c)]))
            masks.append(torch.cat([tokens.new_zeros(pad_p), tokens.new_ones(len(prompt) + len(comp)),
                                    tokens.new_zeros(pad_c)]))
    return torch.stack(rows), torch.stack(masks), C


def _reference(model, forward, input_ids, mask, keep, head: HeadSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [B, C] of the completion tokens from the model's own padded forward (TRL's
    positions), under the head's transform; zero where masked."""
    logits = forward(input_ids=input_ids, attention_mask=mask, use_cache=False).logits[:, -keep - 1 : -1].float()
    logp = torch.log_softmax(logits / head.temperature, dim=-1)  # the model applies its soft-cap / scale itself
    labels = input_ids[:, -keep:]
    chosen = logp.gather(-1, labels[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    valid = mask[:, -keep:].bool()
    return chosen.masked_fill(~valid, 0.0), ent.masked_fill(~valid, 0.0)
