"""`python -m trl_infinite.sim --trace T.jsonl [...]`: decode steps of every sampling mode / scheduler on a trace.

Rows (the paper's Table 1/2 setup: B=1 prompt per call, G from the trace, g = --slots):
micro_group / fixed_slot / dynamic_slot with FIFO, then fixed_slot with fptas, sjf, infinite, seer, lfs fed by
--predictor, "oracle" (infinite fed the true lengths, the paper's Infinite-sampling*) and "bound"
(sum over engine calls of max(longest, total work / g), no schedule can beat it). Ratios are to micro_group.
With --prefix-mae (needs the SmolLM2 weights and traces with prefix ids) it also reports the prefix predictor's
leave-one-prompt-out mean absolute error at each k, and --predictor prefix uses those features in the replay.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from ..utils.traces import load_trace
from .replay import SimConfig, oracle_bound, simulate

ROWS = [
    ("micro_group", "micro_group", "fifo"),
    ("fixed_slot", "fixed_slot", "fifo"),
    ("dynamic_slot", "dynamic_slot", "fifo"),
    ("fptas", "fixed_slot", "fptas"),
    ("sjf", "fixed_slot", "sjf"),
    ("infinite", "fixed_slot", "infinite"),
    ("seer", "fixed_slot", "seer"),
    ("lfs", "fixed_slot", "lfs"),
]


def run_table(records, base: SimConfig, predictor: str, features: dict | None = None) -> list[dict]:
    rows = []
    for label, mode, sched in ROWS + [("oracle", "fixed_slot", "infinite")]:
        cfg = replace(base, sampling_mode=mode, scheduler=sched,
                      length_predictor="oracle" if label == "oracle" else predictor)
        res = simulate(records, cfg, features=features if label != "oracle" else None)
        if not res.lengths_preserved:
            raise RuntimeError(f"{label}: a sample was lost or shortened (simulator bug).")
        rows.append({"policy": label, "mode": mode, "scheduler": sched, **asdict(res), "mean_length": res.mean_length})
    per_call = base.prompts_per_call  # the bound holds per engine call: its samples share the `slots`
    calls = [records[i : i + per_call] for i in range(0, len(records), per_call)]
    bound = sum(oracle_bound([n for r in call for n in r.lengths], base.slots) for call in calls)
    rows.append({"policy": "bound", "mode": "-", "scheduler": "-", "decode_steps": bound})
    naive = rows[0]["decode_steps"]
    for r in rows:
        r["ratio"] = r["decode_steps"] / naive
    return rows


def markdown(rows: list[dict], title: str) -> str:
    out = [f"### {title}", "", "| policy | decode steps | x micro_group | mean active | peak KV blocks | tail steps "
           "| preemptions | mean length | pred. MAE |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mae = r.get("prediction_mae")
        out.append(f"| {r['policy']} | {r['decode_steps']} | x{r['ratio']:.2f} | {r.get('mean_active', 0):.2f} | "
                   f"{r.get('peak_kv_blocks', '-')} | {r.get('tail_steps', '-')} | {r.get('preemptions', '-')} | "
                   f"{r.get('mean_length', 0):.0f} | {'-' if mae is None else f'{mae:.0f}'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", nargs="+", required=True, help="JSONL trace files (trl_infinite.utils.traces format).")
    p.add_argument("--slots", type=int, default=4, help="g: decode slots (micro-group size).")
    p.add_argument("--prompts-per-call", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--predictor", default="oracle", choices=["oracle", "group", "prefix", "none"])
    p.add_argument("--prefix-k", type=int, default=16)
    p.add_argument("--fptas-epsilon", type=float, default=0.1)
    p.add_argument("--chunk-tokens", type=int, default=None)
    p.add_argument("--prefix-mae", nargs="*", type=int, default=None, help="Report the prefix predictor MAE at "
                   "these k (e.g. 1 4 16 32); loads SmolLM2-135M-Instruct.")
    p.add_argument("--json", default=None, help="Write every row as JSON here.")
    args = p.parse_args(argv)
    base = SimConfig(slots=args.slots, prompts_per_call=args.prompts_per_call, block_size=args.block_size,
                     prefix_k=args.prefix_k, fptas_epsilon=args.fptas_epsilon, chunk_tokens=args.chunk_tokens)
    report = {}
    for path in args.trace:
        records = load_trace(path)
        feats, maes = None, {}
        if args.prefix_mae is not None or args.predictor == "prefix":
            from ..utils.offline_models import load_smollm2
            from .prefix_eval import evaluate_mae, features

            model, _ = load_smollm2()
            ks = sorted(set((args.prefix_mae or []) + [args.prefix_k]))
            allf = features(records, model.eval(), ks)
            maes = {k: evaluate_mae(records, allf[k]) for k in (args.prefix_mae or [])}
            feats = allf[args.prefix_k]
        rows = run_table(records, base, args.predictor, feats)
        name = records[0].dataset or path
        g = len(records[0].lengths)
        print(markdown(rows, f"{name}: {len(records)} prompts, G={g}, g={args.slots}, predictor={args.predictor}"))
        for k, m in maes.items():
            print(f"prefix predictor k={k}: MAE {m['mae']:.1f} tokens (constant-mean baseline "
                  f"{m['baseline_mae']:.1f}, {m['samples']} samples, leave-one-prompt-out)")
        print()
        report[path] = {"rows": rows, "prefix_mae": maes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
