"""Do the two trainers' rollouts sample the same law? `learning_curve.py`'s setting, many samples per prompt.

The learning curves compare whole runs, where a few seeds cannot tell a small difference from chance. This compares
the rollouts alone, at the first step (the same weights for both): each trainer (its own process, built exactly as
`learning_curve.build_trainer` builds it) samples `--samples` completions of each of `--prompts` dataset prompts
through its own `_generate_single_turn` (TRL: `model.generate`; ours: the engine), `--batch` at a time (one call:
the prompt repeated `--batch` times, TRL's layout). Before every call the global torch generator is seeded
(`--seed`, prompt, call), which TRL's `generate` draws from; the engine's seed comes from the trainer's rollout seed
stream (`trainer/rollout.py`: distinct per call), so every sample of a trainer is an independent draw.

Per prompt, ours against TRL's:
- completion length (tokens, the EOS included): Welch's t-test and the two-sample Kolmogorov-Smirnov test;
- the fraction cut at `max_completion_length` (not ending with an EOS): Fisher's exact test;
- the first token: a chi-square test of homogeneity (tokens drawn fewer than 10 times in both together pooled).
A statistic differs when its p-value is below `--alpha` divided by the number of tests (prompts x 4, Bonferroni);
"same law" when none does. Also pooled over prompts: ours - TRL's mean length with Welch's 95% interval (what the
test could have seen).

    python benchmarks/rollout_law.py --json /tmp/law.json            # CPU, 2 x 4 prompts x 256 samples: ~25 min
    python benchmarks/rollout_law.py --task tiny --prompts 2 --samples 64 --batch 16   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import run_header  # noqa: E402
from curve_stats import TRAINERS  # noqa: E402
from grpo_workers import run_subprocess  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["gsm8k", "tiny"], default="gsm8k")
    p.add_argument("--prompts", type=int, default=4, help="dataset prompts (the first ones, TRL's order unshuffled)")
    p.add_argument("--samples", type=int, default=256, help="completions per prompt and trainer")
    p.add_argument("--batch", type=int, default=32, help="completions per `_generate_single_turn` call")
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.01, help="family-wise level (Bonferroni over every test)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", default=None, help="GSM8K file (default: TRL_INFINITE_DATA's)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", choices=list(TRAINERS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.prompts < 1 or a.batch < 1 or a.samples < a.batch or a.samples % a.batch:
        p.error(f"--samples must be a positive multiple of --batch (got {a.samples}, {a.batch}); --prompts >= 1")
    if not 0 < a.alpha < 1:
        p.error(f"--alpha must be in (0, 1), got {a.alpha}")
    return a


def curve_args(a) -> argparse.Namespace:
    """`learning_curve.py`'s arguments for the same trainer (its defaults, this run's task, length, seed)."""
    import learning_curve

    c = learning_curve.parse_args(["--task", a.task, "--steps", "1", "--max-completion-length",
                                   str(a.max_completion_length), "--threads", str(a.threads),
                                   *(["--data", a.data] if a.data else [])])
    c.seed = a.seed
    return c


def worker_main(a) -> None:
    import learning_curve

    torch.set_num_threads(a.threads)
    try:
        trainer, _ = learning_curve.build_trainer(curve_args(a), a.worker)
        prompts = [trainer.train_dataset[i]["prompt"] for i in range(a.prompts)]
        samples = []
        for i, prompt in enumerate(prompts):
            prompt_ids, _, _ = trainer._tokenize_prompts([prompt])
            ids = list(prompt_ids[0])
            out = []
            for call in range(a.samples // a.batch):
                torch.manual_seed(a.seed * 1_000_003 + i * 10_007 + call)
                completions = trainer._generate_single_turn([ids] * a.batch, None, {}, a.batch)[0]
                out += [[int(t) for t in c] for c in completions]
            samples.append(out)
        data = {"trainer": a.worker, "samples": samples, "eos": list(trainer.eos_token_ids),
                "uses_engine": bool(getattr(trainer, "uses_engine", False))}
    except Exception as err:  # noqa: BLE001 - reported as the run's error
        import traceback

        traceback.print_exc()
        data = {"error": f"{type(err).__name__}: {err}"}
    Path(a.result).write_text(json.dumps(data))


def compare(ours: list[list[int]], trl: list[list[int]], eos: set[int]) -> dict:
    """The four tests of one prompt (p-values), and the two length means."""
    from scipy import stats

    la, lb = [len(c) for c in ours], [len(c) for c in trl]
    cut_a, cut_b = (sum(not c or c[-1] not in eos for c in cs) for cs in (ours, trl))
    first_a, first_b = Counter(c[0] for c in ours if c), Counter(c[0] for c in trl if c)
    common = [t for t in sorted(set(first_a) | set(first_b)) if first_a[t] + first_b[t] >= 10]
    rows = [[first_a[t] for t in common], [first_b[t] for t in common]]
    rest = [sum(first_a.values()) - sum(rows[0]), sum(first_b.values()) - sum(rows[1])]
    if sum(rest):
        rows = [rows[0] + [rest[0]], rows[1] + [rest[1]]]
    first_p = stats.chi2_contingency(rows).pvalue if len(rows[0]) > 1 else 1.0
    welch = stats.ttest_ind(la, lb, equal_var=False).pvalue if len(set(la + lb)) > 1 else 1.0
    return {"mean_len": (sum(la) / len(la), sum(lb) / len(lb)), "cut": (cut_a / len(la), cut_b / len(lb)),
            "p": {"length_welch": float(welch), "length_ks": float(stats.ks_2samp(la, lb).pvalue),
                  "cut_fisher": float(stats.fisher_exact([[cut_a, len(la) - cut_a], [cut_b, len(lb) - cut_b]]).pvalue),
                  "first_token_chi2": float(first_p)}, "first_token_bins": len(rows[0])}


def report(a, runs: dict[str, dict]) -> tuple[str, dict]:
    from curve_stats import welch

    eos = set(runs["trl"]["eos"])
    per = [compare(o, t, eos) for o, t in zip(runs["infinite"]["samples"], runs["trl"]["samples"])]
    tests = len(per) * 4
    threshold = a.alpha / tests
    lines = [f"{a.samples} completions per prompt and trainer; a test differs below p = {a.alpha:g} / {tests} = "
             f"{threshold:.2g} (Bonferroni).", "",
             "| prompt | mean length (ours / TRL) | cut at max (ours / TRL) | p length Welch | p length KS | p cut Fisher "
             "| p first token chi2 |", "|---|---|---|---|---|---|---|"]
    differs = []
    for i, r in enumerate(per):
        p = r["p"]
        differs += [(i, k) for k, v in p.items() if v < threshold]
        lines.append(f"| {i} | {r['mean_len'][0]:.1f} / {r['mean_len'][1]:.1f} | {r['cut'][0]:.3f} / {r['cut'][1]:.3f} | "
                     f"{p['length_welch']:.3g} | {p['length_ks']:.3g} | {p['cut_fisher']:.3g} | "
                     f"{p['first_token_chi2']:.3g} ({r['first_token_bins']} bins) |")
    la = [len(c) for s in runs["infinite"]["samples"] for c in s]
    lb = [len(c) for s in runs["trl"]["samples"] for c in s]
    diff, low, high = welch(la, lb, 0.95)
    verdict = "same law (no test differs)" if not differs else "different: " + ", ".join(
        f"prompt {i} {k}" for i, k in differs)
    lines += ["", f"- pooled mean length: ours - TRL = {diff:+.2f} tokens, 95% interval [{low:+.2f}, {high:+.2f}]",
              f"- verdict at family-wise {a.alpha:g}: {verdict}"]
    return "\n".join(lines) + "\n", {"per_prompt": per, "threshold": threshold, "differs": differs,
                                     "pooled_length_diff": [diff, low, high]}


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.worker:
        return worker_main(a)
    header = run_header(torch.device("cpu"), "python benchmarks/rollout_law.py " + " ".join(sys.argv[1:]))
    runs = {}
    for kind in ("trl", "infinite"):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "law.json"
            argv = [sys.executable, __file__, *sys.argv[1:], "--worker", kind, "--result", str(result)]
            runs[kind] = run_subprocess(argv, result, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
        if "error" in runs[kind]:
            raise SystemExit(f"{TRAINERS[kind]}: {runs[kind]['error']}")
    if not runs["infinite"]["uses_engine"]:
        raise SystemExit("InfiniteGRPOTrainer fell back to generate: nothing of the engine to compare")
    markdown, data = report(a, runs)
    text = "\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + markdown
    print(text, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({**header, "args": vars(a), "report": data,
                                            "samples": {k: r["samples"] for k, r in runs.items()}}))
        Path(a.json).with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
