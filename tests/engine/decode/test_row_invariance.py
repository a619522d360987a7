"""A row's logits do not depend on how many rows share its forward, nor on the path (CPU, float32).

The promise "a seed's samples are the same with and without speculation, in every sampling mode and schedule" rests
on it: at temperature 1 a near-tie of the inverse CDF flips on the last bit of a logit (issue #40: SmolLM2-135M, 2
to 8 of 64 samples changed by speculation before this). `model_runner.ROW_MULTIPLE` gives every CPU forward a
multiple of 4 rows; the verification forward runs its query tokens as decode rows (`spec_decode/step.py`).

- This machine's BLAS: a Linear's row is bit-identical at every row count that is a multiple of `ROW_MULTIPLE`
  (1 and 2 threads, the tiny models' and SmolLM2-135M's shapes), and is not at some other counts (so the padding is
  what makes the engine row-invariant, and this test notices a BLAS where it would be unnecessary or insufficient).
- Engine paths on a tiny Llama whose attention the C++ decode kernel serves: the logits of a sample's positions are
  bit-identical through the plain decode step at 1..9 rows, through the static step's forward, through one
  verification forward of all positions (the speculative step's segments), and inside a verification forward of
  several samples; the first token's logits (prefill) are the same with 1, 2 or 3 prompts in the forward.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from _models import tiny_model

from trl_infinite import EngineConfig, RolloutEngine
from trl_infinite.engine.attention import Segment, cpu_decode, decode_metadata
from trl_infinite.engine.runner.model_runner import ROW_MULTIPLE
from trl_infinite.engine.spec_decode.step import _as_decode_rows

SHAPES = [(64, 64), (64, 1000), (576, 192), (1536, 576), (576, 49152)]  # tiny Llama's, SmolLM2-135M's


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_rows_are_invariant_at_multiples_of_row_multiple(shape, threads):
    gen = torch.Generator().manual_seed(0)
    k, n = shape
    w = torch.randn(n, k, generator=gen) / k**0.5
    x = torch.randn(40, k, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref = F.linear(x, w)
        for m in range(ROW_MULTIPLE, 41, ROW_MULTIPLE):
            assert torch.equal(F.linear(x[:m], w), ref[:m]), f"{m} rows"
        # without the padding rows would differ: one row (matrix-vector) is not what 4+ rows compute
        assert not torch.equal(F.linear(x[:1], w), ref[:1])
    finally:
        torch.set_num_threads(before)


P, K, BLOCK = 13, 6, 4


def _runner():
    if shutil.which("ninja") is None:
        pytest.skip("the CPU decode kernel needs ninja to build")
    model = tiny_model("llama", hidden_size=64, vocab_size=1000)  # head dim 16: the C++ decode kernel serves
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=1024, block_size=BLOCK))
    engine.pool.open(200)
    runner = engine.runner
    assert runner.row_multiple == ROW_MULTIPLE and runner.decode_kernel_everywhere and cpu_decode.build()
    return runner


@torch.no_grad()
def test_decode_verify_and_row_counts_give_bit_identical_logits():
    runner = _runner()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 1000, (P,), generator=gen).tolist()
    cont = torch.randint(3, 1000, (K,), generator=gen).tolist()
    prompt_blocks = [1, 2, 3, 4]
    own = [[10 + 2 * r, 11 + 2 * r] for r in range(9)]  # nine samples with the same tokens, own blocks each

    def fwd(segments, rows):
        return runner.forward(segments, torch.as_tensor(rows))[0]

    first = fwd([Segment(P, prompt_blocks, [], 0, prompt)], [P - 1])
    for blocks in own:  # every sample's own KV (the same values: same tokens, same row-invariant forward)
        fwd(_as_decode_rows([Segment(P, prompt_blocks, blocks, P, cont)]), range(K))
    # the plain decode step at 1 row, position by position
    decode = torch.stack([fwd([Segment(P, prompt_blocks, own[0], P + j, [cont[j]])], [0])[0] for j in range(K)])
    for n in range(2, 10):  # ... at n rows: row 0 and row n-1
        for j in range(K):
            out = fwd([Segment(P, prompt_blocks, own[r], P + j, [cont[j]]) for r in range(n)], range(n))
            assert torch.equal(out[0], decode[j]) and torch.equal(out[n - 1], decode[j]), (n, j)
    # the static step's forward (decode metadata from device tables, rows padded to a bucket)
    for j in range(K):
        rows = 8
        meta = decode_metadata(torch.full((rows,), P + j), torch.full((rows,), P),
                               torch.tensor([prompt_blocks] * rows), torch.tensor(own[:rows]), torch.zeros(rows, dtype=torch.long),
                               BLOCK)
        with runner.routed():
            static = runner.run(torch.full((1, rows), cont[j]), torch.full((1, rows), P + j), meta, 0)[0]
        assert torch.equal(static[3], decode[j]), j
    # one verification forward of all K positions (the speculative step's segments), alone and beside other samples
    verify = fwd(_as_decode_rows([Segment(P, prompt_blocks, own[1], P, cont)]), range(K))
    assert torch.equal(verify, decode)
    several = _as_decode_rows([Segment(P, prompt_blocks, own[2], P, cont[:3]), Segment(P, prompt_blocks, own[3], P, cont),
                               Segment(P, prompt_blocks, own[4], P + 2, cont[2:5])])
    out = fwd(several, range(len(several)))
    assert torch.equal(out[:3], decode[:3]) and torch.equal(out[3:9], decode) and torch.equal(out[9:], decode[2:5])
    # the multi-query forward the verification ran before (one segment of K tokens) does differ on this model,
    # which is why verification runs decode rows
    multi = fwd([Segment(P, prompt_blocks, own[5], P, cont)], range(K))
    assert not torch.equal(multi, decode)
    # prefill: the first token's logits with 1, 2 or 3 prompts in the forward
    other = torch.randint(3, 1000, (2 * P + 3,), generator=gen).tolist()
    pair = fwd([Segment(P, prompt_blocks, [], 0, prompt), Segment(len(other), [30, 31, 32, 33, 34, 35, 36, 37], [], 0,
                                                                 other)], [P - 1, P + len(other) - 1])
    assert torch.equal(pair[0], first[0])
