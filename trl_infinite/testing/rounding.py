"""How far two 16-bit computations of the same logits may lie apart: for tests that compare two paths (the engine's
paged decode step and `model.generate`'s cache, two batch shapes) under CPU bf16 autocast.

Both paths run the same model in bf16, but their sums run in other orders (a context padded to whole blocks, a prompt
prefilled in chunks), so their logits differ by about as much as the model's own bf16 forward differs from its
float32 one. A greedy choice whose two best logits lie within that bound (an exact bf16 tie is common: bf16 has
8 significant bits) may flip between the paths without either being wrong; a test of "greedy equals `generate`"
under autocast holds exactly only where no such near-tie lies on the path (`first_near_tie`).

Measured bounds (the engine fuzzer): 1.3e-3 between bf16 and float32 at max |logit| 0.37 on a fresh tiny model (about
one ulp, the gap between two engine paths too); after a weight change that made the activations large, over 2 at
max |logit| 9.6, where the engine and `generate` disagreed on a greedy token 0.31 apart (one ulp there is 0.0625).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

# the bound: this many times the largest gap between the model's own 16-bit and float32 logits on the inputs (each
# path rounds about as much as that forward), and at least this many ulps (of the region's dtype) of the largest logit
AUTOCAST_GAPS = 2
AUTOCAST_ULPS = 2


def ulp(x: float, dtype: torch.dtype = torch.bfloat16) -> float:
    """The spacing of `dtype` numbers at `x` (bfloat16: 8 significant bits, float16: 11)."""
    return 2.0 ** math.floor(math.log2(max(abs(x), torch.finfo(dtype).tiny))) * torch.finfo(dtype).eps


def autocast_logit_bound(model, sequences: Iterable[list[int]], scale: float = 1.0) -> float:
    """Inside an enabled CPU autocast region: how far two 16-bit paths' logits on `sequences` may lie apart,
    `scale` times (a repetition penalty multiplies negative logits) the larger of `AUTOCAST_GAPS` x the largest
    |16-bit - float32| logit gap of the model's full forwards of the sequences and `AUTOCAST_ULPS` ulps (of the
    region's dtype) of the largest logit."""
    largest, gap = 0.0, 0.0
    with torch.no_grad():
        for ids in sequences:
            x = torch.tensor([list(ids)])
            half = model(x, use_cache=False).logits.float()
            with torch.autocast("cpu", enabled=False):
                full = model(x, use_cache=False).logits.float()
            largest, gap = max(largest, full.abs().max().item()), max(gap, (half - full).abs().max().item())
    return scale * max(AUTOCAST_GAPS * gap, AUTOCAST_ULPS * ulp(largest * scale, torch.get_autocast_dtype("cpu")))


def first_near_tie(model, prompt: list[int], completion: list[int], bound: float) -> tuple[int, set[int]] | None:
    """The first step of a greedy `completion` whose choice is a near-tie (in the model's full forward of the
    sequence in the current autocast region, more than one token within `bound` of the step's largest logit) and
    the tokens within it; None if the whole completion is decided by margins wider than `bound`."""
    if not completion:
        return None
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion[:-1]]), use_cache=False).logits[0, len(prompt) - 1:].float()
    for step, row in enumerate(logits):
        tied = (row >= row.max() - bound).nonzero().flatten().tolist()
        if len(tied) > 1:
            return step, set(tied)
    return None
