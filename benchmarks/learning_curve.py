"""Same learning, less time? The same GRPO run with `GRPOTrainer` and `InfiniteGRPOTrainer`, several seeds each.

Each (trainer, seed) runs in its own process (this script re-invokes itself with `--worker`), runs alternate
between the trainers seed by seed (so both see the machine's load alike), and every run gets the same `GRPOConfig`,
the same data in the same order (TRL's sampler, seeded by `seed`) and the same seed. Everything is TRL's default
except: the batch geometry (`--num-generations` G completions of `--prompts` prompts per step, one optimizer step per
generation batch), `--max-completion-length`, `--learning-rate` (TRL's 1e-6 moves a 135M model too little to see in
tens of steps), `max_steps`, a log per step, no saving, and on CPU `use_cpu=True` with `bf16` off.

Task (`--task gsm8k`, the default): SmolLM2-135M-Instruct (real weights, offline) on GSM8K train questions as chat
prompts, with the instruction `INSTRUCTION` appended, and two rewards from `examples/rewards.py`: `gsm8k_reward`
(the final number equals the answer: 1 / 0) and `format_reward` (the completion ends with a final answer, a number or
`\\boxed{}`: 1 / 0). Why this task: see RESULTS.md ("Learning curves"): in the pilot the model's format reward moves
within ten steps on this CPU, while correctness alone stays near zero for a 135M model. `--task tiny`: a random
tiny model and two synthetic rewards (the smoke test's; nothing learns there).

Logged per step (the worker's JSON): every reward function's mean, the total `reward`, `completions/mean_length`,
`entropy` and `kl` (TRL's logs), the step's process CPU time and wall time (`on_step_begin` -> `on_step_end`).

Comparison (`curve_stats.py`): per seed, the final reward (the mean of the last `--final-window` steps' rewards) and
the area under the curve (the mean reward over all steps); across seeds, ours minus TRL's with Welch's 90%
confidence interval: "no difference beyond the tolerance" when that interval lies inside +-`--tolerance` (two
one-sided t-tests at 5%, TOST); "different" when Welch's two-sided 95% interval excludes 0; "inconclusive"
otherwise. Time to the level: the first step at which a seed's running mean reward (`--smooth` steps) reaches the
level (`--level`; default: the first step's mean reward over all runs plus half of its rise to the final reward over
all runs), in cumulative wall time and CPU time; ours over TRL's (means over the seeds that reach it).

    python benchmarks/learning_curve.py --json /tmp/curve.json --plot benchmarks/learning_curve.png
    python benchmarks/learning_curve.py --task tiny --steps 2 --seeds 0 --json /tmp/c.json --plot /tmp/c.png  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from common import run_header  # noqa: E402
from curve_stats import LOG_KEYS, TRAINERS, compare_runs, plot_curves  # noqa: E402
from grpo_setup import gsm8k_dataset, gsm8k_path, random_dataset, word_tokenizer  # noqa: E402
from grpo_workers import run_subprocess  # noqa: E402

INSTRUCTION = "Solve it briefly and end with the final answer as a number."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["gsm8k", "tiny"], default="gsm8k")
    p.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=list(TRAINERS))
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2],
                   help="seeds to run (none with --merge: only compare and plot the merged files)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--num-prompts", type=int, default=512, help="dataset rows (TRL's sampler shuffles them)")
    p.add_argument("--data", default=None, help="GSM8K train JSONL (default: $TRL_INFINITE_DATA/gsm8k/train.jsonl)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--final-window", type=int, default=5, help="steps averaged into the final reward")
    p.add_argument("--smooth", type=int, default=3, help="running-mean window of the time-to-level rule")
    p.add_argument("--level", type=float, default=None, help="reward level (default: the rule in the docstring)")
    p.add_argument("--tolerance", type=float, default=0.15, help="equivalence margin on the reward (TOST)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    p.add_argument("--json", default=None, help="write every run's log and the comparison here")
    p.add_argument("--plot", default=None, help="PNG of the curves (needs matplotlib)")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="earlier runs (this script's --json) compared and plotted with this one's: the same task, "
                   "steps, batch, lengths and learning rate, other seeds (more seeds without rerunning the first)")
    p.add_argument("--worker", choices=list(TRAINERS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a.seeds and not a.merge:
        p.error("--seeds: give at least one seed, or --merge files to compare")
    return a


def finished_answer(max_len: int):
    """The format reward: 1.0 when the completion ends (EOS before `max_len` tokens) with a number in its last line
    (`examples/rewards.py`'s `format_reward`, which a completion cut off mid-sentence also meets when its last line
    holds a number), else 0.0."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from rewards import format_reward

    def finished_answer(completions, completion_ids, **kwargs) -> list[float]:
        return [f if len(ids) < max_len else 0.0 for f, ids in zip(format_reward(completions), completion_ids)]

    return finished_answer


