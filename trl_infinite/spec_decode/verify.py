"""Lossless verification of speculative drafts (pure functions, batched, no host sync).

Notation, per sample row: the verification forward gives the *processed* target distributions
`p_0 .. p_k` (repetition penalty, temperature, top-k, top-p, min-p already applied by `Sampler.process`; `p_j` is the
distribution of the token at the j-th emitted position, conditioned on the context plus drafts `d_1 .. d_j`), and
the drafter proposed `d_1 .. d_k` (row `j` of `drafts` is `d_{j+1}`, verified against `p_j`).

Greedy: `d_{j+1}` is accepted iff `d_{j+1} = argmax p_j` for every earlier j too; the emitted tokens are the accepted
drafts followed by `argmax p_n` (n = number accepted). This is exactly what one-token-at-a-time greedy decoding emits.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft `x = d_{j+1}` drawn from `q_j` is accepted with probability
`min(1, p_j(x) / q_j(x))`; at the first rejection the token is drawn from the residual
`r_j = (p_j - q_j)_+ / sum (p_j - q_j)_+`; if all k drafts are accepted a bonus token is drawn from `p_k`.
Then `P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(q(x), p(x))) r(y) = min(q, p)(y) + (p - q)_+(y) = p(y)`,
so every emitted token has the target distribution whatever the drafter does.
A drafter that gives no probabilities (suffix tree, n-gram) is a deterministic function of the context, i.e.
`q = delta_x`: accept with probability `p(x)`, on rejection draw from `p` with `x` removed and renormalised
(`(p - delta_x)_+ = p` without x). The coins are counter-based: acceptance from `STREAM_ACCEPT`, residual draws from
`STREAM_RESIDUAL`, the bonus from `STREAM_SAMPLE`, each keyed by the position of the emitted token, so each position
consumes fresh randomness that is independent of how its draft was produced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.sampler import categorical, uniforms


@dataclass
class Verified:
    """Result of verifying one batch of drafts. Row i emits `tokens[i, : num_accepted[i] + 1]`."""

    tokens: torch.Tensor  # [N, K+1] accepted drafts then the correction/bonus token (padding after)
    logprobs: torch.Tensor  # [N, K+1] log p_j(token_j) of the processed target distribution
    num_accepted: torch.Tensor  # [N]


def _accepted_prefix(accept: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in `accept` [N, K], limited to `lens` [N] -> [N]."""
    k = accept.shape[1]
    valid = torch.arange(k, device=accept.device)[None, :] < lens[:, None]
    return torch.cumprod((accept & valid).long(), dim=1).sum(1)


def _assemble(p: torch.Tensor, drafts: torch.Tensor, n_acc: torch.Tensor, final: torch.Tensor) -> Verified:
    """tokens = drafts[:n] + [final]; logprobs gathered from the processed target rows."""
    n, k1 = p.shape[0], p.shape[1]
    cols = torch.arange(k1, device=p.device)[None, :]  # [1, K+1]
    padded = torch.cat([drafts, drafts.new_zeros(n, 1)], dim=1)  # [N, K+1]
    tokens = torch.where(cols == n_acc[:, None], final[:, None], padded)
    tokens = torch.where(cols > n_acc[:, None], torch.zeros_like(tokens), tokens)
    logprobs = p.gather(2, tokens[:, :, None])[:, :, 0]
    return Verified(tokens, logprobs, n_acc)


def verify_greedy(p: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor) -> Verified:
    """Exact-match verification. `p` [N, K+1, V] processed log-probs, `drafts` [N, K], `lens` [N] (drafts per row)."""
    best = p.argmax(-1)  # [N, K+1]
    n_acc = _accepted_prefix(best[:, :-1] == drafts, lens)
    final = best.gather(1, n_acc[:, None])[:, 0]
    return _assemble(p, drafts, n_acc, final)


def verify_sampling(
    p: torch.Tensor,
    drafts: torch.Tensor,
    lens: torch.Tensor,
    accept_keys: torch.Tensor,
    residual_keys: torch.Tensor,
    sample_keys: torch.Tensor,
    q: torch.Tensor | None = None,
) -> Verified:
    """Speculative sampling (see the module docstring for the maths).

    `p` [N, K+1, V] processed target log-probs; `drafts` [N, K]; `lens` [N]; `q` [N, K, V] draft log-probs or None
    for deterministic drafts (q = delta). Keys are [N, K+1] counter-RNG keys of each emitted position: acceptance
    coins (columns < K), residual draws and bonus/plain draws."""
    n, k = drafts.shape
    rows = torch.arange(n, device=p.device)
    p_x = p[:, :k].gather(2, drafts[:, :, None])[:, :, 0].exp()  # [N, K] p_j(d_{j+1})
    q_x = q.gather(2, drafts[:, :, None])[:, :, 0].exp() if q is not None else torch.ones_like(p_x)
    u = uniforms(accept_keys[:, :k].reshape(-1), 1).view(n, k)  # one coin per draft position
    n_acc = _accepted_prefix(u * q_x < p_x, lens)  # u < p/q  <=>  accept with prob min(1, p/q)
    p_row = p[rows, n_acc]  # [N, V] distribution at the first unaccepted position
    bonus_tok = categorical(p_row, sample_keys.gather(1, n_acc[:, None])[:, 0])
    if k == 0:
        return _assemble(p, drafts, n_acc, bonus_tok)
    rejected = n_acc < lens
    residual = p_row.exp()
    if q is not None:
        residual = residual - q[rows, n_acc.clamp(max=k - 1)].exp()
    else:
        residual = residual.scatter(1, drafts.gather(1, n_acc.clamp(max=k - 1)[:, None]), 0.0)
    residual = residual.clamp_min(0.0)
    # a zero residual has probability 0 of being needed (p = q there); fall back to p to stay well defined
    empty = residual.sum(1, keepdim=True) <= 0
    residual_lp = torch.where(empty, p_row, residual.log())
    res_tok = categorical(residual_lp, residual_keys.gather(1, n_acc[:, None])[:, 0])
    final = torch.where(rejected, res_tok, bonus_tok)
    return _assemble(p, drafts, n_acc, final)
