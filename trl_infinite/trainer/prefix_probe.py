"""The start-up probe of the shared-prefix forward (`shared_prefix.SharedPrefixForward.install`): its probe batch,
the model's own padded forward it is compared with, and the decision in float32 for a run in a 16-bit dtype.

For a run in a 16-bit dtype (16-bit weights, or float32 weights under the trainer's autocast) the whole contract is
first checked, without autocast and at `FLOAT32_TOLERANCE`, on the float32 model the engine's
`replica.float32_reference` gives (the model itself with autocast off, a float32 copy, or a float32 replica built
from its config); the run's own check is then held to a bound derived as the engine's `exactness.rounding_bound`:
`NOISE_MULTIPLE` x the distance of the padded forward's 16-bit log-probs and entropies from its float32 ones on the
probe batch, within `FLOOR_ULPS` to `CAP_ULPS` units of the dtype (`float32_decision`).
"""

from __future__ import annotations

import copy
import functools

import torch

from trl_infinite.engine.config.inputs import model_vocab_size
from trl_infinite.engine.model.exactness import CAP_ULPS, FLOOR_ULPS, NOISE_MULTIPLE, RoundingBound
from trl_infinite.engine.model.probe import probe_tokens
from trl_infinite.engine.model.replica import Float32ReferenceError, float32_reference
from trl_infinite.engine.model.support import probe_length
from trl_infinite.trainer.logprobs import HeadSpec


class SharedPrefixUnsupported(ValueError):
    """The shared-prefix forward cannot run this model exactly (the message says why)."""


FLOAT32_TOLERANCE = 1e-4  # |log-prob difference| / max(1, max |log-prob|): float32 round-off of two reduction orders


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


def padded_reference(model, forward, input_ids, mask, keep, head: HeadSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [B, C] of the completion tokens from the model's own padded forward (TRL's
    positions), under the head's transform; zero where masked."""
    logits = forward(input_ids=input_ids, attention_mask=mask, use_cache=False).logits[:, -keep - 1 : -1].float()
    logp = torch.log_softmax(logits / head.temperature, dim=-1)  # the model applies its soft-cap / scale itself
    labels = input_ids[:, -keep:]
    chosen = logp.gather(-1, labels[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    valid = mask[:, -keep:].bool()
    return chosen.masked_fill(~valid, 0.0), ent.masked_fill(~valid, 0.0)


@torch.no_grad()
def run_dtype(model: torch.nn.Module, stack: torch.nn.Module, autocast, ids: torch.Tensor) -> tuple[torch.dtype, bool]:
    """(the dtype the run's forwards compute in, whether the model's forward turns autocast on by itself, as
    accelerate's mixed-precision wrapper on `forward` does, seen at the decoder stack `stack`)."""
    device = ids.device.type
    with autocast():
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    seen: list[bool] = []
    hook = stack.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled(device)))
    try:
        with torch.autocast(device, enabled=False):
            model(input_ids=ids[:, :2], use_cache=False)
    except Exception:  # noqa: BLE001  (the checks that follow name a failing forward)
        pass
    finally:
        hook.remove()
    forced = any(seen)
    if forced and dtype is None:
        dtype = torch.get_autocast_dtype(device)
    return (dtype or next(model.parameters()).dtype), forced


def float32_decision(model: torch.nn.Module, head: HeadSpec, autocast, dtype: torch.dtype, forced: bool,
                     ids: torch.Tensor, outer: torch.nn.Module | None, install) -> RoundingBound:
    """The contract for a run in `dtype` (16-bit), decided in float32 (the module docstring): raises the refusal
    naming what failed and what it was checked on; returns the bound for the run's own check. `install`:
    `SharedPrefixForward.install`, run on the float32 model without autocast."""
    try:
        ref, how = float32_reference(model, forced)
    except Float32ReferenceError as err:
        raise SharedPrefixUnsupported(f"its structure cannot be checked in float32 ({err}); train it with float32 "
                                      "weights (under autocast if wanted: those are checked directly)") from err
    device = next(ref.parameters()).device.type
    off = functools.partial(torch.autocast, device, enabled=False)
    ref_head = head if ref is model or not how.startswith("a float32 replica") else \
        HeadSpec.from_model(ref, head.temperature, head.fp32)
    try:
        install(ref, ref_head, autocast=off, outer=outer if ref is model else None).uninstall()
    except SharedPrefixUnsupported as err:
        raise SharedPrefixUnsupported(f"in float32 (checked on {how}): {err}") from err
    same_weights = not how.startswith("a float32 replica")
    run = model if same_weights else copy.deepcopy(ref).to(next(model.parameters()).dtype)
    ref_ids = ids.to(device) if same_weights else \
        probe_tokens(model_vocab_size(ref), probe_length(ref), torch.device(device))
    eps = torch.finfo(dtype).eps
    try:
        noise = rounding_noise(run, ref, ref_ids, ref_head, autocast if run is model else off)
    except Exception:  # noqa: BLE001  (the run's own check names a failing forward)
        noise = None
    derived = FLOOR_ULPS * eps if noise is None else NOISE_MULTIPLE * noise
    return RoundingBound(dtype, noise, min(max(derived, FLOOR_ULPS * eps), CAP_ULPS * eps))


@torch.no_grad()
def rounding_noise(run: torch.nn.Module, ref: torch.nn.Module, ids: torch.Tensor, head: HeadSpec, autocast
                    ) -> float:
    """Relative distance (the check's measure) of the padded forward's 16-bit log-probs and entropies (`run` under
    the run's `autocast`) from its float32 ones (`ref` without autocast) on the probe batch of `ids`."""
    batch = probe_batch(ids[0])
    states = [(m, m.training) for m in (run, ref)]
    try:
        for m, _ in states:
            m.train()
        with torch.autocast(ids.device.type, enabled=False):
            exact = padded_reference(ref, ref.forward, *batch, head)
        run_device = next(run.parameters()).device
        with autocast():
            got = padded_reference(run, run.forward, *(t.to(run_device) if torch.is_tensor(t) else t for t in batch), head)
    finally:
        for m, was in states:
            m.train(was)
    valid = batch[1][:, -batch[2]:].bool()
    scale = max(1.0, exact[0][valid].abs().max().item())
    return max((g.to(e.device) - e)[valid].abs().max().item() for g, e in zip(got, exact)) / scale
