"""Pure verification functions: greedy exact match, and speculative sampling reproduces p exactly."""

import torch

from trl_infinite.engine.sampler import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE, row_keys
from trl_infinite.spec_decode import verify_greedy, verify_sampling


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


def _keys(n: int, k: int, stream: int) -> torch.Tensor:
    ids = torch.arange(n)[:, None].expand(n, k + 1).reshape(-1)
    pos = torch.arange(k + 1)[None, :].expand(n, k + 1).reshape(-1)
    return row_keys(7, torch.zeros_like(ids), ids, pos, stream).view(n, k + 1)


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def test_sampling_emits_exactly_p_for_point_and_model_drafts():
    """200k independent rows; first emitted token ~ p_0, second (given d1 accepted) ~ p_1.
    Tolerance: TV < 0.01 (the sampling error of 200k draws over 6 tokens is ~0.003)."""
    n, v = 200_000, 6
    p = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -9.0], [0.0, 1.5, 0.2, 1.0, -0.5, 0.3]]), -1)
    p = torch.cat([p, p[:1]])[None].expand(n, 3, v)  # [N, K+1, V], K = 2
    keys = [_keys(n, 2, s) for s in (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE)]
    lens = torch.full((n,), 2)
    q = torch.log_softmax(torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]), -1)
    gens = [torch.Generator().manual_seed(j) for j in range(2)]
    d_model = torch.stack([torch.multinomial(q[j].exp(), n, replacement=True, generator=gens[j]) for j in range(2)], 1)
    cases = {"point": (torch.tensor([[1, 3]]).expand(n, 2), None), "model": (d_model, q[None].expand(n, 2, v))}
    for name, (drafts, qq) in cases.items():
        out = verify_sampling(p, drafts, lens, *keys, q=qq)
        first = torch.bincount(out.tokens[:, 0], minlength=v).float() / n
        assert _tv(first, p[0, 0].exp()) < 0.01, name
        cont = (out.num_accepted >= 1) & (out.tokens[:, 0] == drafts[:, 0])
        second = torch.bincount(out.tokens[cont, 1], minlength=v).float() / cont.sum()
        if name == "point":  # given d1 = 1 accepted, the next token's law is p_1
            assert _tv(second, p[0, 1].exp()) < 0.01, name
        assert 0 < out.num_accepted.float().mean() < 2
        assert torch.allclose(out.logprobs[:, 0], p[0, 0][out.tokens[:, 0]])
