"""`python -m trl_infinite.sim --trace T.jsonl [...]`: decode steps of every sampling mode / scheduler on a trace.

The engine's settings are its flags (`--max_active_sequences 4`, `--block_size 16`, `--history_fallback prefix`:
the trainer's `rollout_<flag>`, `EngineConfig(<flag>=...)`); here `max_active_sequences` defaults to 4 and
`length_predictor` (the length-aware rows' predictor) to 'oracle'.

Rows (B = --prompts-per-call prompts per engine call, G from the trace, g = --max_active_sequences): micro_group /
fixed_slot / dynamic_slot with FIFO, then fixed_slot with every length-aware scheduler fed by --length_predictor,
and lrf with divided rollout (--row-chunk-tokens), "oracle" (infinite fed the true lengths, the paper's
Infinite-sampling*) and "bound" (sum over engine calls of max(longest, total work / g), which no g-slot schedule
beats). With --random-orders R, "fifo_random_order" is fixed_slot FIFO averaged over R random orders of each
prompt's samples: with one prompt per call, the expected steps of *any* policy that does not preempt and cannot
tell a prompt's samples apart (whatever it knows about the prompt), since its picks are then a uniformly random
order of exchangeable samples; the gap to "bound" is what only per-sample information or preemption can close. A
trace that revisits prompts (`record_traces.py --epochs 2`) is replayed epoch after epoch with the engine's
per-prompt history carried across calls; the table counts the calls of --eval-epochs only (default: the
last epoch), so the second epoch is scheduled with what the first one taught. With --prefix-mae (needs the SmolLM2
weights and traces with prefix ids) it also reports the prefix predictor's leave-one-prompt-out mean absolute error
at each k, and --length_predictor prefix uses those features in the replay.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, replace

from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.config.sections import flags
from trl_infinite.sim.replay import SimConfig, simulate
from trl_infinite.sim.traces import TraceRecord, load_trace


@dataclass(frozen=True)
class Row:
    label: str
    mode: str
    scheduler: str
    divided: bool = False  # run with `--row-chunk-tokens` (divided rollout) instead of `--chunk-tokens`


ROWS = [
    *(Row(mode, mode, "fifo") for mode in ("micro_group", "fixed_slot", "dynamic_slot")),
    *(Row(name, "fixed_slot", name) for name in ("fptas", "sjf", "infinite", "seer", "lfs", "lrf", "lfs_max")),
    Row("lrf+chunks", "fixed_slot", "lrf", divided=True),
]
ORACLE = Row("oracle", "fixed_slot", "infinite")


def eval_epochs(records: list[TraceRecord], wanted: list[int] | None) -> set[int]:
    return set(wanted) if wanted else {max(r.epoch for r in records)}


def run_table(records, base: SimConfig, predictor: str, features: dict | None = None, rows: list[Row] | None = None,
              epochs: set[int] | None = None, row_chunk_tokens: int = 128, random_orders: int = 0) -> list[dict]:
    """One dict per row: totals over the calls of `epochs` (default: the last epoch of the trace)."""
    epochs = epochs or eval_epochs(records, None)
    out = []
    for row in (rows or ROWS) + [ORACLE]:
        chunk_tokens = row_chunk_tokens if row.divided else base.engine.scheduling.chunk_tokens
        cfg = replace(base, engine=replace(base.engine, sampling_mode=row.mode, scheduler=row.scheduler,
                                           length_predictor="oracle" if row is ORACLE else predictor,
                                           chunk_tokens=chunk_tokens))
        res = simulate(records, cfg, features=features if row is not ORACLE else None)
        if not res.lengths_preserved:
            raise RuntimeError(f"{row.label}: a sample was lost or shortened (simulator bug).")
        counted, every = res.total(epochs), res.total()
        out.append({"policy": row.label, "mode": row.mode, "scheduler": row.scheduler, "chunk_tokens": chunk_tokens,
                    "calls": sum(e in epochs for e in res.epochs), "decode_steps": counted.decode_steps,
                    "bound": res.bound(epochs), "tail_steps": counted.tail_decode_steps,
                    "offloaded_blocks": counted.offloaded_blocks, "prediction_mae": counted.prediction_mae,
                    "constant_mae": counted.constant_mae, "scored_samples": len(counted.prediction_errors),
                    "parks": counted.parks, "mean_active": every.mean_active_sequences,
                    "peak_kv_blocks": every.peak_kv_blocks, "preemptions": every.preemptions,
                    "mean_length": every.generated_tokens / every.num_samples if every.num_samples else 0.0})
    bound = out[0]["bound"]
    if random_orders:
        steps = random_order_steps(records, base, epochs, random_orders)
        out.append({"policy": "fifo_random_order", "mode": "fixed_slot", "scheduler": "fifo",
                    "decode_steps": round(steps), "bound": bound, "orders": random_orders})
    out.append({"policy": "bound", "mode": "-", "scheduler": "-", "decode_steps": bound, "bound": bound})
    naive = next((r["decode_steps"] for r in out if r["policy"] == "micro_group"), None)
    fifo = next((r["decode_steps"] for r in out if r["policy"] == "fixed_slot"), None)
    for r in out:
        r["ratio"] = r["decode_steps"] / naive if naive else None
        r["x_fifo"] = r["decode_steps"] / fifo if fifo else None
        r["x_bound"] = r["decode_steps"] / bound
    return out


def random_order_steps(records: list[TraceRecord], base: SimConfig, epochs: set[int], orders: int,
                       seed: int = 0) -> float:
    """Mean decode steps of fixed_slot FIFO over the calls of `epochs` when each prompt's samples come in a random
    order (`orders` draws, seeded): see the module docstring for what it bounds."""
    if orders < 1:
        raise ValueError(f"`--random-orders` must be >= 1 to add the fifo_random_order row, got {orders}.")
    counted = [r for r in records if r.epoch in epochs]
    cfg = replace(base, engine=replace(base.engine, sampling_mode="fixed_slot", scheduler="fifo",
                                       length_predictor="none", chunk_tokens=None, history_max_prompts=0))
    rng = random.Random(seed)
    total = 0
    for _ in range(orders):
        # the per-sample fields that follow `lengths` are dropped rather than left describing other samples
        shuffled = [replace(r, lengths=rng.sample(r.lengths, len(r.lengths)), finished=None, prefix_ids=None,
                            completion_ids=None) for r in counted]
        total += simulate(shuffled, cfg).total().decode_steps
    return total / orders


def _fmt(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict], title: str) -> str:
    out = [f"### {title}", "", "| policy | decode steps | x micro_group | x fixed_slot | x bound | tail steps | "
           "offloaded blocks | pred. MAE | const. MAE | peak KV blocks |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['policy']} | {r['decode_steps']} | {_fmt(r['ratio'], '.2f')} | {_fmt(r['x_fifo'], '.3f')} | "
                   f"{r['x_bound']:.3f} | {_fmt(r.get('tail_steps'))} | {_fmt(r.get('offloaded_blocks'))} | "
                   f"{_fmt(r.get('prediction_mae'))} | {_fmt(r.get('constant_mae'))} | "
                   f"{_fmt(r.get('peak_kv_blocks'))} |")
    return "\n".join(out)


SIM_DEFAULTS = {"max_active_sequences": 4, "length_predictor": "oracle"}  # where the CLI's differ from the engine's


def _parser(kind: str):
    """The command-line parser of an `EngineConfig` setting of type `kind` ("none" for None where allowed)."""
    base = {"bool": lambda v: {"true": True, "false": False}.get(v.lower(), v), "int": int, "float": float}
    parse = base.get(kind.split(" ")[0], str)
    return (lambda v: None if v.lower() == "none" else parse(v)) if "None" in kind else parse


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", nargs="+", required=True, help="JSONL trace files (trl_infinite.sim.traces format).")
    p.add_argument("--prompts-per-call", type=int, default=1)
    p.add_argument("--row-chunk-tokens", type=int, default=128, help="Chunk of the `+chunks` rows.")
    p.add_argument("--policies", nargs="+", default=None, help=f"Rows to run (default all): "
                   f"{[r.label for r in ROWS]}; `oracle` and `bound` are always added.")
    p.add_argument("--eval-epochs", nargs="+", type=int, default=None,
                   help="Epochs whose calls are counted (default: the trace's last; earlier ones only teach).")
    p.add_argument("--prefix-mae", nargs="*", type=int, default=None, help="Report the prefix predictor MAE at "
                   "these k (e.g. 1 4 16 32); loads SmolLM2-135M-Instruct (developer option: needs a source checkout, "
                   "for `trl_infinite.testing`).")
    p.add_argument("--random-orders", type=int, default=0, help="Add the fifo_random_order row, averaged over this "
                   "many random orders of each prompt's samples (0: no such row).")
    p.add_argument("--json", default=None, help="Write every row as JSON here.")
    settings = p.add_argument_group("engine settings (EngineConfig flags; the engine's defaults but SIM_DEFAULTS)")
    for flag in flags(EngineConfig):
        settings.add_argument(f"--{flag.name}", type=_parser(flag.field.type), default=argparse.SUPPRESS,
                              help=flag.field.metadata["help"].replace("%", "%%"))
    args = p.parse_args(argv)
    if args.random_orders < 0:
        raise ValueError(f"`--random-orders` must be >= 0 (0: no fifo_random_order row), got {args.random_orders}.")
    names = {f.name for f in flags(EngineConfig)}
    engine = EngineConfig(**{**SIM_DEFAULTS, **{k: v for k, v in vars(args).items() if k in names}})
    base = SimConfig(engine, prompts_per_call=args.prompts_per_call)
    scheduling = engine.scheduling
    predictor, prefix_k = scheduling.length_predictor, scheduling.prefix_predictor.k
    rows = [r for r in ROWS if args.policies is None or r.label in args.policies]
    if args.policies is not None and len(rows) != len(set(args.policies)):
        raise ValueError(f"`--policies` must name rows of {[r.label for r in ROWS]}, got {args.policies}.")
    report = {}
    for path in args.trace:
        records = load_trace(path)
        feats, maes = None, {}
        if args.prefix_mae is not None or predictor == "prefix" or "prefix" in (
                scheduling.history_predictor.fallback if predictor == "history" else ""):
            from trl_infinite.sim.prefix_eval import evaluate_mae, features
            from trl_infinite.testing.offline_models import load_smollm2

            model, _ = load_smollm2()
            ks = sorted(set((args.prefix_mae or []) + [prefix_k]))
            allf = features(records, model.eval(), ks)
            maes = {k: evaluate_mae(records, allf[k]) for k in (args.prefix_mae or [])}
            feats = allf[prefix_k]
        epochs = eval_epochs(records, args.eval_epochs)
        table = run_table(records, base, predictor, feats, rows, epochs, args.row_chunk_tokens,
                          args.random_orders)
        name = records[0].dataset or path
        counted = [r for r in records if r.epoch in epochs]
        g = len(records[0].lengths)
        print(markdown(table, f"{name}: {len(counted)} prompts x G={g} in epoch(s) {sorted(epochs)} "
                       f"({table[0]['calls']} calls of {args.prompts_per_call}), g={scheduling.max_active_sequences}, "
                       f"predictor={predictor}"))
        for k, m in maes.items():
            print(f"prefix predictor k={k}: MAE {m['mae']:.1f} tokens (constant-mean baseline "
                  f"{m['baseline_mae']:.1f}, {m['samples']} samples, leave-one-prompt-out)")
        print()
        report[path] = {"rows": table, "prefix_mae": maes, "eval_epochs": sorted(epochs)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
