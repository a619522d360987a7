"""The whole GRPO step, side by side: `GRPOTrainer` (transformers `generate`), `GRPOTrainer` with transformers
continuous batching, and `InfiniteGRPOTrainer` with its defaults (only the class names swapped).

Each trainer runs in its own process (this script re-invokes itself with `--worker` and reads back JSON), with the
same `GRPOConfig`, the same prompts in the same order and the same seed. Everything is TRL's default (loss_type dapo,
beta 0, gradient checkpointing, learning rate 1e-6, ...) except: `per_device_train_batch_size` = G x prompts and
`gradient_accumulation_steps` 1 (one optimizer step per generation batch), `max_steps` = `--steps`, `logging_steps`
1 (a log per step), no saving, no reporting, and on CPU `use_cpu=True` and `bf16` off (`--bf16 auto`: TRL's
default, bf16 autocast, on CUDA). The header lists the config the trainers ran with.

Models (`--model`):
- `smollm2` (default): SmolLM2-135M-Instruct, real weights (offline, `trl_infinite.testing.offline_models`), loaded by
  TRL from its folder as a user would (float32), GSM8K train questions (`--data`, default
  `$TRL_INFINITE_DATA/gsm8k/train.jsonl` or `../shared/data/...`) as conversational prompts through the chat template,
  reward `gsm8k_reward` against the `answer` column.
- `qwen3-0.6b`, `qwen3-1.7b`, `tiny`: random weights of that shape (configs built offline, `--weights-dtype`), an
  offline word-level tokenizer over the model's vocabulary (EOS the last id), prompts of `--prompt-len` random words
  (default 92: the mean SmolLM2 chat-template length of GSM8K questions), reward = completion length mod 5. For GPU
  runs (with `--lengths forced`) and cheap smoke runs.

Lengths (`--lengths`): `natural` (the model stops at EOS or `max_completion_length`) or `forced`: every completion
gets a length drawn once (seed 0, per step and prompt, G per prompt) from `--trace FILE` (the format of
`trl_infinite.sim.traces`, records cycled) or log-normal (`--mean`, `--sigma`), clipped to
`max_completion_length`; every trainer does the same work. `generate`: EOS banned before the target and forced at it
(`ForcedLengthLogitsProcessor`); continuous batching: one request per row with `max_new_tokens` = its target and EOS
disabled (no per-request logits processor exists there: same forwards, the last token is sampled instead of EOS);
ours: the engine's `generate(forced_lengths=...)`. Each step's completions are checked against their targets: a
mismatch is an error (a failed row), never a figure.

Sizes (`--sizes GxP@L`): G = `num_generations`, P prompts per step, L = `max_completion_length`.

Columns (per (size, trainer), the mean of the steps after the first, which is a warm-up):
- `cpu_s`: process CPU time of the step (`time.process_time` of the worker: all its threads); `wall_s`: wall time.
  A step runs from `on_step_begin` to `on_step_end` (TRL's logging after it is not included).
- phases, exclusive (a phase called inside another is charged to the inner one): `rollout_s` = every
  `_generate_single_turn` call (our trainer scores streamed rewards inside it); `reward_s` = `_calculate_rewards`;
  `forward_s` = `compute_loss` (training forward + loss) plus every `_get_per_token_logps_and_entropies` call outside
  it (TRL's no-grad log-prob forwards); `backward_s` = `accelerator.backward`; `optim_s` = the optimizer step
  (`on_pre_optimizer_step` -> `on_optimizer_step`); `other_s` = the step minus the named phases (tokenizing,
  padding, advantages, gradient clipping, scheduler, ...). CPU seconds on CPU, wall seconds on CUDA (synchronised
  at each boundary; `--phase-clock`); the JSON holds both, and `_generate_and_score_completions` as a whole.
- `peak_rss_GB`: the highest resident set during a measured step (VmHWM reset at each step's start through
  /proc/self/clear_refs); `process_rss_GB`: the worker's whole-life peak (`getrusage`, model loading included);
  `peak_cuda_GB`: `torch.cuda.max_memory_allocated` during a measured step.
- `mean_len`: TRL's `completions/mean_length` log; `x_trl_cpu`, `x_trl_wall`, `x_trl_rss`: ratios to `GRPOTrainer`
  (same size, same run); `engine`: whether `InfiniteGRPOTrainer` generated on its engine (`uses_engine`).
- `x_floor`: the step's time over its floor, and a second table "Against the floor" per trainer and phase (rollout,
  training forward, backward, step): FLOPs counted by `torch.utils.flop_counter.FlopCounterMode` in a warm-up step
  (untimed; `--count-flops`: on CPU a second worker per row runs that step counted, so the counter's resident memory
  never lifts the measured peak RSS), the required FLOPs by the formula of `flop_floor.py` (no padding, the prompt
  once per group, each completion token once, backward 2x forward, recomputation only when one sample's activations
  exceed `--floor-memory-gb`), the GEMM rate measured in the worker after its steps (one pass over the model's
  linears, each its own weight), and
  time / floor (columns in `floor_table.py`). The JSON keeps each worker's lengths, counts and rates (`floor_data`).
A worker that fails or is killed (e.g. out of memory) is a row with the reason in `note`; the script then exits 1.

    python benchmarks/grpo_step.py                                   # SmolLM2 + GSM8K, the three sizes, CPU
    python benchmarks/grpo_step.py --sizes 8x2@128 --json /tmp/grpo_step.json
    python benchmarks/grpo_step.py --model qwen3-1.7b --lengths forced --sizes 32x1@1024   # GPU
    python benchmarks/grpo_step.py --model tiny --sizes 4x1@16 --prompt-len 8 --lengths forced   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from common import Table, pick_device, run_header, save_json, trace_lengths, write_results  # noqa: E402
from floor_table import FLOOR_COLUMNS, floor_header, floor_rows, machine_memory_bytes  # noqa: E402
from flop_floor import COUNT_MODES, FloorProbe, count_mode, floor_summary  # noqa: E402
from grpo_rows import GB, MODELS, PHASE_COLUMNS, TRAINERS, Size, add_ratios, make_row  # noqa: E402, F401
from grpo_setup import build_trainer, config_summary, gsm8k_path  # noqa: E402
from grpo_workers import _max, _mean, _stop_worker, run_subprocess  # noqa: E402, F401 (re-exported)

DEFAULT_SIZES = ("8x2@128", "16x1@256", "32x1@256")
COLUMNS = ["size", "trainer", "cpu_s", "wall_s", *PHASE_COLUMNS.values(), "other_s", "peak_rss_GB", "process_rss_GB",
           "peak_cuda_GB", "mean_len", "x_trl_cpu", "x_trl_wall", "x_trl_rss", "x_floor", "engine", "note"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=MODELS)
    p.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=list(TRAINERS),
                   help="run in this order (put the row that matters first: a time limit cuts the last)")
    p.add_argument("--sizes", nargs="+", type=Size.parse, default=[Size.parse(s) for s in DEFAULT_SIZES],
                   help="GxP@L: G generations x P prompts per step @ max_completion_length")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per trainer; the first is a warm-up")
    p.add_argument("--lengths", choices=["natural", "forced"], default="natural")
    p.add_argument("--warmup-length", type=int, default=None,
                   help="with --lengths forced: every completion of the warm-up step is this many tokens (default: "
                   "as the measured steps'); the warm-up still runs every phase once, so one-time costs stay out of "
                   "the measured steps, without a second full-size step at long lengths")
    p.add_argument("--trace", default=None, help="forced lengths from this JSONL trace (else log-normal)")
    p.add_argument("--mean", type=float, default=256.0, help="log-normal mean of forced lengths (tokens)")
    p.add_argument("--sigma", type=float, default=0.6, help="log-normal log-space spread of forced lengths")
    p.add_argument("--prompt-len", type=int, default=92, help="prompt tokens of random-weight models")
    p.add_argument("--num-prompts", type=int, default=256, help="dataset rows (TRL's sampler shuffles them)")
    p.add_argument("--data", default=None, help="GSM8K train JSONL (default: $TRL_INFINITE_DATA/gsm8k/train.jsonl)")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                   help="auto: TRL's default (on) on CUDA, off on CPU")
    p.add_argument("--weights-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights as loaded (TRL loads a path in float32 unless model_init_kwargs say otherwise)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (and OMP_NUM_THREADS) per worker")
    p.add_argument("--seed", type=int, default=42, help="GRPOConfig.seed (TRL's default 42)")
    p.add_argument("--phase-clock", choices=["auto", "cpu", "wall"], default="auto",
                   help="phase columns in CPU or wall seconds; auto: CPU on CPU, wall on CUDA")
    p.add_argument("--cb-memory-percent", type=float, default=None,
                   help="continuous batching's max_memory_percent (default: TRL's, 0.5 of the free memory)")
    p.add_argument("--rollout", action="append", default=[], metavar="NAME=VALUE",
                   help="an InfiniteGRPOConfig `rollout_NAME` (repeatable; default: none, our defaults)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="any other InfiniteGRPOConfig field of ours, e.g. backward_token_budget=2048 or "
                   "shared_prefix_training=False (repeatable; ablations)")
    p.add_argument("--count-flops", choices=COUNT_MODES, default="auto",
                   help="FlopCounterMode in a warm-up step: every phase in a second worker that runs that one step "
                   "(separate), every phase in the measuring worker's warm-up (warmup), all but the rollout there "
                   "(warmup-training), none (off); auto: separate on CPU (counting in the measuring process leaves "
                   "memory resident that lifts its peak RSS: 16x1@256 4.17 vs 3.19 GB), warmup-training on CUDA")
    p.add_argument("--floor-memory-gb", type=float, default=None,
                   help="memory budget of the floor's recomputation rule (default: host RAM, the GPU's on CUDA)")
    p.add_argument("--json", default=None, help="write the rows as JSON (and the table as .md) here")
    p.add_argument("--worker", choices=list(TRAINERS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--count-only", action="store_true", help=argparse.SUPPRESS)  # the separate counting worker
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be >= 2 (the first step is a warm-up and is not reported)")
    if a.threads < 1 or a.num_prompts < 1 or a.prompt_len < 1:
        p.error("--threads, --num-prompts and --prompt-len must be >= 1")
    if a.warmup_length is not None and (a.lengths != "forced" or a.warmup_length < 1):
        p.error(f"--warmup-length needs --lengths forced and a value >= 1, got {a.warmup_length}")
    if a.trace is not None and a.lengths != "forced":
        p.error("--trace only applies with --lengths forced")
    if a.worker is not None and (a.result is None or len(a.sizes) != 1):
        p.error("--worker needs --result and exactly one size")
    for flag, items in (("--rollout", a.rollout), ("--option", a.option)):
        for item in items:
            if "=" not in item:
                p.error(f"{flag} takes NAME=VALUE, got {item!r}")
    return a


# ------------------------------------------------------------------------------------------------------- workloads
def forced_calls(a, size: Size) -> tuple[list[list[list[int]]], str]:
    """Per rollout call (= per step), per prompt, the G forced lengths; and where they come from."""
    records, source = trace_lengths(a.steps * size.prompts, size.G, size.max_len, a.trace, a.mean, a.sigma,
                                    a.prompt_len, seed=0)
    lengths = [r.lengths for r in records]
    calls = [lengths[k * size.prompts:(k + 1) * size.prompts] for k in range(a.steps)]
    if a.warmup_length is not None:
        if a.warmup_length > size.max_len:
            raise ValueError(f"--warmup-length {a.warmup_length} exceeds the size's max_completion_length "
                             f"{size.max_len}")
        calls[0] = [[a.warmup_length] * len(prompt) for prompt in calls[0]]
        source += f"; the warm-up step's completions {a.warmup_length} tokens"
    return calls, source


# ---------------------------------------------------------------------------------------------------------- worker
def run_worker(a, kind: str, size: Size) -> dict:
    """Builds the trainer, runs `--steps` steps with the probes attached, returns the per-step measurements."""
    from grpo_probes import ForcedLengths, Instrumented

    device = pick_device(a.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    instrumented = floor = None
    try:
        trainer = build_trainer(a, kind, size, device)
        forced = None
        if a.lengths == "forced":
            forced = ForcedLengths(forced_calls(a, size)[0], trainer.eos_token_ids)
        instrumented = Instrumented(trainer, forced)
        floor = FloorProbe(trainer, instrumented.clock, "warmup" if a.count_only else count_mode(a.count_flops, device))
        if a.count_only:  # the first step only, counted: its FLOPs and lengths are all this worker returns
            trainer.args.max_steps = 1
            trainer.train()
            if len(instrumented.probe.records) != 1:
                raise RuntimeError(f"{len(instrumented.probe.records)} steps recorded, 1 expected")
            return {"trainer": kind, "size": size.name, "floor_steps": floor.steps}
        trainer.train()
        records = instrumented.probe.records
        if len(records) != a.steps:
            raise RuntimeError(f"{len(records)} steps recorded, {a.steps} expected")
        logs = {h["step"]: h for h in trainer.state.log_history if "completions/mean_length" in h}
        mean_len = [logs.get(i + 1, {}).get("completions/mean_length") for i in range(a.steps)]
        if forced is not None:
            if forced.done != a.steps:
                raise RuntimeError(f"{forced.done} of {a.steps} rollouts were forced")
            for i, call in enumerate(forced.calls):
                want = sum(map(sum, call)) / sum(map(len, call))
                if mean_len[i] is None or abs(mean_len[i] - want) > 1e-3:
                    raise RuntimeError(f"step {i + 1}: TRL logged mean length {mean_len[i]}, forced {want}")
        steps = []
        for r, n in zip(records, mean_len):
            steps.append({"cpu_s": r.cpu_s, "wall_s": r.wall_s, "phases_cpu": r.phases_cpu,
                          "phases_wall": r.phases_wall, "inclusive_cpu": r.inclusive_cpu,
                          "inclusive_wall": r.inclusive_wall, "peak_rss_bytes": r.peak_rss_bytes, "phase_peak_rss": r.phase_peak_rss,
                          "peak_cuda_bytes": r.peak_cuda_bytes, "rss_end_bytes": r.rss_end_bytes, "mean_len": n})
        return {
            "trainer": kind, "size": size.name, "steps": steps, "process_peak_rss_bytes": instrumented.probe.process_peak_rss_bytes(),
            "uses_engine": getattr(trainer, "uses_engine", None),
            "engine_fallback_reasons": list(getattr(trainer, "engine_fallback_reasons", []) or []),
            "forced_hooks": sorted(forced.used) if forced is not None else None,
            "config": config_summary(trainer.args), "device": str(device), "torch_threads": torch.get_num_threads(),
            "floor": floor_summary(trainer, floor, size, device, bool(trainer.args.bf16)),  # untimed, after the steps
        }
    finally:
        if floor is not None:
            floor.detach()
        if instrumented is not None:
            instrumented.detach()
        torch.set_num_threads(threads)


def worker_main(a) -> None:
    result_path = Path(a.result)
    try:
        result = run_worker(a, a.worker, a.sizes[0])
    except BaseException as err:  # report why, then fail
        tb = traceback.format_exc()
        result_path.write_text(json.dumps({"error": f"{type(err).__name__}: {err}"[:2000], "traceback": tb}))
        print(tb, file=sys.stderr, flush=True)
        sys.exit(1)
    result_path.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------- parent
def worker_argv(a, kind: str, size: Size, result: str, count_only: bool = False) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--result", result,
            "--model", a.model, "--sizes", size.name, "--steps", str(a.steps), "--lengths", a.lengths,
            "--mean", str(a.mean), "--sigma", str(a.sigma), "--prompt-len", str(a.prompt_len),
            "--num-prompts", str(a.num_prompts), "--bf16", a.bf16, "--weights-dtype", a.weights_dtype,
            "--threads", str(a.threads), "--seed", str(a.seed), "--phase-clock", a.phase_clock,
            "--count-flops", a.count_flops]
    for flag, value in (("--trace", a.trace), ("--data", a.data), ("--device", a.device),
                        ("--cb-memory-percent", a.cb_memory_percent), ("--warmup-length", a.warmup_length)):
        if value is not None:
            argv += [flag, str(value)]
    for item in a.rollout:
        argv += ["--rollout", item]
    for item in a.option:
        argv += ["--option", item]
    return argv + (["--count-only"] if count_only else [])


def measure(a, kind: str, size: Size, tmp: str, env: dict, device: torch.device) -> dict:
    """One (size, trainer): the measuring worker, then with `--count-flops separate` a second worker that runs the
    warm-up step counted; its counts and lengths become the floor's first step (`x_req` compares a step's count with
    that same step's required FLOPs)."""
    result = Path(tmp) / f"{size.name}_{kind}.json"
    data = run_subprocess(worker_argv(a, kind, size, str(result)), result, env)
    if count_mode(a.count_flops, device) != "separate" or "error" in data or not data.get("floor"):
        return data
    print(f"[grpo_step] {size.name} {TRAINERS[kind]}: counting FLOPs in a separate worker ...", file=sys.stderr,
          flush=True)
    counted = Path(tmp) / f"{size.name}_{kind}_count.json"
    count = run_subprocess(worker_argv(a, kind, size, str(counted), count_only=True), counted, env)
    if "error" in count:
        data["floor"]["count_error"] = count["error"]
    else:
        data["floor"]["steps"][0] = count["floor_steps"][0]
        data["floor"]["counted_in"] = "a separate worker (its own warm-up step)"
    return data