def tiny_rewards():
    def length_mod(completion_ids, **kwargs) -> list[float]:
        return [float(len(ids) % 3) / 2 for ids in completion_ids]

    def even_first(completion_ids, **kwargs) -> list[float]:
        return [float(bool(ids) and ids[0] % 2 == 0) for ids in completion_ids]

    return [length_mod, even_first]


def build_trainer(a, kind: str):
    """The run's trainer: TRL's defaults but the options named in the docstring; nothing of ours but the class."""
    from trl import GRPOConfig, GRPOTrainer

    from trl_infinite import InfiniteGRPOConfig, InfiniteGRPOTrainer

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="learning_curve_"), report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=a.steps, num_generations=a.num_generations,
        per_device_train_batch_size=a.num_generations * a.prompts, gradient_accumulation_steps=1,
        max_completion_length=a.max_completion_length, learning_rate=a.learning_rate, seed=a.seed,
        use_cpu=not torch.cuda.is_available(), bf16=False,
    )
    if a.task == "gsm8k":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # examples/rewards.py
        from rewards import gsm8k_reward

        from trl_infinite.testing.offline_models import smollm2_path

        model, tokenizer, rewards = str(smollm2_path()), None, [gsm8k_reward, finished_answer(a.max_completion_length)]
        dataset = gsm8k_dataset(gsm8k_path(a), a.num_prompts)
        dataset = dataset.map(lambda row: {"prompt": [{"role": "user",
                                                       "content": f"{row['prompt'][0]['content']} {INSTRUCTION}"}]})
    else:
        from trl_infinite.testing.model_zoo import random_model

        model = random_model("tiny", dtype=torch.float32, device=torch.device("cpu"), seed=0)
        tokenizer, rewards = word_tokenizer(model.config.vocab_size), tiny_rewards()
        dataset = random_dataset(model.config.vocab_size, a.num_prompts, 8, seed=0)
    if kind == "infinite":
        args, cls = InfiniteGRPOConfig(**common), InfiniteGRPOTrainer
    else:
        args, cls = GRPOConfig(**common), GRPOTrainer
    log = StepLog()
    trainer = cls(model=model, reward_funcs=rewards, args=args, train_dataset=dataset, processing_class=tokenizer,
                  callbacks=[log])
    return trainer, log


