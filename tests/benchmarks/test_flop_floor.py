"""The floor of `benchmarks/grpo_step.py` (`flop_floor.py`, `floor_table.py`) and the scaling sweep
(`grpo_scaling.py`) on a tiny random model: the formula agrees with torch's FLOP counter where both count the same
work, the worker returns the floor's data, the floor table has its columns, and the sweep writes its table and PNG."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
ARGS = ["--model", "tiny", "--prompt-len", "8", "--steps", "2", "--device", "cpu", "--num-prompts", "8",
        "--rollout", "cpu_decode_kernel=False", "--rollout", "kv_cache_tokens=1024"]


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


def tiny_model():
    from trl_infinite.testing.model_zoo import random_model

    return random_model("tiny", dtype=torch.float32, device=torch.device("cpu"), seed=0)


def test_formula_agrees_with_torch_counter():
    """One unpadded forward and backward of s tokens: the counter's count is the formula's body + logits, plus the
    upper triangle of attention the counter counts dense (the formula counts causal). Tolerance 1e-3 relative: the
    rotary embedding's tiny matmul, counted by some transformers releases."""
    ff = importlib.import_module("flop_floor")
    model = tiny_model()
    shape = ff.ModelShape.of(model)
    s = 12
    ids = torch.randint(0, model.config.vocab_size, (1, s), generator=torch.Generator().manual_seed(0))
    counter = ff.flop_counter()
    with counter:
        loss = model(ids).logits.sum()
    forward = counter.get_total_flops()
    dense_excess = 4 * shape.layers * shape.q_dim * (s * s - s * (s + 1) // 2)
    assert forward == pytest.approx(shape.body_flops(1, s) + 2 * shape.head_params * s + dense_excess, rel=1e-3)
    with counter:
        loss.backward()
    backward = counter.get_total_flops()
    assert 1.95 * forward < backward < 2.6 * forward  # input and weight gradients (attention's backward is 2.5x)


def test_counter_counts_cuda_attention_with_grouped_kv_and_addmm_with_out_dtype():
    """Two formulas the GPU run (H100, torch 2.11) found raising inside the counter, called as the counter calls
    them: the CUDA attention kernels with fewer K/V heads than query heads (torch's formula asserts equal heads;
    counted dense, as torch counts attention) and addmm with `out_dtype` (TRL's chunked log-probs; torch's formula
    takes the dtype for its `out_shape`)."""
    ff = importlib.import_module("flop_floor")
    aten = torch.ops.aten
    registry = ff.flop_counter().flop_registry
    q, kv = torch.empty(2, 8, 5, 16, device="meta"), torch.empty(2, 2, 7, 16, device="meta")
    dense = 2 * 2 * (2 * 8 * 5 * 7 * 16)  # scores and output, 2 FLOPs per multiply-add
    for kernel in ("flash", "efficient", "cudnn"):
        forward = registry[getattr(aten, f"_scaled_dot_product_{kernel}_attention")]
        backward = registry[getattr(aten, f"_scaled_dot_product_{kernel}_attention_backward")]
        assert forward(q, kv, kv, None, False, out_val=(q,)) == dense
        assert backward(q, q, kv, kv, q, None, out_val=(q, kv, kv)) == 2.5 * dense
    a, b, acc = torch.empty(4, 3, device="meta"), torch.empty(3, 5, device="meta"), torch.empty(4, 5, device="meta")
    assert registry[aten.addmm](acc, a, b, torch.float32, out_val=acc) == 2 * 4 * 3 * 5
    assert registry[aten.baddbmm](acc[None], a[None], b[None], out_val=acc[None]) == 2 * 4 * 3 * 5
    # a formula that still raises leaves the counted step running and its count marked incomplete
    counter = ff.flop_counter()
    counter.flop_registry[aten.mm] = lambda *args, **kwargs: 1 / 0
    x = torch.ones(2, 2)
    with counter:
        y = torch.mm(x, x)
    assert torch.equal(y, 2 * x) and len(counter.errors) == 1 and "ZeroDivisionError" in counter.errors[0]


def test_required_flops_formula():
    ff = importlib.import_module("flop_floor")
    shape = ff.ModelShape(layers=2, hidden=4, q_dim=4, kv_dim=2, body=((4, 4), (4, 2), (4, 2), (4, 4)),
                          head=(4, 10), weight_bytes=1000, dtype_bytes=4)
    assert shape.body_params == 48 and shape.head_params == 40
    assert shape.body_flops(1, 3) == 2 * 48 * 3 + 4 * 2 * 4 * 6
    one = ff.required_flops(shape, [5], [[3]], memory_budget_bytes=1e12)
    two = ff.required_flops(shape, [5], [[3, 3]], memory_budget_bytes=1e12)
    # the prompt once per group: a second sample adds only its own tokens
    own = shape.body_flops(6, 7) + 2 * 40 * 2
    assert two.rollout - one.rollout == own
    assert one.rollout == shape.body_flops(1, 5) + 2 * 40 + own
    assert one.forward == shape.body_flops(1, 5) + shape.body_flops(6, 7) + 2 * 40 * 3
    assert one.backward == 2 * one.forward and not one.recompute
    tight = ff.required_flops(shape, [5], [[3]], memory_budget_bytes=1.0)
    assert tight.recompute and tight.backward == 2 * one.forward + shape.body_flops(1, 7)
    assert two.tokens == 6 and two.step == two.rollout + two.forward + two.backward
    # bytes: 2 decode steps reading every weight, the prompt's KV per step, each sample's own tokens
    kv = 2 * 2 * 2 * 4
    assert two.rollout_bytes == 2 * 1000 + 2 * 5 * kv + 2 * 3 * kv


@pytest.mark.parametrize("kind", ["trl", "infinite"])
def test_worker_reports_the_floor(kind):
    grpo_step = importlib.import_module("grpo_step")
    table = importlib.import_module("floor_table")
    a = grpo_step.parse_args([*ARGS, "--sizes", "4x2@12", "--lengths", "forced", "--mean", "6",
                              "--count-flops", "warmup"])  # counted in this worker's own warm-up
    data = grpo_step.run_worker(a, kind, a.sizes[0])
    floor = data["floor"]
    assert len(floor["steps"]) == 2 and floor["steps"][1]["counted"] is None  # only the warm-up is counted
    counted = floor["steps"][0]["counted"]
    assert all(counted[p] > 0 for p in ("rollout", "forward", "backward"))
    calls, _ = grpo_step.forced_calls(a, a.sizes[0])
    assert [s["completions"] for s in floor["steps"]] == calls and all(
        len(s["prompt_lens"]) == 2 for s in floor["steps"])
    rates = floor["rates"]
    assert rates["rollout_rows"] == 8 and min(rates["rollout"], rates["forward"], rates["backward"]) > 0
    row = grpo_step.make_row(a.sizes[0], kind, data, "cpu", None)
    rows = table.floor_rows("4x2@12", kind, data, row, "cpu", 1e12)
    assert [r["phase"] for r in rows] == ["rollout", "forward", "backward", "step"]
    assert all(set(table.FLOOR_COLUMNS) <= set(r) for r in rows)
    assert all(r["x_floor"] > 0 and r["floor_s"] > 0 for r in rows) and row["x_floor"] == rows[-1]["x_floor"]
    assert rows[-1]["floor_s"] == pytest.approx(sum(r["floor_s"] for r in rows[:3]))
    for r in rows[1:3]:  # training: padding and recomputation only add to the unavoidable work
        assert r["x_req"] >= 0.999, r
    if kind == "trl":  # gradient checkpointing recomputes the forward in the backward: well over 2x
        assert rows[2]["counted_GFLOP"] > 2.5 * rows[1]["req1_GFLOP"]


def test_separate_count_worker_fills_the_first_step(tmp_path, monkeypatch):
    """`--count-flops separate` (CPU's default): the measuring worker counts nothing; a second worker runs the warm-up
    step counted, and its counts and lengths become the floor's first step."""
    grpo_step = importlib.import_module("grpo_step")
    argvs = []

    def in_process(argv, result, env=None, tail=25):
        argvs.append(argv)
        a = grpo_step.parse_args(argv[2:])
        return grpo_step.run_worker(a, a.worker, a.sizes[0])

    monkeypatch.setattr(grpo_step, "run_subprocess", in_process)
    a = grpo_step.parse_args([*ARGS, "--sizes", "2x2@6", "--lengths", "forced", "--mean", "4"])
    assert a.count_flops == "auto"
    data = grpo_step.measure(a, "infinite", a.sizes[0], str(tmp_path), {}, torch.device("cpu"))
    assert len(argvs) == 2 and "--count-only" not in argvs[0] and "--count-only" in argvs[1]
    steps = data["floor"]["steps"]
    assert len(steps) == 2 and steps[1]["counted"] is None
    assert all(steps[0]["counted"][p] > 0 for p in ("rollout", "forward", "backward"))
    assert [s["completions"] for s in steps] == grpo_step.forced_calls(a, a.sizes[0])[0]
    assert len(data["steps"]) == 2  # the measured steps come from the first worker
    with_off = grpo_step.parse_args([*ARGS, "--sizes", "2x2@6", "--count-flops", "off"])
    argvs.clear()
    off = grpo_step.measure(with_off, "infinite", with_off.sizes[0], str(tmp_path), {}, torch.device("cpu"))
    assert len(argvs) == 1 and off["floor"]["steps"][0]["counted"] is None


def test_best_rates_take_each_rate_at_its_fastest():
    table = importlib.import_module("floor_table")

    def row(rows, rollout, forward, backward, bandwidth):
        return {"floor_data": {"rates": {"rollout": rollout, "forward": forward, "backward": backward,
                                         "bandwidth": bandwidth, "rollout_rows": rows, "train_rows": 512,
                                         "dtype": "float32"}}}

    best = table.best_rates([row(16, 44.0, 95.0, 98.0, 19.0), row(16, 35.0, 90.0, 99.0, 20.0),
                             row(32, 60.0, 92.0, 97.0, 18.0), {"trainer": "failed, no floor"}])
    assert best[16] == {"rollout": 44.0, "forward": 95.0, "backward": 99.0, "bandwidth": 20.0, "rollout_rows": 16,
                        "train_rows": 512, "dtype": "float32"}
    # the training rates (512 rows whatever the rollout's) are shared across row counts; the rollout's are not
    assert best[32]["rollout"] == 60.0 and best[32]["forward"] == 95.0 and best[32]["backward"] == 99.0
    assert best[32]["bandwidth"] == 18.0


def test_largest_backward_slice():
    """The slices `loss_slices.py` cuts: one group of G rows under the budget is one slice; above it, 2 : 1 : ... : 1
    of the tokens (a later slice encodes the prompt again)."""
    terms = importlib.import_module("memory_terms")
    assert terms.largest_slice(92, 8, 256, 4096) == 91 + 8 * 257  # one slice: the prompt once, each row L + 1
    assert terms.largest_slice(92, 8, 256, None) == 91 + 8 * 257
    # 8 x 1,025 + 91 = 8,291 tokens over 4,096: 4 slices, the first about 2/5 of the tokens to within a row (its
    # cut is the first row boundary past 2/5: 4 rows + the prompt)
    assert terms.largest_slice(92, 8, 1024, 4096) == 91 + 4 * 1025
    assert terms.largest_slice(92, 8, 4096, 4096) == 91 + 4097  # a row alone over the budget is its own slice


def test_training_only_count_leaves_the_rollout_alone():
    """`--count-flops warmup-training` (CUDA's default): the rollout runs outside the counter, the training phases
    are counted."""
    grpo_step = importlib.import_module("grpo_step")
    a = grpo_step.parse_args([*ARGS, "--sizes", "2x1@6", "--lengths", "forced", "--mean", "4",
                              "--count-flops", "warmup-training"])
    counted = grpo_step.run_worker(a, "infinite", a.sizes[0])["floor"]["steps"][0]["counted"]
    assert counted["rollout"] is None and counted["forward"] > 0 and counted["backward"] > 0


def test_scaling_table_and_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    grpo_step = importlib.import_module("grpo_step")
    scaling = importlib.import_module("grpo_scaling")

    def in_process(argv, result, env=None, tail=25):  # the real worker, without a new interpreter per run
        a = grpo_step.parse_args(argv[2:])
        return grpo_step.run_worker(a, a.worker, a.sizes[0])

    monkeypatch.setattr(grpo_step, "run_subprocess", in_process)
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    scaling.main([*ARGS, "--points", "4@4", "2@4", "2@8", "--json", str(out), "--png", str(png)])
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["G"], r["L"], r["trainer"]) for r in rows] == [
        (2, 4, "InfiniteGRPOTrainer"), (2, 4, "GRPOTrainer"), (4, 4, "InfiniteGRPOTrainer"), (4, 4, "GRPOTrainer"),
        (2, 8, "InfiniteGRPOTrainer"), (2, 8, "GRPOTrainer")]  # by completion tokens (ties: shorter L first), ours first
    for r in rows:
        assert r["tokens"] == r["G"] * r["L"] and r["ms_per_token"] == pytest.approx(1000 * r["step_s"] / r["tokens"])
        assert r["peak_GB"] > 0 and r["x_floor"] > 0 and r["x_trl_time"] > 0 and r["x_first"] > 0
        assert all(s["mean_len"] == r["L"] for s in r["all_steps"])  # forced identical lengths
    assert rows[0]["x_first"] == 1.0 and rows[1]["x_trl_time"] == 1.0
    for r in rows[2:]:  # G against the smallest L's first point, L against the smallest G's
        first = next(b for b in rows if b["trainer"] == r["trainer"] and (b["G"], b["L"]) == (2, 4))
        assert r["x_first"] == pytest.approx(r["ms_per_token"] / first["ms_per_token"])
    assert "| 2 | 8 | InfiniteGRPOTrainer |" in out.with_suffix(".md").read_text()
    terms = importlib.import_module("memory_terms").memory_rows(rows)
    assert [(t["G"], t["L"]) for t in terms] == [(2, 4), (4, 4), (2, 8)]  # ours only
    for t in terms:
        assert t["static_GB"] > 0 and t["kv_GB"] > 0 and t["slice_GB"] > 0 and t["grads_GB"] > 0
    assert terms[2]["kv_GB"] > terms[0]["kv_GB"]  # longer completions, more KV
    assert "term by term" in out.with_suffix(".md").read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # the floor table rebuilt from the JSON alone (the workers' rates) gives the rows' x_floor back
    rebuilt = importlib.import_module("floor_table").rebuild(str(out), remeasure=False, threads=1, out=None)
    steps = [r for r in rebuilt if r["phase"] == "step"]
    assert [r["x_floor"] for r in steps] == pytest.approx([r["x_floor"] for r in rows])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
