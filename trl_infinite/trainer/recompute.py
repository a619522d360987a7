"""Activation recomputation chosen by the memory budget (`activation_memory_gb`), not always.

TRL's `gradient_checkpointing=True` (its default) stores each decoder layer's input in the forward and runs the
layer's forward again in the backward: a training step does forward + backward + the forward once more, 4/3 of the
work, so that one micro batch's activations never have to fit at once. Here a micro batch already runs as slices of at
most `backward_token_budget` tokens (`loss_slices.py`), so what one forward stores is bounded by the slice, and the
recomputation only pays where a slice's activations would not fit. The trainer measures once what a token costs
without it (`activation_bytes_per_token`: the bytes autograd saves for the decoder's backward over a short probe
sequence, counted by storage with `torch.autograd.graph.saved_tensors_hooks`: SmolLM2-135M in float32 stores
1.34 MB per token, 0.074 MB with checkpointing) and then:
- slices of at most `activation_memory_gb / bytes_per_token` tokens (and `backward_token_budget`) run their forward
  without checkpointing (`no_recompute`); a micro batch is cut into more, smaller slices where needed: their
  gradients accumulate exactly as before (`loss_slices.py`), only a prompt shared by rows of two slices is encoded in
  each. The probes run at two lengths: where the bytes per token grow with the length (an unfused attention keeping
  its weights, e.g. `eager`, or `sdpa` falling back to its math kernel on older torch), that tier is off;
- where a slice does not fit without recomputation, it recomputes selectively (`selective_recompute`, PyTorch's
  selective activation checkpointing): the outputs of the layers' matrix products and fused attention are kept
  (`SAVED_OPS`, 0.76 MB per token on SmolLM2 in float32), the cheap rest (norms, activations, RoPE) is recomputed,
  so the backward does no matrix product twice; a micro batch is cut into slices that fit that way. It needs TRL's
  checkpointing function with `use_reentrant=False` (TRL's default); otherwise only the first tier applies;
- where even `MIN_SLICE_TOKENS` would not fit either way, every slice recomputes, as TRL does.
The values are the same either way (the recomputed forward is the same computation, a kept output is the forward's
own); only memory and time change. `benchmarks/recompute_modes.py` measures the three on a decoder of SmolLM2's
shape (benchmarks/RESULTS.md, "Selective recomputation").
`activation_memory_gb=None`: TRL's behaviour (recompute whenever `gradient_checkpointing` is on). The head (the
log-probs of the completion tokens) is outside the layers' checkpointing in both trainers and is not counted.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager, nullcontext
from enum import Enum

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from trl_infinite.trainer.stochastic import restore_state, snapshot_state

MIN_SLICE_TOKENS = 256  # below it a slice's matrix products get narrow: recompute instead
PROBE_TOKENS = 64
LINEAR_SLACK = 1.1  # per-token bytes at 2 x PROBE_TOKENS at most this much above those at PROBE_TOKENS
# the ops whose outputs a selective recomputation keeps: the linear layers' products and the fused attention kernels
# (never `bmm`: an unfused attention's scores grow with the square of the length)
SAVED_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name)
)


class Recompute(Enum):
    """How a slice's forward keeps what its backward needs."""

    NONE = "none"  # keep every activation (no checkpointing)
    SELECTIVE = "selective"  # keep the matrix products' outputs, recompute the rest
    FULL = "full"  # TRL's checkpointing: keep each layer's input, recompute the layer


def checkpointed_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward transformers checkpoints (`GradientCheckpointingLayer`s, or a model's decoder that
    checkpoints its layers itself), where `gradient_checkpointing` is on."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


@contextmanager
def no_recompute(model: torch.nn.Module):
    """The forwards run inside keep their activations (no checkpointing); the setting is restored after. The
    backward of those forwards may run later: it follows the graph the forward built."""
    modules = checkpointed_modules(model)
    for m in modules:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in modules:
            m.gradient_checkpointing = True


def _save_matmuls(ctx, op, *args, **kwargs):
    """The policy of `selective_recompute`: keep `SAVED_OPS`' outputs, recompute everything else."""
    if op in SAVED_OPS:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _selective_function(func):
    """`func` (a module's `_gradient_checkpointing_func`) with the selective policy, or None where it cannot take
    one: only torch's non-reentrant `checkpoint` without a `context_fn` of its own does (TRL's default kwargs)."""
    if not (isinstance(func, functools.partial) and func.func is torch_checkpoint.checkpoint
            and func.keywords.get("use_reentrant") is False and "context_fn" not in func.keywords):
        return None
    context = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _save_matmuls)
    return functools.partial(func, context_fn=context)


def selective_available(model: torch.nn.Module) -> bool:
    """Every checkpointed module of `model` can recompute selectively."""
    modules = checkpointed_modules(model)
    return bool(modules) and all(_selective_function(getattr(m, "_gradient_checkpointing_func", None)) is not None
                                 for m in modules)


@contextmanager
def selective_recompute(model: torch.nn.Module):
    """The forwards run inside checkpoint selectively (module docstring); the checkpointing functions are restored
    after. Their backward may run later: the kept outputs live in the graph the forward built."""
    modules = [m for m in checkpointed_modules(model)
               if _selective_function(getattr(m, "_gradient_checkpointing_func", None)) is not None]
    originals = [m._gradient_checkpointing_func for m in modules]
    for m, func in zip(modules, originals):
        m._gradient_checkpointing_func = _selective_function(func)
    try:
        yield
    finally:
        for m, func in zip(modules, originals):
            m._gradient_checkpointing_func = func