def _step_log_class():
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        """Per optimizer step: TRL's logged values (`LOG_KEYS` and every `rewards/*/mean`), CPU and wall seconds."""

        def __init__(self):
            self.steps: dict[int, dict] = {}
            self._start = (0.0, 0.0)

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = (time.process_time(), time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            cpu, wall = self._start
            self.steps.setdefault(state.global_step, {}).update(
                cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - wall)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                row = self.steps.setdefault(state.global_step, {})
                row.update({k: float(v) for k, v in logs.items()
                            if k in LOG_KEYS or (k.startswith("rewards/") and k.endswith("/mean"))})

    return StepLog


def worker_main(a) -> None:
    torch.set_num_threads(a.threads)
    try:
        trainer, log = build_trainer(a, a.worker)
        trainer.train()
        steps = [{"step": s, **log.steps[s]} for s in sorted(log.steps)]
        out = {"trainer": a.worker, "seed": a.seed, "steps": steps,
               "uses_engine": bool(getattr(trainer, "uses_engine", False))}
    except Exception as err:  # noqa: BLE001 - reported as the run's error
        import traceback

        traceback.print_exc()
        out = {"error": f"{type(err).__name__}: {err}"}
    Path(a.result).write_text(json.dumps(out))


def run_one(a, kind: str, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "run.json"
        argv = [sys.executable, __file__, *sys.argv[1:], "--worker", kind, "--seed", str(seed), "--result",
                str(result)]
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        started = time.perf_counter()
        data = run_subprocess(argv, result, env=env)
        data.setdefault("trainer", kind)
        data.setdefault("seed", seed)
        data["process_wall_s"] = time.perf_counter() - started
        return data


SAME_RUN = ("task", "steps", "num_generations", "prompts", "max_completion_length", "learning_rate", "num_prompts",
            "threads")  # what merged runs must share with this one


def merged_runs(a) -> tuple[list[dict], list[str]]:
    """The runs of `--merge`'s files (an error when one differs from this run in `SAME_RUN` or repeats a seed), and a
    line per file naming its commit and seeds. A seed without a finished run of every trainer of `--trainers` (a
    file written while its runs were going on) is left out, and the line says so."""
    runs, lines, seen = [], [], set(a.seeds)
    for path in a.merge:
        data = json.loads(Path(path).read_text())
        for key in SAME_RUN:
            if data["args"].get(key) != getattr(a, key):
                raise SystemExit(f"--merge {path}: {key}={data['args'].get(key)!r}, this run has {getattr(a, key)!r}")
        done = {(r["seed"], r["trainer"]) for r in data["runs"] if "error" not in r}
        seeds = sorted({r["seed"] for r in data["runs"]})
        whole = [s for s in seeds if all((s, t) in done for t in a.trainers)]
        if seen & set(whole):
            raise SystemExit(f"--merge {path}: seeds {sorted(seen & set(whole))} are already in this comparison")
        seen |= set(whole)
        runs += [r for r in data["runs"] if r["seed"] in whole]
        left = f" (left out, a trainer's run missing: {sorted(set(seeds) - set(whole))})" if len(whole) < len(seeds) else ""
        lines.append(f"{path}: seeds {whole}, commit {data.get('commit')}, {data.get('date')}{left}")
    return runs, lines


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.worker:
        return worker_main(a)
    header = run_header(torch.device("cpu"), "python benchmarks/learning_curve.py " + " ".join(sys.argv[1:]))
    earlier, lines = merged_runs(a)
    if lines:
        header["merged"] = "; ".join(lines)
    runs = []
    for seed in a.seeds:
        for kind in a.trainers:
            run = run_one(a, kind, seed)
            runs.append(run)
            status = run.get("error") or f"{len(run['steps'])} steps, final reward {run['steps'][-1].get('reward')}"
            print(f"[learning_curve] {TRAINERS[kind]} seed {seed}: {status}", file=sys.stderr, flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps({**header, "args": vars(a), "runs": runs}, indent=1))
    failed = [r for r in runs if "error" in r]
    runs = earlier + runs
    report = compare_runs([r for r in runs if "error" not in r], a.final_window, a.smooth, a.level, a.tolerance)
    print("\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + report.markdown, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({**header, "args": vars(a), "runs": runs, "report": report.data},
                                           indent=1))
        Path(a.json).with_suffix(".md").write_text(
            "\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + report.markdown)
    if a.plot:
        plot_curves([r for r in runs if "error" not in r], report.level, a.plot)
        print(f"wrote {a.plot}")
    if failed:
        for r in failed:
            print(f"FAILED {r['trainer']} seed {r['seed']}: {r['error']}", file=sys.stderr)
        raise SystemExit(1)


StepLog = _step_log_class()

if __name__ == "__main__":
    main()
