"""The static decode step: persistent rows, padded buckets, compiled with `torch.compile(fullgraph=True)`.

- `DecodeRows` keeps rows dense and its device tables equal to what the host-built metadata of the same samples
  says (slots of every token, context columns), across joins, finishes, block growth and replaced block lists.
- Greedy output with `compile=True` (inductor) is token-identical to `model.generate` (Llama, Qwen3), and still
  after the parameters are updated between calls, in place or into new storage.
- Compiled with the `eager` backend (same tracing, no code generation: fast), the step has no graph break, and
  exactly one graph per batch bucket: no recompilation while rows finish and join over 50+ steps in one bucket,
  nor in a second call with a new seed and other lengths.
- On CUDA (skipped elsewhere): CUDA graphs on and off give identical greedy output.
- A step that asks for hidden states finds transformers' output-capturing hooks installed before it runs (Dynamo
  cannot trace their lazy installation): on exactly the modules a first eager forward asking for them hooks, once,
  and not on a model the text forward does not run (Gemma 3's vision tower).
"""

from __future__ import annotations

import random

import pytest
import torch
from _models import frequent_token, reference_greedy, requires_compile, tiny_model
from torch._dynamo.utils import counters

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.attention import Segment, build_metadata, decode_metadata, with_context
from trl_infinite.engine.decode.output_capture import install_capturing_hooks, maybe_install_capturing_hooks
from trl_infinite.engine.decode.rows import DecodeRows
from trl_infinite.engine.decode.static import bucket_sizes
from trl_infinite.engine.model.support import check_support
from trl_infinite.engine.sched.sequence import make_group
from trl_infinite.testing.tiny_configs import build_tiny_model

BLOCK = 4


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert bucket_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]


def _sample(group_id: int, prompt_len: int, prompt_blocks: list[int], out: list[int], blocks: list[int]):
    group = make_group(group_id, list(range(3, 3 + prompt_len)), 2, 64)
    group.prompt_blocks.extend(prompt_blocks)
    seq = group.samples[0]
    seq.output_ids.extend(out)
    seq.blocks.extend(blocks)
    return seq


def _check_rows_match_host_metadata(rows: DecodeRows, seqs, grown=(), rebuilt=()):
    """Real rows' decode metadata equals the host-built metadata of the same samples (slots, context columns)."""
    n = len(seqs)
    row_of = rows.update(seqs, grown, rebuilt)
    assert sorted(row_of) == list(range(n))
    pcols, ocols = rows.max_prompt_blocks, rows.max_own_blocks
    meta = decode_metadata(rows.inputs[1, :n], rows.prompt_len[:n], rows.prefix_table[:n, :pcols],
                           rows.suffix_table[:n, :ocols], rows.group[:n], BLOCK)
    ordered = sorted(seqs, key=lambda s: row_of[seqs.index(s)])
    segs = [Segment(s.prompt_len, s.group.prompt_blocks, s.blocks, s.num_tokens - 1, [s.output_ids[-1]], s.group_id)
            for s in ordered]
    ids, pos, ref = build_metadata(segs, BLOCK, torch.device("cpu"))
    assert rows.inputs[0, :n].tolist() == ids[0].tolist() and rows.inputs[1, :n].tolist() == pos[0].tolist()
    assert torch.equal(meta.slot_mapping, ref.slot_mapping)
    got, want = with_context(meta, ()).context, with_context(ref, ()).context
    valid = want.masks[(None, None)] == 0
    assert torch.equal(got.masks[(None, None)] == 0, valid)  # the same columns are visible ...
    assert torch.equal(got.slots.view(n, -1)[valid[:, 0, 0]], want.slots.view(n, -1)[valid[:, 0, 0]])  # ... same slots
    _check_group_slots(rows, seqs, row_of)


def _check_group_slots(rows: DecodeRows, seqs, row_of):
    """Rows share a group slot iff they share a group; the slot's prompt table is the group's prompt blocks."""
    slot = {s.seq_id: rows.group_slot[r].item() for s, r in zip(seqs, row_of)}
    for s in seqs:
        blocks = s.group.prompt_blocks
        assert rows.group_prefix[slot[s.seq_id], : len(blocks)].tolist() == blocks
        for t in seqs:
            assert (slot[s.seq_id] == slot[t.seq_id]) == (s.group_id == t.group_id)
    assert rows.group_slots_used == max(slot.values(), default=-1) + 1