class _SavedOutputBytes(TorchDispatchMode):
    """Holds on to the outputs of `SAVED_OPS` (in `kept`) while `inside[0]` (a checkpointed call is running), as a
    selective recomputation does."""

    def __init__(self, inside: list[int], kept: list[torch.Tensor]):
        super().__init__()
        self.inside, self.kept = inside, kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside[0] and func in SAVED_OPS:
            self.kept += [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        return out


def _probe(model: torch.nn.Module, tokens: int, hooks, checkpointing: bool = False) -> None:
    """One forward of `tokens` random ids through the model's body (not its head) with grad, under `hooks` (a
    context), without checkpointing unless `checkpointing`; the global random state, the modules' buffers and plain
    attributes are left as they were (dropout masks draw from the generator; a dynamic NTK RoPE keeps the
    frequencies of its longest forward)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    state = snapshot_state(model)  # a forward may change buffers later forwards read (dynamic NTK RoPE)
    try:
        with (torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
              nullcontext() if checkpointing else no_recompute(model), torch.enable_grad(), hooks):
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            out = body(inputs_embeds=embeds, use_cache=False)
            del out
    finally:
        restore_state(state)


def selective_bytes_per_token(model: torch.nn.Module, tokens: int = PROBE_TOKENS) -> float:
    """Bytes a selectively recomputed forward keeps per token: the tensor inputs of each checkpointed call (what
    checkpointing keeps) plus the outputs of `SAVED_OPS` run inside those calls, over one probe forward whose
    checkpointed calls run their function directly; every such tensor is held until the end (no storage is freed
    and its address reused), each storage counted once."""
    modules = [m for m in checkpointed_modules(model) if hasattr(m, "_gradient_checkpointing_func")]
    originals = [m._gradient_checkpointing_func for m in modules]
    inside, kept = [0], []

    def counted(function, *args, **kwargs):
        kept.extend(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point())
        inside[0] += 1
        try:
            return function(*args, **kwargs)
        finally:
            inside[0] -= 1

    counter = _SavedOutputBytes(inside, kept)
    for m in modules:
        m._gradient_checkpointing_func = counted
    try:
        _probe(model, tokens, counter, checkpointing=True)
    finally:
        for m, func in zip(modules, originals):
            m._gradient_checkpointing_func = func
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return sum(storages.values()) / tokens


def activation_bytes_per_token(model: torch.nn.Module, tokens: int = PROBE_TOKENS) -> float:
    """Bytes autograd keeps for the backward of the decoder's forward, per token, without checkpointing: one probe
    forward (`_probe`), each saved storage counted once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    _probe(model, tokens, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    return sum(saved.values()) / tokens


def _linear_bytes_per_token(probe, model: torch.nn.Module) -> float:
    """`probe`'s bytes per token at twice `PROBE_TOKENS`, or infinity where they exceed those at `PROBE_TOKENS` by
    more than `LINEAR_SLACK`: the forward keeps something that grows faster than the tokens (an unfused attention's
    weights), which a limit per token cannot bound."""
    short, long = probe(model, PROBE_TOKENS), probe(model, 2 * PROBE_TOKENS)
    return long if long <= LINEAR_SLACK * short else math.inf


class RecomputePolicy:
    """Which slices of the loss recompute their activations, and how (module docstring)."""

    def __init__(self, limit_gb: float | None):
        self.limit_bytes = None if limit_gb is None else limit_gb * 1e9
        self.bytes_per_token: float | None = None  # kept without recomputation (measured at the first use)
        self.selective_bytes_per_token: float | None = None  # kept by a selective recomputation; None: unavailable

    def active(self, model: torch.nn.Module) -> bool:
        return self.limit_bytes is not None and model.training and bool(checkpointed_modules(model))

    def _fitting(self, model: torch.nn.Module) -> tuple[int, int]:
        """The most tokens whose activations fit the limit without recomputation, and with a selective one (0 where
        a tier is unavailable)."""
        if self.bytes_per_token is None:
            self.bytes_per_token = _linear_bytes_per_token(activation_bytes_per_token, model)
            if selective_available(model):
                self.selective_bytes_per_token = _linear_bytes_per_token(selective_bytes_per_token, model)
        return tuple(0 if per_token is None or math.isinf(per_token) else int(self.limit_bytes // max(per_token, 1.0))
                     for per_token in (self.bytes_per_token, self.selective_bytes_per_token))

    def max_tokens(self, model: torch.nn.Module) -> int | None:
        """The most tokens one slice may hold and recompute no matrix product; None: recompute (TRL's way)."""
        if not self.active(model):
            return None
        tokens = max(self._fitting(model))
        return tokens if tokens >= MIN_SLICE_TOKENS else None

    def mode(self, model: torch.nn.Module, tokens: int) -> Recompute:
        """How a slice of `tokens` tokens runs: keeping everything if it fits, else selectively if that fits, else
        as TRL (full recomputation)."""
        if not self.active(model):
            return Recompute.FULL
        keep, selective = self._fitting(model)
        if tokens <= keep:
            return Recompute.NONE
        return Recompute.SELECTIVE if tokens <= selective else Recompute.FULL
