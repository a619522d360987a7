"""Verification of speculative drafts by identity with plain decoding (pure functions, batched, no host sync).

Notation, per sample row: the verification forward gives the *processed* target distributions `p_0 .. p_k`
(repetition penalty, temperature, top-k, top-p, min-p already applied by `Sampler.process`; `p_j` is the
distribution of the token at the j-th emitted position, conditioned on the context plus drafts `d_1 .. d_j`), and
the drafter proposed `d_1 .. d_k` (row `j` of `drafts` is `d_{j+1}`, verified against `p_j`).

Plain decoding emits at each position the token `y_j = F_j^{-1}(U_j)`: greedy `y_j = argmax p_j`, sampling the
inverse-CDF draw of `Sampler` with the uniform `U_j` keyed by (seed, prompt, sample, position) (`STREAM_SAMPLE`).
Verification computes the same `y_0 .. y_k` from the same distributions and the same uniforms, accepts the drafts
while `d_{j+1} = y_j`, and emits `y_0 .. y_n` (n = drafts accepted): exactly the tokens plain decoding emits, token
for token, whatever the drafter proposed and however many drafts the adaptive controller asked for. A seed's samples
are the same with and without speculation: bit for bit on CPU in float32, where the verification forward computes
each row's logits exactly as the plain step does (`step._as_decode_rows`, `row_plan.RowPlan`); elsewhere
up to the rounding of the verification forward against the plain step's (the same distribution; docs/speculative.md).

Distribution: the output is plain decoding's, so its law is `p`. For a deterministic draft `x` (suffix tree, n-gram,
history: `q = delta_x`) the acceptance probability is `P(F^{-1}(U) = x) = p(x)`, the acceptance probability of
rejection sampling (`min(1, p(x) / q(x))`), and on rejection the token is `y ~ p` given `y != x`, i.e. the residual
`(p - q)_+` normalised: the same joint law as speculative sampling (Leviathan et al. 2023, Chen et al. 2023), with
the coins chosen so that it coincides with plain sampling. A draft model draws its tokens by inverse CDF of its own
`q` with the *same* uniform `U_j` (`draft_model.py`), so it is accepted when both inverse CDFs land on the same token
(likely when `q` is close to `p`); what is kept is identity with plain decoding (hence the law `p`), at an acceptance
rate of `P(F_q^{-1}(U) = F_p^{-1}(U))` instead of rejection sampling's `sum_x min(p(x), q(x))`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_infinite.engine.runner.sampler import categorical
from trl_infinite.engine.sched.batch import INVALID_TOKEN


@dataclass
class Verified:
    """Result of verifying one batch of drafts. Row i emits `tokens[i, : num_accepted[i] + 1]`."""

    tokens: torch.Tensor  # [N, K+1] accepted drafts then the correction/bonus token (padding after)
    logprobs: torch.Tensor  # [N, K+1] log p_j(token_j) of the processed target distribution
    num_accepted: torch.Tensor  # [N]


def plain_tokens(p: torch.Tensor, sample_keys: torch.Tensor | None) -> torch.Tensor:
    """[N, K+1] the tokens plain decoding emits from `p` [N, K+1, V]: argmax (`sample_keys` None) or the inverse-CDF
    draw with `sample_keys` [N, K+1]. `INVALID_TOKEN` where `p_j` is not finite (NaN row, see `Sampler.sample`)."""
    n, k1, v = p.shape
    flat = p.reshape(n * k1, v)
    y = flat.argmax(-1) if sample_keys is None else categorical(flat, sample_keys.reshape(-1))
    y = torch.where(flat[:, 0].isnan(), INVALID_TOKEN, y.clamp_max(v - 1))
    return y.view(n, k1)


def verify(p: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor, sample_keys: torch.Tensor | None = None,
           ) -> Verified:
    """Identity verification (module docstring). `p` [N, K+1, V] processed target log-probs, `drafts` [N, K],
    `lens` [N] drafts per row, `sample_keys` [N, K+1] the `STREAM_SAMPLE` keys of the emitted positions (None:
    greedy)."""
    k1 = p.shape[1]
    y = plain_tokens(p, sample_keys)  # [N, K+1]
    cols = torch.arange(k1, device=p.device)[None, :]
    # drafts accepted: the leading run of `d_{j+1} = y_j`, limited to the row's `lens` drafts
    n_acc = torch.cumprod(((y[:, :-1] == drafts) & (cols[:, :-1] < lens[:, None])).long(), dim=1).sum(1)
    tokens = torch.where(cols <= n_acc[:, None], y, torch.zeros_like(y))  # [N, K+1]: y_0 .. y_n, then padding
    logprobs = p.gather(2, tokens.clamp_min(0)[:, :, None])[:, :, 0]
    return Verified(tokens, logprobs, n_acc)


# the exported names of the two cases: against argmax decoding (no keys) and against plain sampling (`sample_keys`)
verify_greedy = verify_sampling = verify
