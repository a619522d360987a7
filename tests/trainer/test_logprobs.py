"""`trainer/logprobs.py`: log-probs and entropies of chosen positions through TRL's chunked LM-head kernel, equal to
the dense `log_softmax` of the full logits (values and gradients, float32, tolerance 1e-5 relative), in one kernel
call per slice whose tiles stay within `TILE_BYTES`."""

import pytest
import torch

from trl_infinite.trainer import logprobs
from trl_infinite.trainer.logprobs import HeadSpec, selected_logprobs


def _dense(hidden, head, labels, spec):
    z = head(hidden) * spec.logit_scale
    if spec.softcap:
        z = spec.softcap * torch.tanh(z / spec.softcap)
    z = z / spec.temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_selected_logprobs_equal_the_dense_log_softmax(monkeypatch, softcap):
    torch.manual_seed(0)
    tokens, hidden_size, vocab = 37, 16, 1000
    monkeypatch.setattr(logprobs, "TILE_BYTES", 37 * 64 * 4)  # 64 vocabulary columns per tile: 16 tiles per row
    calls = []
    apply = logprobs.ChunkedLogProbFunction.apply

    def counted(hidden, weight, bias, labels, temperature, columns, *rest):
        calls.append((hidden.shape[0], columns))
        return apply(hidden, weight, bias, labels, temperature, columns, *rest)

    monkeypatch.setattr(logprobs.ChunkedLogProbFunction, "apply", counted)
    head = torch.nn.Linear(hidden_size, vocab, bias=True)
    spec = HeadSpec(temperature=0.7, softcap=softcap, logit_scale=1.3, fp32=False)
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    lp, ent = selected_logprobs(hidden, head, labels, spec, entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    got = (lp.detach(), ent.detach(), hidden.grad, head.weight.grad, head.bias.grad)
    assert calls == [(tokens, 64)]  # every position in one call (one weight gradient), tiles within TILE_BYTES
    hidden.grad = head.weight.grad = head.bias.grad = None
    lp_ref, ent_ref = _dense(hidden, head, labels, spec)
    (lp_ref.sum() + 0.5 * ent_ref.sum()).backward()
    ref = (lp_ref.detach(), ent_ref.detach(), hidden.grad, head.weight.grad, head.bias.grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_columns_bounded_by_the_tile_bytes():
    cpu = torch.device("cpu")
    assert logprobs._columns(16, 49152, 4, cpu) == 32768  # TRL's width where it fits
    assert logprobs._columns(2000, 49152, 4, cpu) == logprobs.TILE_BYTES // (2000 * 4)
    assert logprobs._columns(10**6, 49152, 4, cpu) == logprobs.TILE_BYTES // (4096 * 4)  # TRL's 4096-token chunks
    assert logprobs._columns(100, 50, 2, cpu) == 50
