"""Prefix length predictor on recorded traces: features (policy hidden state at completion token k) and its MAE.

`features(records, model, ks)` re-runs the policy model on prompt + the first k recorded completion tokens and keeps
the last hidden state at completion token k — what the engine hands the "prefix" predictor when a sample's input
token is its k-th. `evaluate_mae` fits the predictor's own online ridge head (`OnlineRidge`, on log-length), leaving
one prompt out at a time (train on every other prompt, predict this one), and compares it with the constant
predictor (mean length of the other prompts' samples).
"""

from __future__ import annotations

import math

import numpy as np

from trl_infinite.engine.sched.predictors.base import OnlineRidge
from trl_infinite.sim.traces import TraceRecord


def features(records: list[TraceRecord], model, ks: list[int], batch: int = 16) -> dict[int, dict]:
    """{k: {(prompt_index, sample_idx): hidden [d]}} for samples whose completion has at least k tokens."""
    import torch

    from trl_infinite.engine.decode.step import padded_rows

    out: dict[int, dict] = {k: {} for k in ks}
    kmax = max(ks)
    device = next(model.parameters()).device
    for rec in records:
        if rec.prompt_ids is None or rec.prefix_ids is None:
            raise ValueError("the prefix predictor needs traces with `prompt_ids` and `prefix_ids`.")
        rows = [(j, rec.prompt_ids + p[:kmax]) for j, p in enumerate(rec.prefix_ids)]
        for start in range(0, len(rows), batch):
            part = rows[start : start + batch]
            ids = padded_rows([r for _, r in part], fill=0)
            mask = padded_rows([[1] * len(r) for _, r in part], fill=0)
            with torch.no_grad():
                hid = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                            output_hidden_states=True).hidden_states[-1].float().cpu()  # [b, T, d]
            for i, (j, r) in enumerate(part):
                for k in ks:
                    if len(r) - rec.prompt_len >= k:
                        out[k][(rec.prompt_index, j)] = hid[i, rec.prompt_len + k - 1].numpy()
    return out


def evaluate_mae(records: list[TraceRecord], feats: dict, l2: float | None = None) -> dict[str, float]:
    """Leave-one-prompt-out MAE (tokens) of the ridge head on `feats` and of the constant-mean baseline."""
    keyed = {(r.prompt_index, j): n for r in records for j, n in enumerate(r.lengths)}
    errs, base = [], []
    for rec in records:
        head = OnlineRidge(l2)
        train = [(key, n) for key, n in keyed.items() if key[0] != rec.prompt_index and key in feats]
        for key, n in train:
            head.add(feats[key], math.log(max(1, n)), group=key[0])
        mean_len = float(np.mean([n for _, n in train])) if train else 0.0
        for j, n in enumerate(rec.lengths):
            f = feats.get((rec.prompt_index, j))
            if f is None or not train:
                continue
            pred = min(rec.max_new_tokens or 10**9, math.exp(head(f)))
            errs.append(abs(pred - n))
            base.append(abs(mean_len - n))
    return {"mae": float(np.mean(errs)) if errs else float("nan"),
            "baseline_mae": float(np.mean(base)) if base else float("nan"), "samples": len(errs)}