def _step(rows: DecodeRows, seqs, tokens):
    """What the static step does for the next one: each row's sampled token becomes its input, position + 1."""
    for s, t in zip(seqs, tokens):
        r = rows.row_of[s.seq_id]
        rows.inputs[0, r], rows.inputs[1, r] = t, rows.inputs[1, r] + 1
        s.output_ids.append(t)


def test_decode_rows_follow_joins_finishes_and_growth():
    rows = DecodeRows(8, 4, 4, BLOCK, null_block=99, device=torch.device("cpu"), vocab=None)
    a = _sample(0, 6, [1, 2], [7, 8], [10])
    b = _sample(0, 6, [1, 2], [9], [11])
    c = _sample(1, 3, [3], [5, 5, 5, 5, 6], [12, 13])
    _check_rows_match_host_metadata(rows, [a, b, c])
    _step(rows, [a, b, c], [1, 2, 3])
    _step(rows, [a, b, c], [1, 2, 3])
    a.blocks.append(14)  # a grows into a second own block (the scheduler reports it in `grown`)
    _check_rows_match_host_metadata(rows, [a, b, c], grown=[a])
    d = _sample(2, 9, [4, 5, 6], [2], [15])
    _check_rows_match_host_metadata(rows, [c, d])  # a and b finished: c and d fill rows 0 and 1
    assert rows.num_rows == 2 and rows.prompt_len[2:].tolist() == [0] * 6  # padding rows are reset ...
    assert (rows.suffix_table[2:] == 99).all() and (rows.group[2:] == -1).all()  # ... to the null block
    c.blocks = [20, 21]  # preempted and re-admitted with a recompute: a new block list, the row is rewritten
    _check_rows_match_host_metadata(rows, [d, c], rebuilt=[c])
    assert rows.max_own_blocks == 2 and rows.max_prompt_blocks == 3


def test_group_slots_are_reused_lowest_first():
    rows = DecodeRows(8, 4, 4, BLOCK, null_block=99, device=torch.device("cpu"), vocab=None)
    g0 = [_sample(0, 5, [1, 2], [7], [10]), _sample(0, 5, [1, 2], [7], [11])]
    g1, g2 = [_sample(1, 3, [3], [7], [12])], [_sample(2, 4, [4], [7], [13])]
    rows.update(g0 + g1 + g2)
    assert [rows.group_slot[rows.row_of[s.seq_id]].item() for s in g0 + g1 + g2] == [0, 0, 1, 2]
    g3 = [_sample(3, 6, [5, 6], [7], [14])]
    row_of = rows.update(g0 + g2 + g3)  # group 1 left: its slot is the lowest free one, group 3 takes it
    assert rows.group_slot[rows.row_of[g3[0].seq_id]].item() == 1 and rows.group_prefix[1, :2].tolist() == [5, 6]
    _check_group_slots(rows, g0 + g2 + g3, row_of)
    row_of = rows.update(g0 + g3)  # the highest slot freed: the used range shrinks
    assert rows.group_slots_used == 2
    _check_group_slots(rows, g0 + g3, row_of)
    rows.clear()
    assert rows.group_slots_used == 0


def test_seen_rows_mark_prompt_and_outputs():
    rows = DecodeRows(4, 2, 2, BLOCK, null_block=99, device=torch.device("cpu"), vocab=16)
    a = _sample(0, 3, [1], [9], [2])  # prompt 3, 4, 5
    rows.update([a])
    assert rows.seen[0].nonzero()[:, 0].tolist() == [3, 4, 5, 9]


@requires_compile
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_greedy_is_token_identical(arch):
    model = tiny_model(arch)
    prompts = [[5, 17, 33, 8, 60, 2, 9], [11, 4, 70]]
    eos = frequent_token(model, prompts)
    refs = [reference_greedy(model, p, 12, [eos]) for p in prompts]
    # one slot: every step is the 1-row bucket, so one compilation (inductor's C++ build is the slow part)
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=1, kv_cache_tokens=512, block_size=BLOCK,
                       compile=True)
    res = RolloutEngine(model, cfg).generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                        eos_token_ids=[eos]))
    assert res.completion_ids == [r for r in refs for _ in range(2)]
    assert any(len(r) < 12 for r in refs)  # the early EOS is exercised


