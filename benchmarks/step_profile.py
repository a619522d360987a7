"""Where a GRPO step's time goes: `torch.profiler` over one step of each trainer, per phase and per operator.

`grpo_step.py` says how long each phase takes and how far that is from its FLOP floor; this says what fills the gap.
Each trainer runs in its own process with `grpo_step.py`'s model, data, config and forced lengths (every option of
that script is accepted here and means the same); its last step (`--steps`, default 2: one warm-up) runs under
`torch.profiler`. Phases are `grpo_step.py`'s (the same method boundaries), marked as profiler ranges; the step as a
whole is the range `other` (the step less the named phases). An operator is charged to the innermost phase range in
which it starts (exclusive, as `grpo_step.py`'s clock; on CUDA a kernel by its start on the device: the clock
synchronises the device at every boundary).

Tables (the JSON and a .md beside it with `--json`):
- per phase: `time_s` (the phase's exclusive time under the profiler), then that time split by the operators' self
  CPU time into `gemm_s` (matrix products: mm, addmm, bmm, baddbmm, ...), `attention_s` (operators named
  `*attention*`), `other_ops_s` (every other operator: elementwise, norms, copies, sampling, the optimizer's ops)
  and `host_s` (time in no operator: Python, the trainers' and the engine's host code, and the ranges' own time).
  On CUDA also `gpu_s` (kernel time on the device) split into `gpu_gemm_s`, `gpu_attention_s`, `gpu_other_s`, and
  `gpu_idle_s` (the phase's time with no kernel running: host-bound).
- top operators: per phase the `--top` operators by self CPU time (on CUDA, also the top kernels by device time),
  with their calls and share of the phase.

The profiler slows every operator call a little (microseconds): the shares are this run's, the times are not
`grpo_step.py`'s (quote those from it).

    python benchmarks/step_profile.py --sizes 8x2@128 --trainers infinite trl --json /tmp/profile.json
    python benchmarks/step_profile.py --model qwen3-0.6b --sizes 16x1@512 --lengths forced --json ...   # GPU
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table, pick_device, run_header, save_json, write_results  # noqa: E402
from grpo_probes import PHASES  # noqa: E402
from grpo_step import TRAINERS, forced_calls, run_order  # noqa: E402
from grpo_step import parse_args as step_args  # noqa: E402
from grpo_workers import run_subprocess  # noqa: E402

PHASE_PREFIX = "phase::"
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_",
                      "aten::addmv", "aten::addmv_", "aten::mv", "aten::dot", "aten::addbmm", "aten::addbmm_",
                      "aten::_addmm_activation", "aten::matmul", "aten::linear", "aten::_scaled_mm",
                      "aten::_grouped_mm"})
# device kernels of matrix products: cuBLAS / cuBLASLt (`*gemm*`, `gemv*`, `*xmma*`, `nvjet_*`), CUTLASS. Not an
# architecture prefix alone (`sm90_...`): cuDNN's and others' non-GEMM kernels carry one too
GEMM_KERNEL_MARKS = ("gemm", "gemv", "xmma", "cutlass", "cublas", "nvjet", "tensorop")
DEVICE_ACTIVITIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})  # kineto's activity types of device work
CLASS_COLUMNS = ("gemm_s", "attention_s", "other_ops_s", "host_s")
GPU_COLUMNS = ("gpu_s", "gpu_gemm_s", "gpu_attention_s", "gpu_other_s", "gpu_idle_s")
PHASE_TABLE = ["size", "trainer", "phase", "time_s", *CLASS_COLUMNS, *GPU_COLUMNS, "gemm_share"]
TOP_TABLE = ["size", "trainer", "phase", "where", "op", "calls", "self_s", "share"]


@dataclass(frozen=True)
class Event:
    """One profiled event, reduced to what the attribution needs (times in microseconds)."""

    name: str
    start: float
    end: float
    self_us: float
    device: bool = False  # a kernel (or copy) on the accelerator: `end - start` is its device time


def op_class(name: str, device: bool = False) -> str:
    """`gemm`, `attention` or `other` for an operator (CPU) or a kernel name (device)."""
    low = name.lower()
    if "attention" in low or "flash" in low or "fmha" in low or "sdpa" in low:
        return "attention"
    if device:
        return "gemm" if any(mark in low for mark in GEMM_KERNEL_MARKS) else "other"
    return "gemm" if name in GEMM_OPS else "other"


def is_operator(name: str) -> bool:
    """A dispatched operator (`namespace::op`); a user range (`Optimizer.step#AdamW.step`, a phase, the autograd
    engine's `autograd::engine::evaluate_function: ...`) or a runtime call (`cudaLaunchKernel`) is host time."""
    return ("::" in name and "#" not in name and not name.startswith(PHASE_PREFIX)
            and not name.startswith("autograd::"))


class Attribution:
    """Per phase: its exclusive time and the class sums (module docstring), and its operators and kernels; summed
    over the profiles `add`ed (one per profiled stretch of the step)."""

    def __init__(self):
        self.sums: dict[str, dict] = defaultdict(lambda: defaultdict(float))
        self.ops: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])

    def add(self, events: list[Event]) -> None:
        """One profile's events. Phases are the events named `phase::NAME`; they nest (a phase inside another is
        charged to the inner one); an event outside every phase is charged to `outside`."""
        ranges = sorted((e for e in events if e.name.startswith(PHASE_PREFIX) and not e.device),
                        key=lambda e: (e.start, -e.end))
        starts = [r.start for r in ranges]
        phase_of = [r.name.removeprefix(PHASE_PREFIX) for r in ranges]
        sums = self.sums

        def innermost(t: float) -> int | None:
            i = bisect.bisect_right(starts, t) - 1
            while i >= 0:  # ranges nest: the latest-starting range that still holds t is the innermost
                if ranges[i].end >= t:
                    return i
                i -= 1
            return None

        stack: list[int] = []  # the ranges holding the current one (sweep by start)
        for i, r in enumerate(ranges):  # exclusive time: the range less the ranges directly inside it
            while stack and not ranges[stack[-1]].end >= r.end:
                stack.pop()
            sums[phase_of[i]]["time_s"] += (r.end - r.start) / 1e6
            sums[phase_of[i]]["host_s"] += r.self_us / 1e6
            if stack:
                sums[phase_of[stack[-1]]]["time_s"] -= (r.end - r.start) / 1e6
            stack.append(i)
        for e in events:
            if e.name.startswith(PHASE_PREFIX) and not e.device:
                continue
            i = innermost(e.start)
            phase = phase_of[i] if i is not None else "outside"
            if e.device:
                seconds = (e.end - e.start) / 1e6
                sums[phase]["gpu_s"] += seconds
                sums[phase][f"gpu_{op_class(e.name, True)}_s"] += seconds
                where = "gpu"
            elif is_operator(e.name):
                seconds = e.self_us / 1e6
                column = {"gemm": "gemm_s", "attention": "attention_s"}.get(op_class(e.name), "other_ops_s")
                sums[phase][column] += seconds
                where = "cpu"
            else:
                sums[phase]["host_s"] += e.self_us / 1e6
                continue
            slot = self.ops[(phase, where, e.name)]
            slot[0] += 1
            slot[1] += seconds

    def result(self, top: int) -> tuple[dict[str, dict], dict[str, list[dict]]]:
        """(per phase its row, per phase its `top` operators and `top` kernels by self time)."""
        phases = {}
        for phase, s in self.sums.items():
            row = dict(s)
            if "gpu_s" in row:
                row["gpu_idle_s"] = max(row.get("time_s", 0.0) - row["gpu_s"], 0.0)
            cpu_total = sum(row.get(c, 0.0) for c in CLASS_COLUMNS)
            row["gemm_share"] = (row.get("gpu_gemm_s", 0.0) / row["time_s"] if "gpu_s" in row
                                 else row.get("gemm_s", 0.0) / cpu_total if cpu_total else None)
            phases[phase] = row
        tops: dict[str, list[dict]] = defaultdict(list)
        for (phase, where, name), (calls, seconds) in sorted(self.ops.items(), key=lambda kv: -kv[1][1]):
            if sum(t["where"] == where for t in tops[phase]) < top:
                time_s = phases.get(phase, {}).get("time_s") or None
                tops[phase].append({"where": where, "op": name, "calls": calls, "self_s": seconds,
                                    "share": seconds / time_s if time_s else None})
        return phases, dict(tops)


