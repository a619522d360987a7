"""Training forwards that draw random numbers (dropout, router noise): run exactly as `GRPOTrainer` runs them.

TRL does not turn dropout off by default (`disable_dropout=False`), and some models keep it in functional form that
`disable_dropout` does not reach (OPT's `dropout`: `nn.functional.dropout` on a float attribute). With dropout on,
a log-prob is a function of the random mask, and the mask of a token is a function of the global generator's state,
the shape of the forward's batch and the position of the token in it. `GRPOTrainer` draws them in its own order:
one `torch.randperm` of the generation batch, consecutive equal micro batches padded to the batch's widths, one
forward and one backward per micro batch. Any other composition (rows grouped by length or prompt, trimmed padding,
slices of a micro batch, the packed shared-prefix forward) draws other masks: a difference of the size of the
dropout itself (0.03 to 0.1 nats on OPT / GPT-2 with the default 0.1), not round-off.

So with a random training forward the trainer runs TRL's own micro batches, padded forward and one backward per
micro batch (`InfiniteGRPOTrainer._prepare_inputs`, `loss_slices.loss_slices`, `_install_shared_prefix`), and warns once; the
rollout engine is unaffected (it samples in eval mode, like `generate`). `random_training_forward` decides it:
- a module scan: a `torch.nn.Dropout`-family module with `p > 0`, or a float attribute named like a dropout / noise
  probability (`*dropout*`, `*pdrop*`, `*jitter*`, `layerdrop`) above 0 (functional dropout, router jitter);
- else a probe: two training-mode forwards of the same batch under different seeds must agree bit for bit.
The probe runs under `torch.random.fork_rng`: the global generator (whose state the dropout masks follow) is left as
`GRPOTrainer` would have it; and it gives every module its buffers and plain attributes back (a dynamic-NTK RoPE
keeps the frequencies of its longest forward so far, which later forwards use).
"""

from __future__ import annotations

import torch

from trl_infinite.engine.config.inputs import model_vocab_size
from trl_infinite.engine.model.probe import probe_tokens
from trl_infinite.engine.model.support import probe_length

_NOISE_NAMES = ("dropout", "pdrop", "jitter", "layerdrop")


def _scan(model: torch.nn.Module) -> str | None:
    for name, module in model.named_modules():
        where = name or type(model).__name__
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{type(module).__name__}(p={module.p:g}) at {where}"
        for attr, value in vars(module).items():
            if (isinstance(value, float) and not isinstance(value, bool) and value > 0
                    and any(n in attr.lower() for n in _NOISE_NAMES)):
                return f"{attr}={value:g} at {where}"
    return None


_STATE = (bool, int, float, str, type(None), torch.Tensor)


@torch.no_grad()
def snapshot_state(model: torch.nn.Module) -> list:
    """Each module's buffers (the objects and a copy of their values) and its public plain / tensor attributes: a
    forward may change them (dynamic NTK RoPE grows `inv_freq` and `max_seq_len_cached` past its longest position,
    and later forwards depend on it), and the probe must leave the model as `GRPOTrainer` would see it."""
    return [(m, dict(m._buffers), {k: v.clone() for k, v in m._buffers.items() if v is not None},
             {k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _STATE)})
            for m in model.modules()]


@torch.no_grad()
def restore_state(snapshot: list) -> None:
    for m, buffers, values, attrs in snapshot:
        for k, v in values.items():
            if not torch.equal(buffers[k], v):  # (a copy bumps the version counter the engine's weight state reads)
                buffers[k].copy_(v)
        m._buffers.clear()
        m._buffers.update(buffers)
        m.__dict__.update(attrs)


@torch.no_grad()
def _probe(model: torch.nn.Module) -> str | None:
    device = next(model.parameters()).device
    was_training = model.training
    devices = [device] if device.type == "cuda" else []
    state = snapshot_state(model)
    try:
        ids = probe_tokens(model_vocab_size(model), probe_length(model), device).repeat(2, 1)
        model.train()
        with torch.random.fork_rng(devices=devices):
            outs = []
            for seed in (0, 1):
                torch.manual_seed(seed)
                outs.append(model(input_ids=ids, use_cache=False).logits)
    except Exception:  # noqa: BLE001  (a model the probe cannot run is judged by the scan alone)
        return None
    finally:
        model.train(was_training)
        restore_state(state)
    return None if torch.equal(outs[0], outs[1]) else "two training forwards of the same batch differ"


def random_training_forward(model: torch.nn.Module) -> str | None:
    """What makes `model`'s training forward random (a dropout module, a noise attribute, or the probe's finding),
    or None when it is deterministic (see the module docstring)."""
    return _scan(model) or _probe(model)


def warning_text(reason: str) -> str:
    return (
        f"InfiniteGRPOTrainer's training forward is random ({reason}): its dropout masks follow the global generator "
        "and the shape of each forward, so the backward pass runs GRPOTrainer's own micro batches (TRL's random "
        "split, padded to the generation batch's widths), TRL's padded forward and one backward per micro batch "
        "(no length-grouped micro batches, no shared-prefix forward, no `backward_token_budget` slices). Turn "
        "dropout off (`disable_dropout=True`, or the model config's dropout fields) to use them."
    )
