"""Per-sample completion-length traces: one JSON object per line, one line per prompt.

    {"prompt_index": 0, "prompt_len": 87, "lengths": [212, 187, ...],          # G completion lengths (tokens)
     "dataset": "gsm8k", "max_new_tokens": 1024, "finished": [true, ...],      # optional: ended by EOS?
     "prompt_ids": [...], "prefix_ids": [[...k first tokens...], ...],        # optional (prefix predictor)
     "epoch": 0, "completion_ids": [[...], ...],                               # optional (revisits, history drafts)
     "acceptance": [0.62, 0.4, ...]}                                           # optional: per-sample draft acceptance
                                                                               # (speculative replay, sim/speculative.py)

A trace that revisits prompts (`record_traces.py --epochs 2`) holds one line per (prompt, epoch).

A trace drives benchmarks on random-weight models (`forced_lengths`) and the scheduling simulator.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TraceRecord:
    prompt_len: int
    lengths: list[int]
    prompt_index: int = 0
    dataset: str = ""
    max_new_tokens: int | None = None
    finished: list[bool] | None = None
    prompt_ids: list[int] | None = None
    prefix_ids: list[list[int]] | None = None
    epoch: int = 0
    completion_ids: list[list[int]] | None = None
    extra: dict = field(default_factory=dict)


_FIELDS = ("prompt_len", "lengths", "prompt_index", "dataset", "max_new_tokens", "finished", "prompt_ids", "prefix_ids",
           "epoch", "completion_ids")


def record_to_json(r: TraceRecord) -> dict:
    """The JSON object of one trace line (fields left at None are omitted; `extra` keys are inlined)."""
    obj = {k: getattr(r, k) for k in _FIELDS if getattr(r, k) is not None}
    obj.update(r.extra)
    return obj


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Read a JSONL trace; raises ValueError naming the line on a malformed record."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if "lengths" not in obj or "prompt_len" not in obj:
            raise ValueError(f"{path}:{n}: a trace record needs `prompt_len` and `lengths`.")
        if not obj["lengths"] or any((not isinstance(x, int)) or x < 1 for x in obj["lengths"]):
            raise ValueError(f"{path}:{n}: `lengths` must be a non-empty list of integers >= 1.")
        known = {k: obj[k] for k in _FIELDS if k in obj}
        records.append(TraceRecord(**known, extra={k: v for k, v in obj.items() if k not in _FIELDS}))
    return records


def save_trace(records: list[TraceRecord], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(record_to_json(r)) + "\n")


def lognormal_trace(num_prompts: int, group_size: int, mean: float, sigma: float, max_len: int, prompt_len: int = 64,
                    seed: int = 0, epochs: int = 1) -> list[TraceRecord]:
    """Synthetic lengths: lognormal with the given mean (tokens) and log-space spread, clipped to [1, max_len].
    Prompts differ in difficulty: each group's median is itself drawn around the global one. With `epochs` > 1 the
    same prompts come back (epoch-major records), each epoch drawing fresh lengths around the prompt's median."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    out, medians = [], []
    for epoch in range(epochs):
        for i in range(num_prompts):
            if epoch == 0:
                medians.append(mu + rng.gauss(0.0, sigma / 2))
            lengths = [max(1, min(max_len, int(rng.lognormvariate(medians[i], sigma)))) for _ in range(group_size)]
            out.append(TraceRecord(prompt_len=prompt_len, lengths=lengths, prompt_index=i, max_new_tokens=max_len,
                                   epoch=epoch))
    return out
