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
  each;
- where even `MIN_SLICE_TOKENS` would not fit, every slice recomputes, as TRL does.
The values are the same either way (the recomputed forward is the same computation); only memory and time change.
`activation_memory_gb=None`: TRL's behaviour (recompute whenever `gradient_checkpointing` is on). The head (the
log-probs of the completion tokens) is outside the layers' checkpointing in both trainers and is not counted.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from trl_infinite.trainer.stochastic import restore_state, snapshot_state

MIN_SLICE_TOKENS = 256  # below it a slice's matrix products get narrow: recompute instead
PROBE_TOKENS = 64


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


def activation_bytes_per_token(model: torch.nn.Module, tokens: int = PROBE_TOKENS) -> float:
    """Bytes autograd keeps for the backward of the decoder's forward, per token, without checkpointing: one
    forward of `tokens` random ids through the model's body (not its head), each saved storage counted once,
    parameters excluded. The global random state, the modules' buffers and plain attributes are left as they were
    (dropout masks draw from the generator; a dynamic NTK RoPE keeps the frequencies of its longest forward)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    state = snapshot_state(model)  # a forward may change buffers later forwards read (dynamic NTK RoPE)
    try:
        with (torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), no_recompute(model),
              torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            out = body(inputs_embeds=embeds, use_cache=False)
            del out
    finally:
        restore_state(state)
    return sum(saved.values()) / tokens


class RecomputePolicy:
    """Which slices of the loss recompute their activations (module docstring)."""

    def __init__(self, limit_gb: float | None):
        self.limit_bytes = None if limit_gb is None else limit_gb * 1e9
        self.bytes_per_token: float | None = None

    def active(self, model: torch.nn.Module) -> bool:
        return self.limit_bytes is not None and model.training and bool(checkpointed_modules(model))

    def max_tokens(self, model: torch.nn.Module) -> int | None:
        """The most tokens one slice may hold and run without recomputation; None: recompute (TRL's way)."""
        if not self.active(model):
            return None
        if self.bytes_per_token is None:
            self.bytes_per_token = activation_bytes_per_token(model)
        tokens = int(self.limit_bytes // max(self.bytes_per_token, 1.0))
        return tokens if tokens >= MIN_SLICE_TOKENS else None
