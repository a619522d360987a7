"""Row-count invariance on CPU, derived on the machine: the row counts at which its BLAS computes a row the same bits.

A row's logits must not depend on how many rows share its forward (`model_runner` docstring). Which row counts give
a product's row the same bits is the BLAS's choice, and it depends on the CPU, on the product's shape and on the
thread count. Measured with MKL on two machines: on one (AVX512), every multiple of 4 rows gave the same bits for
every Linear shape of SmolLM2-135M; on another (AVX512, 2 MiB L2), a row of those shapes is computed one way at 1 row,
another at 2 to 15 rows and a third from 16 rows on, and with 2 threads its 1536x576 product switches to a fourth
between 57 and 192 rows (a tiny model's 64x64 product is the same from 3 rows on). So nothing here is assumed:
`derive_plan` probes the model's own row-wise products (`nn.Linear`, transformers' `Conv1D`; LoRA's are `nn.Linear`)
at the current thread count, and the `RowPlan` it returns says
- `multiple`: every forward's row count is padded to a multiple of it (the smallest candidate that works);
- per module, `cap`: the most rows one product of that shape was verified at; a forward of more rows runs the module
  on consecutive chunks of at most `cap` rows (`RowPlan.split`).
A shape passes a candidate multiple `m` up to `c` rows when, for every multiple of `m` up to `c`, one product of that
many rows equals the same rows computed `m` at a time, and an `m`-row product with its rows shifted by one position
gives each row the same bits (position within a product). The probe runs each shape with random inputs on the
module's own weights (nothing is allocated the size of a weight), cached per (thread count, shape, compute dtype) for
the process; its work per shape and candidate is bounded (`PROBE_FLOPS`). Where no candidate works (a BLAS whose rows
differ at every multiple up to 32), the engine warns and pads to 4 as before: its samples then keep plain sampling's
law, but may differ between schedules at near-ties (docs/speculative.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

CANDIDATES = (1, 2, 4, 8, 16, 32)  # row multiples tried, smallest first
MIN_CAP = 32  # a multiple is taken only where every shape stays verified up to this many rows (or its probe limit)
MAX_PROBE_ROWS = 256  # the most rows a shape is probed at (a longer product is chunked)
PROBE_FLOPS = 8e9  # multiply-adds x 2 a shape's probe may cost per candidate multiple
FALLBACK_MULTIPLE = 4

# (module type, in features, out features, the dtype the product computes in, has bias, the weight's strides)
ShapeKey = tuple[type, int, int, torch.dtype, bool, tuple[int, ...]]
_PROBED: dict[tuple[int, ShapeKey, int], int] = {}  # (threads, key, multiple) -> verified cap (0: position differs)


def _row_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def _in_out(module: nn.Module) -> tuple[int, int]:
    rows, cols = module.weight.shape
    return (cols, rows) if isinstance(module, nn.Linear) else (rows, cols)  # Conv1D stores [in, out]


def row_modules(model: nn.Module, autocast: torch.dtype | None = None) -> dict[ShapeKey, list[nn.Module]]:
    """The model's row-wise products with a plain 2-D weight, grouped by what decides the BLAS's kernel (under
    `autocast`, a floating weight's product computes in the autocast dtype). Exact types: a subclass may override
    `forward` (Llama 4's router returns a tuple)."""
    types, out = _row_types(), {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) in types and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            dtype = autocast if autocast is not None and weight.is_floating_point() else weight.dtype
            key = (type(module), *_in_out(module), dtype, getattr(module, "bias", None) is not None, weight.stride())
            out.setdefault(key, []).append(module)
    return out


def probe_limit(in_features: int, out_features: int, multiple: int) -> int:
    """The most rows a shape is probed at for `multiple`: probing every multiple up to `c` costs about
    `c^2 / (2 multiple)` rows' products, kept within `PROBE_FLOPS`; at least `multiple`, at most `MAX_PROBE_ROWS`."""
    rows = PROBE_FLOPS / (2.0 * in_features * out_features)
    limit = min(MAX_PROBE_ROWS, int(math.sqrt(2 * multiple * rows)))
    return max(multiple, limit - limit % multiple)


@torch.no_grad()
def verified_cap(forward: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
                 multiple: int, limit: int) -> int:
    """The largest multiple `c` of `multiple` up to `limit` such that a product of every multiple of `multiple` up to
    `c` rows gives each row the bits of the same rows computed `multiple` at a time; 0 where an `multiple`-row product
    gives a row other bits at another position (module docstring)."""
    x = torch.randn(limit + multiple, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    chunks: list[torch.Tensor] = []

    def alone(rows: int) -> torch.Tensor:  # the first `rows` rows, computed `multiple` at a time
        while len(chunks) * multiple < rows:
            start = len(chunks) * multiple
            chunks.append(forward(x[start:start + multiple]))
        return torch.cat(chunks)[:rows]

    shifted = forward(x[1:multiple + 1].clone())  # each row one position earlier, in a buffer of its own
    if not torch.equal(shifted, alone(multiple + 1)[1:]):
        return 0
    cap = multiple
    for rows in range(2 * multiple, limit + 1, multiple):
        if not torch.equal(forward(x[:rows]), alone(rows)):
            break
        cap = rows
    return cap


def _cap(key: ShapeKey, module: nn.Module, multiple: int, threads: int, autocast: torch.dtype | None
         ) -> tuple[int, int]:
    """(verified cap, probe limit) of `key` for `multiple` at `threads` threads, probed on `module` once, under
    `autocast` as the model's forward runs (and under nothing else: the caller's state does not leak in)."""
    limit = probe_limit(key[1], key[2], multiple)
    if (threads, key, multiple) not in _PROBED:
        forward = partial(type(module).forward, module)  # the class's product, without hooks or wrappers
        state = (torch.autocast("cpu", dtype=autocast, cache_enabled=False) if autocast is not None
                 else torch.autocast("cpu", enabled=False))
        with state:
            _PROBED[threads, key, multiple] = verified_cap(forward, key[1], module.weight.dtype, multiple, limit)
    return _PROBED[threads, key, multiple], limit


@dataclass(frozen=True)
class RowPlan:
    """How an engine's CPU forwards keep a row's bits independent of the row count (module docstring)."""

    multiple: int
    threads: int
    capped: tuple[tuple[nn.Module, int], ...] = ()  # (module, cap), by cap ascending
    row_invariant: bool = True  # False: the fallback, no candidate verified

    @contextmanager
    def split(self, rows: int) -> Iterator[None]:
        """Inside the block, each module whose cap is below `rows` runs on chunks of at most its cap rows (through
        whatever forward it had: hooks that replaced it keep running, once per chunk)."""
        over = [(m, cap) for m, cap in self.capped if cap < rows]
        saved = [m.__dict__.get("forward") for m, _ in over]
        for (module, cap), own in zip(over, saved):
            module.forward = partial(_chunked, own or partial(type(module).forward, module), cap, self.multiple)
        try:
            yield
        finally:
            for (module, _), own in zip(over, saved):
                if own is None:
                    del module.forward
                else:
                    module.forward = own


def chunk_sizes(rows: int, cap: int, multiple: int) -> list[int]:
    """`rows` in as few chunks as `cap` allows, of about equal size in multiples of `multiple` (64 rows at a cap of
    48 run as 32 + 32, not 48 + 16, whose 16-row product costs about what the 48-row one does); a remainder of fewer
    than `multiple` rows (the engine pads every forward, so none) joins the last chunk."""
    units, extra = divmod(rows, multiple)
    chunks = -(-rows // cap)
    size, longer = divmod(units, chunks)
    sizes = [(size + 1) * multiple] * longer + [size * multiple] * (chunks - longer)
    sizes[-1] += extra
    return sizes


def _chunked(forward: Callable[[torch.Tensor], torch.Tensor], cap: int, multiple: int, x: torch.Tensor
             ) -> torch.Tensor:
    """`forward` on consecutive chunks of `x`'s rows (`chunk_sizes`), where it has more than `cap`."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= cap:
        return forward(x)
    out = torch.cat([forward(chunk) for chunk in flat.split(chunk_sizes(flat.shape[0], cap, multiple))])
    return out.reshape(*x.shape[:-1], out.shape[-1])


def derive_plan(model: nn.Module, autocast: torch.dtype | None = None) -> RowPlan:
    """The smallest candidate multiple at which every row-wise product of `model` (its forward running under
    `autocast`, `ModelSupport.autocast`) stays verified up to `MIN_CAP` rows (or its probe limit, where that is
    lower), at the current thread count; each module capped at its shape's verified rows. Warns and falls back to
    padding to 4 where none is (module docstring)."""
    threads = torch.get_num_threads()
    keyed = row_modules(model, autocast)
    for multiple in CANDIDATES:
        caps = {}
        for key, modules in keyed.items():
            cap, limit = _cap(key, modules[0], multiple, threads, autocast)
            if cap < min(MIN_CAP, limit):
                break
            caps[key] = cap
        else:
            capped = sorted(((m, caps[key]) for key, modules in keyed.items() for m in modules), key=lambda mc: mc[1])
            return RowPlan(multiple, threads, tuple(capped))
    shapes = ", ".join(f"{k[1]}x{k[2]} {str(k[3]).removeprefix('torch.')}" for k in keyed)
    warnings.warn(f"this CPU's BLAS gives a product's row other bits at other row counts for every row multiple tried "
                  f"({', '.join(map(str, CANDIDATES))}) at {threads} threads (shapes {shapes}): the engine pads its "
                  f"forwards to {FALLBACK_MULTIPLE} rows as before, and a seed's samples keep plain sampling's law but "
                  "may differ between schedules and with speculation at near-ties. Setting MKL_CBWR=AUTO,STRICT "
                  "before Python starts (Intel MKL) makes every row count give the same bits.", stacklevel=3)
    return RowPlan(FALLBACK_MULTIPLE, threads, row_invariant=False)
