"""Pure verification functions: greedy exact match; sampling emits plain sampling's own draws (identity), which
is rejection sampling's law for point-mass drafts."""

import torch

from trl_infinite.engine.runner.sampler import STREAM_SAMPLE, categorical, row_keys
from trl_infinite.engine.sched.batch import INVALID_TOKEN
from trl_infinite.engine.spec_decode import verify_greedy, verify_sampling


def test_greedy_accepts_matching_prefix_and_emits_target_argmax():
    p = torch.log_softmax(torch.tensor([[[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]]]), -1)  # argmax 1,2,0
    out = verify_greedy(p, torch.tensor([[1, 0]]), torch.tensor([2]))
    assert out.num_accepted.tolist() == [1]
    assert out.tokens[0, :2].tolist() == [1, 2]  # d1 accepted, d2 rejected -> argmax of p_1
    all_ok = verify_greedy(p, torch.tensor([[1, 2]]), torch.tensor([2]))
    assert all_ok.tokens[0].tolist() == [1, 2, 0] and all_ok.num_accepted.tolist() == [2]  # bonus token
    assert torch.allclose(all_ok.logprobs[0], p[0, [0, 1, 2], [1, 2, 0]])
    none = verify_greedy(p, torch.tensor([[1, 2]]), torch.tensor([0]))  # no drafts: plain greedy step
    assert none.tokens[0, 0].item() == 1 and none.num_accepted.item() == 0


def _keys(n: int, k: int, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    ids = torch.arange(n)[:, None].expand(n, k + 1).reshape(-1)
    pos = torch.arange(k + 1)[None, :].expand(n, k + 1).reshape(-1)
    return row_keys(7, torch.zeros_like(ids), ids, pos, stream).view(n, k + 1)


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def test_sampling_emits_the_plain_draws_whatever_the_drafts():
    """Identity: row i emits exactly the inverse-CDF draws plain sampling makes at its positions (same uniforms),
    accepting the leading drafts equal to them; right drafts, wrong drafts and no drafts give the same tokens."""
    n, v = 4000, 6
    p = torch.log_softmax(torch.randn(n, 3, v, generator=torch.Generator().manual_seed(0)) * 2, -1)  # [N, K+1, V]
    keys = _keys(n, 2)
    plain = torch.stack([categorical(p[:, j], keys[:, j]) for j in range(3)], 1)  # [N, 3]
    wrong = (plain[:, :2] + 1) % v
    mixed = torch.where(torch.rand(n, 2, generator=torch.Generator().manual_seed(1)) < 0.5, plain[:, :2], wrong)
    for drafts, lens in ((plain[:, :2], 2), (wrong, 2), (mixed, 2), (wrong, 0)):
        out = verify_sampling(p, drafts, torch.full((n,), lens), keys)
        m = out.num_accepted
        for j in range(3):
            emitted = m >= j
            assert torch.equal(out.tokens[emitted, j], plain[emitted, j])
        accept = (drafts == plain[:, :2]).long().cumprod(1).sum(1).clamp_max(lens)
        assert torch.equal(m, accept)
        assert torch.allclose(out.logprobs[:, 0], p[:, 0].gather(1, plain[:, :1])[:, 0])


def test_point_draft_accepted_with_probability_p_and_residual_law():
    """A point-mass draft x is accepted with probability p(x), and on rejection the token follows p without x,
    renormalised (rejection sampling's law), over 200k rows. Tolerance: 0.01 (sampling error ~0.003)."""
    n, v = 200_000, 6
    p = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -9.0], [0.0, 1.5, 0.2, 1.0, -0.5, 0.3]]), -1)
    p = p[None].expand(n, 2, v)  # [N, K+1, V], K = 1
    out = verify_sampling(p, torch.ones(n, 1, dtype=torch.long), torch.ones(n, dtype=torch.long), _keys(n, 1))
    pr = p[0, 0].exp()
    assert abs(out.num_accepted.float().mean().item() - pr[1].item()) < 0.01
    rejected = out.num_accepted == 0
    law = torch.bincount(out.tokens[rejected, 0], minlength=v).float() / rejected.sum()
    residual = pr.clone()
    residual[1] = 0
    assert _tv(law, residual / residual.sum()) < 0.01
    assert (out.tokens[rejected, 0] != 1).all()
    accepted_next = torch.bincount(out.tokens[~rejected, 1], minlength=v).float() / (~rejected).sum()
    assert _tv(accepted_next, p[0, 1].exp()) < 0.01


def test_non_finite_rows_emit_the_invalid_token():
    p = torch.log_softmax(torch.randn(2, 2, 5), -1)
    p[1, 0] = float("nan")
    out = verify_sampling(p, torch.tensor([[0], [0]]), torch.tensor([1, 1]), _keys(2, 1))
    assert out.tokens[1, 0].item() == INVALID_TOKEN and out.num_accepted[1].item() == 0
    assert out.tokens[0, 0].item() >= 0
