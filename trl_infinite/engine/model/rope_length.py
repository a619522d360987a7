"""Length-dependent rotary embeddings: RoPE whose rotation of a position depends on the other positions of a forward.

The engine reproduces a model's forward token by token only if the rotation a position gets is a function of that
position alone. transformers' `dynamic_rope_update` breaks this for two rope types: `dynamic` (dynamic NTK: the
frequencies are recomputed from the largest position of the current forward, `max(position_ids) + 1`, once it
exceeds `max_position_embeddings`, and reset below it: the rotation also depends on earlier calls) and `longrope`
(Phi-3: the short or the long factors, chosen by whether the forward's largest position reaches
`original_max_position_embeddings`). In the engine a prompt packed beside a longer one then takes the longer one's
frequencies, a chunked prefill and each decode step take their own, and none of it equals `generate`, whose own
result depends on how it was called (one forward of the prompt, then one per token). The support probe is far
shorter than any such threshold, so it never sees it.

`length_dependent_rope(model)` decides it by behaviour, not by a list of model names: every rotary-embedding module
(a module with an `inv_freq` buffer, or a class name saying rotary / rope) is copied and called on positions
[1, 2] alone and on [1, 2, M] for M up to 2^24 (the config's position limits and powers of two); if the
rotations of positions 1 and 2 differ, the embedding is length dependent. The config's rope type(s) are read too
(`rope_parameters` / `rope_scaling`, per layer type where the config has several), so that a rotary module this
probe cannot call is still judged: a type transformers recomputes per forward (`dynamic`, `longrope`, names
containing `dynamic`) is length dependent. The copies keep the model's own state untouched.
"""

from __future__ import annotations

import copy
import inspect
import re

import torch

ROTARY_CLASS = re.compile(r"rotary|rope", re.IGNORECASE)
# rope types whose frequencies transformers recomputes from each forward's longest position (`dynamic_rope_update`)
RECOMPUTED_PER_FORWARD = ("longrope",)
FIXED_ALTERNATIVES = "`linear`, `yarn` or `llama3` scaling with the same factor, or no scaling"
MAX_PROBED_POSITION = 1 << 24


def rope_types(config) -> list[str]:
    """The rope types a (text) config names: `rope_parameters` / `rope_scaling`, per layer type where nested."""
    found = []
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(config, field, None)
        if not isinstance(params, dict):
            continue
        nested = [v for v in params.values() if isinstance(v, dict)]
        for p in nested or [params]:
            kind = p.get("rope_type", p.get("type"))
            if isinstance(kind, str):
                found.append(kind)
    return found


def _position_limits(config) -> list[int]:
    """Positions worth probing: powers of two, and each position-like integer of the config around its value."""
    limits = set()
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(config, field, None)
        params = params if isinstance(params, dict) else {}
        values = [params, *[v for v in params.values() if isinstance(v, dict)]]
        for p in values:
            limits.update(v for k, v in p.items() if "position" in k and isinstance(v, int))
    for name in ("max_position_embeddings", "original_max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            limits.add(value)
    near = {m + d for m in limits for d in (-1, 0, 1)} | {1 << k for k in range(4, 25)}
    return sorted(m for m in near if 3 <= m <= MAX_PROBED_POSITION)


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    seen, found = set(), []
    for m in model.modules():
        named = ROTARY_CLASS.search(type(m).__name__) is not None
        if (named or "inv_freq" in dict(m.named_buffers(recurse=False))) and type(m) not in seen:
            seen.add(type(m))
            found.append(m)
    return found


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _same_prefix(short: list[torch.Tensor], long: list[torch.Tensor]) -> bool:
    """Each output of the 2-position call equals the first 2 positions of the 3-position call (on the sequence
    dim: the one whose size differs)."""
    if len(short) != len(long) or not short:
        return True
    for a, b in zip(short, long):
        dims = [d for d in range(a.dim()) if a.shape[d] != b.shape[d]] if a.dim() == b.dim() else []
        if len(dims) != 1:
            continue
        b = b.narrow(dims[0], 0, a.shape[dims[0]])
        if not torch.allclose(torch.view_as_real(a) if a.is_complex() else a.float(),
                              torch.view_as_real(b) if b.is_complex() else b.float(), rtol=1e-5, atol=1e-6):
            return False
    return True


@torch.no_grad()
def _length_dependent_at(module: torch.nn.Module, limits: list[int]) -> int | None:
    """The first probed position M whose presence changes the rotation of positions 1 and 2, or None (also when
    the module cannot be called as `module(x, position_ids[, layer_type])`)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    kinds = getattr(module, "rope_type", None)
    layer_types = list(kinds) if isinstance(kinds, dict) and "layer_type" in params else [None]
    buffer = next(iter(module.buffers()), None)
    device = buffer.device if buffer is not None else torch.device("cpu")
    x = torch.zeros(1, 1, 3, 8, device=device)
    for layer_type in layer_types:
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        for m in limits:
            probe = copy.deepcopy(module)  # dynamic RoPE updates its buffers and cache length on every call
            try:
                short = _flat(probe(x[..., :2, :], torch.tensor([[1, 2]], device=device), **kwargs))
                probe = copy.deepcopy(module)
                long = _flat(probe(x, torch.tensor([[1, 2, m]], device=device), **kwargs))
            except Exception:  # noqa: BLE001  (not a rotary module of the usual signature)
                return None
            if not _same_prefix(short, long):
                return m
    return None


def length_dependent_rope(model: torch.nn.Module, config) -> str | None:
    """Why `model`'s rotary embedding is length dependent (see the module docstring), or None."""
    named = [k for k in rope_types(config) if "dynamic" in k or k in RECOMPUTED_PER_FORWARD]
    limits = _position_limits(config)
    for module in _rotary_modules(model):
        at = _length_dependent_at(module, limits)
        if at is not None:
            kind = named[0] if named else getattr(module, "rope_type", type(module).__name__)
            return (f"its rotary position embedding (`{kind}`, {type(module).__name__}) rotates a position "
                    f"differently when the same forward also holds position {at} (its frequencies depend on the "
                    "longest sequence of each forward), so prompts packed beside longer ones, chunked prefill and "
                    f"decode steps cannot match `generate`; use {FIXED_ALTERNATIVES}")
    if named:
        return (f"its rotary position embedding (`{named[0]}`) recomputes its frequencies from the longest "
                "sequence of each forward (transformers' `dynamic_rope_update`), so prompts packed beside longer "
                f"ones, chunked prefill and decode steps cannot match `generate`; use {FIXED_ALTERNATIVES}")
    return None
