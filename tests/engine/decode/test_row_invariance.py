"""A row's logits do not depend on how many rows share its forward, nor on the path (CPU, float32).

The promise "a seed's samples are the same with and without speculation, in every sampling mode and schedule" rests
on it: at temperature 1 a near-tie of the inverse CDF flips on the last bit of a logit (issue #40: SmolLM2-135M, 2
to 8 of 64 samples changed by speculation before this). Each runner derives on the machine the row counts its BLAS
gives a row the same bits at (`runner/row_plan.py`); the verification forward runs its query tokens as decode rows
(`spec_decode/step.py`).

- The plan derived on this machine, at 1 and 2 threads, for the tiny models' and SmolLM2-135M's shapes: through the
  plan (padding to its multiple, chunks past each product's cap) a row is bit-identical at every row count from 1
  to past the probe's limit.
- The probe itself, on products whose rows change with the count in known ways (a stand-in BLAS): it finds the
  multiple and the cap that avoid the change, and warns and falls back where no candidate works.
- Engine paths on a tiny Llama and on a 2-layer Llama of SmolLM2-135M's shapes, whose attention the C++ decode kernel
  serves: the logits of a sample's positions are bit-identical through the plain decode step at 1..9, 16, 24 and 64
  rows, through the static step's forward (buckets of 8 and 64 rows), through one verification forward of all
  positions (the speculative step's segments), and inside a verification forward of several samples; the first
  token's logits (prefill) are the same alone and beside a 100-token prompt.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from _models import tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.attention import Segment, cpu_decode, decode_metadata
from trl_infinite.engine.runner import row_plan
from trl_infinite.engine.runner.model_runner import padded_count
from trl_infinite.engine.runner.row_plan import derive_plan
from trl_infinite.engine.spec_decode.step import _as_decode_rows

SHAPES = [(64, 64), (64, 1000), (576, 192), (1536, 576), (576, 49152)]  # tiny Llama's, SmolLM2-135M's
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               vocab_size=49152, num_hidden_layers=2, tie_word_embeddings=True)


@torch.no_grad()
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_are_invariant_at_every_count_through_the_derived_plan(shape, threads):
    k, n = shape
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False)
    most = 130 if k * n > 2**24 else 300  # past the probe's limit for the small shapes: their chunks run too
    x = torch.randn(most, k, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan = derive_plan(torch.nn.Sequential(linear))
        assert plan.row_invariant and plan.threads == threads
        m = plan.multiple
        padded = torch.cat([x, x[: m - 1]]) if m > 1 else x

        def rows(count):  # what the engine computes for the first `count` rows: padded, through the plan
            c = padded_count(count, m)
            with plan.split(c):
                return linear(padded[:c])[:count]

        ref = rows(most)
        for count in [1, *range(m, most + 1, m)]:  # every count the engine can issue (others pad to these)
            assert torch.equal(rows(count), ref[:count]), f"{count} rows (multiple {m}, cap {plan.capped[0][1]})"
    finally:
        torch.set_num_threads(before)


class _CountDependent(torch.nn.Linear):
    """A stand-in BLAS: a product each row of which is one reduction of its own (the same bits at any row count),
    plus one part in 1e6 on the rows where `differs(rows, position)` says so. (The plan takes exact `nn.Linear`
    types only, so the tests below add this one to them.)"""

    def __init__(self, differs):
        super().__init__(16, 8, bias=False)
        self.differs = differs

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        out = (flat[:, None, :] * self.weight[None]).sum(-1)
        bump = torch.tensor([1e-6 if self.differs(flat.shape[0], i) else 0.0 for i in range(flat.shape[0])])
        return (out * (1 + bump[:, None])).reshape(*x.shape[:-1], -1)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(row_plan, "_row_types", lambda: (torch.nn.Linear, _CountDependent))
    monkeypatch.setattr(row_plan, "_PROBED", {})


@pytest.mark.parametrize("differs, multiple, cap", [
    (lambda rows, i: False, 1, row_plan.MAX_PROBE_ROWS),  # every count the same (MKL_CBWR=AUTO,STRICT)
    (lambda rows, i: rows % 8 != 0, 8, row_plan.MAX_PROBE_ROWS),  # another kernel where the count is not a multiple of 8
    (lambda rows, i: rows < 16, 16, row_plan.MAX_PROBE_ROWS),  # few rows: a narrower kernel
    (lambda rows, i: rows < 4 or 40 < rows < 200, 4, 40),  # from 4 rows on, another split between 41 and 199 rows
    (lambda rows, i: rows % 2 or 64 < rows, 2, 64),  # odd counts, and past 64 rows another split
], ids=["none", "mod8", "few", "band", "odd-and-many"])
def test_probe_finds_the_multiple_and_cap(stand_in, differs, multiple, cap):
    plan = derive_plan(torch.nn.Sequential(_CountDependent(differs)))
    assert plan.row_invariant and plan.multiple == multiple and plan.capped[0][1] == cap
    # and the plan's own computation of any count agrees with the rows computed `multiple` at a time
    module, x = plan.capped[0][0], torch.randn(300, 16)
    alone = torch.cat([module(x[i:i + multiple]) for i in range(0, 300, multiple)])
    for count in range(multiple, 301, multiple):
        with plan.split(count):
            assert torch.equal(module(x[:count]), alone[:count]), count


def test_probe_warns_and_falls_back_where_no_multiple_works(stand_in):
    position = _CountDependent(lambda rows, i: i == 0)  # the first row of every product: no count helps
    with pytest.warns(UserWarning, match="other bits at other row counts"):
        plan = derive_plan(torch.nn.Sequential(position))
    assert not plan.row_invariant and plan.multiple == row_plan.FALLBACK_MULTIPLE and plan.capped == ()


def test_subclasses_with_their_own_forward_are_left_alone():
    router = _CountDependent(lambda rows, i: False)  # an `nn.Linear` subclass (as Llama 4's router, returning a tuple)
    plan = derive_plan(torch.nn.Sequential(torch.nn.Linear(16, 8), router))
    assert [type(m) for m, _ in plan.capped] == [torch.nn.Linear]


@pytest.mark.parametrize("multiple", [1, 4, 16])
def test_chunks_are_few_even_and_within_the_cap(multiple):
    for cap in range(multiple, 9 * multiple, multiple):
        for rows in range(multiple, 40 * multiple, multiple):
            sizes = row_plan.chunk_sizes(rows, cap, multiple)
            assert sum(sizes) == rows and len(sizes) == -(-rows // cap), (rows, cap)
            assert all(s % multiple == 0 and 0 < s <= cap for s in sizes) and max(sizes) - min(sizes) <= multiple


def test_split_restores_the_forward_it_found():
    linear = torch.nn.Linear(16, 8)
    hooked = []
    linear.forward = lambda x, own=linear.forward: hooked.append(x.shape[0]) or own(x)  # as accelerate's hooks do
    wrapper = linear.forward
    plan = row_plan.RowPlan(1, torch.get_num_threads(), ((linear, 4),))
    with plan.split(10):
        out = linear(torch.ones(10, 16))
    assert out.shape == (10, 8) and hooked == [4, 3, 3] and linear.forward is wrapper
    plain = torch.nn.Linear(16, 8)
    with row_plan.RowPlan(1, 1, ((plain, 4),)).split(10):
        assert "forward" in plain.__dict__
    assert "forward" not in plain.__dict__


P, K, BLOCK = 13, 6, 4


def _runner(shapes):
    if shutil.which("ninja") is None:
        pytest.skip("the CPU decode kernel needs ninja to build")
    model = tiny_model("llama", **shapes)  # head dim 16 / 64: the C++ decode kernel serves
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=1024, block_size=BLOCK))
    engine.pool.open(200)
    runner = engine.runner
    assert runner.row_plan.row_invariant and runner.decode_kernel_everywhere and cpu_decode.build()
    return runner


@torch.no_grad()
@pytest.mark.parametrize("shapes", [dict(hidden_size=64, vocab_size=1000), SMOLLM2], ids=["tiny", "smollm2"])
def test_decode_verify_and_row_counts_give_bit_identical_logits(shapes):
    runner = _runner(shapes)
    vocab = shapes["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, vocab, (P,), generator=gen).tolist()
    cont = torch.randint(3, vocab, (K,), generator=gen).tolist()
    prompt_blocks = [1, 2, 3, 4]
    own = [[10 + 2 * r, 11 + 2 * r] for r in range(64)]  # 64 samples with the same tokens, own blocks each

    def fwd(segments, rows):
        return runner.forward(segments, torch.as_tensor(rows))[0]

    first = fwd([Segment(P, prompt_blocks, [], 0, prompt)], [P - 1])
    for blocks in own:  # every sample's own KV (the same values: same tokens, same row-invariant forward)
        fwd(_as_decode_rows([Segment(P, prompt_blocks, blocks, P, cont)]), range(K))
    # the plain decode step at 1 row, position by position
    decode = torch.stack([fwd([Segment(P, prompt_blocks, own[0], P + j, [cont[j]])], [0])[0] for j in range(K)])
    for n in [*range(2, 10), 16, 24, 64]:  # ... at n rows (past the BLAS's kernel switches): row 0 and row n-1
        for j in range(K):
            out = fwd([Segment(P, prompt_blocks, own[r], P + j, [cont[j]]) for r in range(n)], range(n))
            assert torch.equal(out[0], decode[j]) and torch.equal(out[n - 1], decode[j]), (n, j)
    # the static step's forward (decode metadata from device tables, rows padded to a bucket)
    for j, bucket in zip(range(K), [8, 64] * K):
        rows = padded_count(bucket, runner.row_multiple)  # a bucket of the static step
        meta = decode_metadata(torch.full((rows,), P + j), torch.full((rows,), P), torch.tensor([prompt_blocks] * rows),
                               torch.tensor([own[r % len(own)] for r in range(rows)]),
                               torch.zeros(rows, dtype=torch.long), BLOCK)
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
    # the multi-query forward the verification ran before (one segment of K tokens) does differ on the tiny model,
    # which is why verification runs decode rows
    multi = fwd([Segment(P, prompt_blocks, own[5], P, cont)], range(K))
    assert vocab != 1000 or not torch.equal(multi, decode)
    # prefill: the first token's logits with 1 or 2 prompts in the forward
    other = torch.randint(3, vocab, (100,), generator=gen).tolist()  # past the kernel switches too
    pair = fwd([Segment(P, prompt_blocks, [], 0, prompt), Segment(len(other), list(range(150, 175)), [], 0, other)],
               [P - 1, P + len(other) - 1])
    assert torch.equal(pair[0], first[0])


def test_the_runner_plans_the_model_as_it_is_at_each_call():
    model = tiny_model("llama")
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256))
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
    engine.generate([[5, 6, 7]], 1, sampling)
    old = model.lm_head
    model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=False)  # a head replaced between calls
    model.lm_head.weight.data.copy_(old.weight.data)
    engine.generate([[5, 6, 7]], 1, sampling)
    planned = [m for m, _ in engine.runner.row_plan.capped]
    assert any(m is model.lm_head for m in planned) and not any(m is old for m in planned)