@requires_compile
def test_compiled_step_has_no_graph_break_and_one_graph_per_bucket():
    model = tiny_model("qwen3")
    rng = random.Random(0)
    lengths = [[rng.randint(4, 14) for _ in range(40)]]
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=4, kv_cache_tokens=1024, block_size=BLOCK,
                       compile=True, compile_backend="eager")
    engine = RolloutEngine(model, cfg)
    sampling = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=1)
    torch._dynamo.reset()
    counters.clear()
    res = engine.generate([[5, 6, 7, 8, 9, 10]], 40, sampling, forced_lengths=lengths)
    assert [len(c) for c in res.completion_ids] == lengths[0]
    assert res.stats.decode_steps >= 60 and res.stats.peak_active_sequences == 4  # >50 steps at 4 rows, slots refilled
    assert not counters["graph_break"]
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= len(bucket_sizes(4))  # one per padded batch size that occurred, no more
    other = [[rng.randint(2, 14) for _ in range(40)]]
    engine.generate([[9, 8, 7]], 40, SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9,
                                                    repetition_penalty=1.1, seed=2), forced_lengths=other)
    assert counters["stats"]["unique_graphs"] <= len(bucket_sizes(4))  # new seed, prompt, lengths: no new graph
    assert not counters["graph_break"]


def _capture_hooks(model) -> tuple[dict, set]:
    """(forward hooks per module name, names of the models marked as hooked)."""
    return ({n: len(m._forward_hooks) for n, m in model.named_modules() if m._forward_hooks},
            {n for n, m in model.named_modules() if getattr(m, "_output_capturing_hooks_installed", False)})


@pytest.mark.skipif(maybe_install_capturing_hooks is None, reason="this transformers installs no capture hooks lazily")
@pytest.mark.parametrize("model_type", ["qwen3", "gemma3"])
def test_capture_hooks_installed_where_a_first_eager_forward_puts_them(model_type):
    lazy, eager = build_tiny_model(model_type), build_tiny_model(model_type)
    with torch.no_grad():
        lazy(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    models = check_support(eager).capture_models
    install_capturing_hooks(models)
    install_capturing_hooks(models)  # once only
    assert _capture_hooks(eager) == _capture_hooks(lazy)
    assert _capture_hooks(eager)[0]  # there were hooks to install
    with torch.no_grad():  # transformers' own lazy installation adds none
        eager(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert _capture_hooks(eager) == _capture_hooks(lazy)


@requires_compile
@pytest.mark.parametrize("update", ["in_place", "new_storage"])
def test_compiled_step_reads_updated_parameters(update):
    """Between calls the parameters change as in training: in place (an optimizer step, the compiled bytecode keeps
    being called without guards) or into new storage (ZeRO-3 / FSDP gathers, the full guard check is re-armed).
    Greedy output follows `model.generate` of the updated model, and the update did change it."""
    model = tiny_model("qwen3")
    prompts = [[5, 17, 33, 8, 60, 2, 9], [11, 4, 70]]
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=2, kv_cache_tokens=512, block_size=BLOCK,
                       compile=True, compile_backend="eager")
    engine = RolloutEngine(model, cfg)
    sampling = SamplingParams(max_new_tokens=10, temperature=0.0)
    before = engine.generate(prompts, 1, sampling).completion_ids
    assert before == [reference_greedy(model, p, 10, []) for p in prompts]
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn_like(p) * 0.5
            if update == "in_place":
                p.add_(noise)
            else:
                p.data = p.data + noise
    after = engine.generate(prompts, 1, sampling).completion_ids
    assert after == [reference_greedy(model, p, 10, []) for p in prompts]
    assert after != before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_on_and_off_are_token_identical(dtype):
    model = tiny_model("qwen3").to("cuda", dtype)
    prompts = [[5, 17, 33, 8, 60, 2, 9], [11, 4, 70]]
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0)
    outs = {}
    for graphs in (False, True):
        cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=3, kv_cache_tokens=512, block_size=BLOCK,
                           cuda_graphs=graphs)
        engine = RolloutEngine(model, cfg)
        outs[graphs] = engine.generate(prompts, 3, sampling).completion_ids
        if graphs:
            assert engine.decoder.graphs  # captured
    assert outs[True] == outs[False]