def attribute(events: list[Event], top: int) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """`Attribution` of one profile."""
    acc = Attribution()
    acc.add(events)
    return acc.result(top)


def self_times(spans: list[tuple[float, float]]) -> list[float]:
    """Each span's time less the spans directly inside it, for the spans of one thread (they nest: a call inside
    another starts and ends within it)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1]))
    own = [end - start for start, end in spans]
    stack: list[int] = []
    for i in order:
        start, end = spans[i]
        while stack and spans[stack[-1]][1] < end:
            stack.pop()
        if stack:
            own[stack[-1]] -= end - start
        stack.append(i)
    return own


def reduce_events(prof) -> list[Event]:
    """The profiler's raw events as `Event`s: CPU events with their self time (from the nesting of each thread's
    events), device kernels and copies with their device span. Kineto's events are read directly, not through the
    profiler's `FunctionEvent`s, which hold gigabytes for a step of a few hundred thousand operator calls."""
    results = getattr(prof.profiler, "kineto_results", None)  # (not a documented attribute: torch 2.11 and 2.13 have it)
    if results is None:
        raise RuntimeError(f"torch {torch.__version__}'s profiler has no `kineto_results`: step_profile.py reads the raw "
                           "events from it (tested with torch 2.11 to 2.14)")
    raw = results.events()
    cpu: dict[int, list[int]] = defaultdict(list)
    out: list[Event] = []
    spans = [(e.start_ns() / 1e3, e.end_ns() / 1e3) for e in raw]
    for i, e in enumerate(raw):
        if e.device_type() == torch.autograd.DeviceType.CPU:
            if not e.is_async() and e.start_thread_id() == e.end_thread_id():  # async spans do not nest
                cpu[e.start_thread_id()].append(i)
        elif e.activity_type() in DEVICE_ACTIVITIES:  # not the device's copies of the ranges (gpu_user_annotation)
            out.append(Event(e.name(), *spans[i], 0.0, True))
    for indices in cpu.values():
        for i, own in zip(indices, self_times([spans[i] for i in indices])):
            out.append(Event(raw[i].name(), *spans[i], own))
    return out