def run_order(trainers: list[str]) -> list[str]:
    """The trainers in the order `--trainers` gives them, each once."""
    return list(dict.fromkeys(trainers))


def header_for(a, device: torch.device, clock: str) -> dict:
    header = run_header(device, "python " + " ".join(shlex.quote(x) for x in sys.argv))
    weights = "SmolLM2-135M-Instruct (real weights), GSM8K train prompts, chat template, gsm8k_reward" \
        if a.model == "smollm2" else f"{a.model} (random weights), {a.prompt_len}-token random prompts, length reward"
    header.update({
        "model": f"{weights}; weights {a.weights_dtype}",
        "trainers": ", ".join(TRAINERS[k] for k in run_order(a.trainers)) + " (run in this order)",
        "steps": f"{a.steps} per trainer, the first a warm-up; columns are the mean of the other {a.steps - 1}",
        "threads": f"{a.threads} (torch.set_num_threads, OMP_NUM_THREADS) per worker process",
        "phase clock": f"{clock} seconds",
        "bf16": a.bf16,
    })
    if a.lengths == "forced":
        source = f"trace {a.trace}" if a.trace else f"lognormal(mean={a.mean}, sigma={a.sigma}, seed=0)"
        header["lengths"] = (f"forced: {source}, clipped to each size's max_completion_length, drawn per step and "
                             "prompt, the same for every trainer (in the JSON: forced_lengths)")
    else:
        header["lengths"] = "natural (EOS or max_completion_length)"
    if a.rollout or a.option:
        header["InfiniteGRPOConfig"] = " ".join([f"rollout_{x.removeprefix('rollout_')}" for x in a.rollout]
                                                + a.option)
    if a.cb_memory_percent is not None:
        header["continuous batching"] = f"max_memory_percent={a.cb_memory_percent}"
    return header


def write_floor(path: str | None, floor_table: Table) -> None:
    """The floor table (`floor_table.py`), printed and appended to the markdown beside the JSON."""
    if not floor_table.rows:
        return
    text = "\n## Against the floor (benchmarks/floor_table.py)\n\n" + floor_table.markdown() + "\n"
    print(text, flush=True)
    if path:
        md = Path(path).with_suffix(".md")
        md.write_text(md.read_text() + text)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.worker is not None:
        worker_main(a)
        return
    signal.signal(signal.SIGTERM, _stop_worker)
    device = pick_device(a.device)
    clock = a.phase_clock if a.phase_clock != "auto" else ("wall" if device.type == "cuda" else "cpu")
    if a.model == "smollm2":  # fail before any worker starts; convert the GGUF once here, not in each worker
        from trl_infinite.testing.offline_models import smollm2_path

        gsm8k_path(a)
        smollm2_path()
    header = header_for(a, device, clock)
    table = Table(COLUMNS)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads),
           "PYTHONUNBUFFERED": "1"}
    failed = False
    configs = {}
    floor_table = Table(FLOOR_COLUMNS)
    budget = a.floor_memory_gb * 1e9 if a.floor_memory_gb is not None else machine_memory_bytes(device)
    extra = {"configs": configs, "floor_rows": floor_table.rows, "floor_memory_bytes": budget}
    if a.lengths == "forced":
        extra["forced_lengths"] = {size.name: forced_calls(a, size)[0] for size in a.sizes}
    with tempfile.TemporaryDirectory(prefix="grpo_step_") as tmp:
        for size in a.sizes:
            base = None
            for kind in run_order(a.trainers):  # as --trainers lists them: a time limit cuts the last, not ours
                print(f"[grpo_step] {size.name} {TRAINERS[kind]} ...", file=sys.stderr, flush=True)
                data = measure(a, kind, size, tmp, env, device)
                row = make_row(size, kind, data, clock, base)
                failed |= bool(row.get("failed"))
                if kind == "trl":
                    base = row
                    for earlier in table.rows:  # rows that ran before GRPOTrainer get their ratios now
                        if earlier["size"] == size.name and not earlier.get("failed"):
                            add_ratios(earlier, base)
                config = row.pop("config", None)
                if config is not None:
                    configs.setdefault(kind, config)
                floors = floor_rows(size.name, TRAINERS[kind], data, row, clock, budget)
                if floors and "floor" not in header:
                    header.update(floor_header(data["floor"], budget))
                table.add(**row)
                floor_table.rows.extend(floors)
                save_json(a.json, header, table, extra)
    for kind, cfg in configs.items():
        shown = {k: v for k, v in cfg.items() if not k.startswith("rollout_")}
        header[f"config {TRAINERS[kind]}"] = ", ".join(f"{k}={v}" for k, v in shown.items())
    write_results(a.json, header, table, extra)
    write_floor(a.json, floor_table)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