class ProfiledPhases:
    """Marks the clock's phases as profiler ranges and profiles the trainer's last step: the whole step (`phases`
    None; the step itself is the range `other`), or only the stretches inside the named phases, one profile each,
    reduced as it ends (the profiler holds every event of a profile in memory: a CPU rollout of `generate` records
    millions). Its `callback` is added after the step probe, so the step's clocks are reset before it starts."""

    def __init__(self, clock, last_step: int, cuda: bool, phases: set[str] | None = None):
        from transformers import TrainerCallback

        self.last_step, self.cuda, self.phases = last_step, cuda, phases
        self.prof = None
        self.in_last_step = False
        self.profiles = 0
        self.attribution = Attribution()
        self._open: list = []  # the record_function ranges open, innermost last
        self._root = 0  # with `phases`: the depth at which the running profile's phase was entered
        enter, leave = clock.enter, clock.exit

        def marked_enter(phase: str) -> None:
            enter(phase)
            if self.in_last_step and self.phases is not None and self.prof is None and phase in self.phases:
                self.start()
                self._root = len(self._open) + 1
            self._push(phase)

        def marked_exit() -> None:
            ending = self.phases is not None and self.prof is not None and len(self._open) == self._root
            self._pop()
            if ending:
                self.stop()
            leave()

        clock.enter, clock.exit = marked_enter, marked_exit
        owner = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                owner.in_last_step = state.global_step + 1 == owner.last_step
                if owner.in_last_step and owner.phases is None:
                    owner.start()
                    owner._push("other")

            def on_step_end(self, args, state, control, **kwargs):
                if owner.in_last_step and owner.phases is None:
                    owner._pop()
                    owner.stop()
                owner.in_last_step = False

        self.callback = Callback()

    def _push(self, phase: str) -> None:
        rf = torch.autograd.profiler.record_function(PHASE_PREFIX + phase)
        rf.__enter__()
        self._open.append(rf)

    def _pop(self) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities)
        self.prof.__enter__()

    def stop(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self.attribution.add(reduce_events(self.prof))
        self.prof = None
        self.profiles += 1


def run_worker(a, kind: str, size) -> dict:
    from grpo_probes import ForcedLengths, Instrumented
    from grpo_setup import build_trainer

    device = pick_device(a.device)
    torch.set_num_threads(a.threads)
    trainer = build_trainer(a, kind, size, device)
    forced = ForcedLengths(forced_calls(a, size)[0], trainer.eos_token_ids) if a.lengths == "forced" else None
    instrumented = Instrumented(trainer, forced)
    profiled = ProfiledPhases(instrumented.clock, a.steps, instrumented.cuda,
                              set(a.phases) if a.phases is not None else None)
    trainer.add_callback(profiled.callback)
    trainer.train()
    if not profiled.profiles:
        raise RuntimeError("the last step was not profiled")
    phases, tops = profiled.attribution.result(a.top)
    return {"trainer": kind, "size": size.name, "phases": phases, "tops": tops,
            "uses_engine": getattr(trainer, "uses_engine", None), "device": str(device)}


def parse_args(argv=None) -> argparse.Namespace:
    """`grpo_step.py`'s arguments plus `--top` and `--phases` (`rest`: the former, passed on to the workers)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--top", type=int, default=8, help="operators (and kernels) listed per phase")
    extra.add_argument("--phases", nargs="+", default=None, choices=PHASES,
                       help="profile only these phases (default: the whole step)")
    mine, rest = extra.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
    if mine.top < 1:
        raise SystemExit(f"--top must be >= 1, got {mine.top}")
    a = step_args(rest)
    a.top, a.phases, a.rest = mine.top, mine.phases, rest
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    argv, rest = list(sys.argv[1:] if argv is None else argv), a.rest
    if a.worker is not None:
        try:
            result = run_worker(a, a.worker, a.sizes[0])
        except BaseException as err:
            Path(a.result).write_text(json.dumps({"error": f"{type(err).__name__}: {err}"[:2000]}))
            traceback.print_exc()
            sys.exit(1)
        Path(a.result).write_text(json.dumps(result))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = pick_device(a.device)
    header = run_header(device, "python benchmarks/step_profile.py " + " ".join(argv))
    header["profiled"] = (f"step {a.steps} of {a.steps} (the ones before are warm-ups), "
                          + (f"phases {', '.join(a.phases)} only" if a.phases else "the whole step")
                          + ", torch.profiler, one process per trainer")
    phase_table, top_table = Table(PHASE_TABLE), Table(TOP_TABLE, echo=False)  # (the top operators: at the end)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads),
           "PYTHONUNBUFFERED": "1"}
    failed = False
    with tempfile.TemporaryDirectory(prefix="step_profile_") as tmp:
        for size in a.sizes:
            for kind in run_order(a.trainers):
                result = Path(tmp) / f"{size.name}_{kind}.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--top", str(a.top), *rest,
                       *(["--phases", *a.phases] if a.phases else []),
                       "--worker", kind, "--result", str(result), "--sizes", size.name]
                data = run_subprocess(cmd, result, env)
                if "error" in data:
                    failed = True
                    phase_table.add(size=size.name, trainer=TRAINERS[kind], phase=f"failed: {data['error']}")
                    continue
                for phase in ("rollout", "reward", "forward", "backward", "optim", "other", "outside"):
                    if phase in data["phases"]:
                        row = data["phases"][phase]
                        phase_table.add(size=size.name, trainer=TRAINERS[kind], phase=phase,
                                        **{c: row.get(c) for c in PHASE_TABLE[3:]})
                    for t in data["tops"].get(phase, []):
                        top_table.add(size=size.name, trainer=TRAINERS[kind], phase=phase, **t)
                save_json(a.json, header, phase_table, {"top": top_table.rows})
    write_results(a.json, header, phase_table, {"top": top_table.rows})
    print("\n## Top operators\n\n" + top_table.markdown(), flush=True)
    if a.json:
        md = Path(a.json).with_suffix(".md")
        md.write_text(md.read_text() + "\n## Top operators\n\n" + top_table.markdown() + "\n")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
