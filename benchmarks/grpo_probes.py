"""What `grpo_step.py` attaches to a trainer in its worker process: a phase clock at TRL's method boundaries, a
per-step probe (CPU and wall time, peak RSS, peak CUDA memory), and the hooks that force completion lengths.

Everything is attached from outside (instance attributes, one callback, one class attribute of `RolloutEngine`) and
removed again by `detach()`; the trainers themselves are not modified.

Phases are timed *exclusively*: a phase entered inside another one (a reward scored during the rollout, a log-prob
forward inside `compute_loss`, a backward called from inside `compute_loss`) is charged to the inner phase only, so
the named phases never sum to more than the step.
"""

from __future__ import annotations

import functools
import re
import resource
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, TrainerCallback
from trl_paths import ForcedLengthLogitsProcessor

GB = 1e9
PHASES = ("rollout", "reward", "forward", "backward", "optim")
# trainer method -> phase (the boundaries both TRL's and our trainer keep)
PHASE_METHODS = {
    "_generate_single_turn": "rollout",  # every call, tool-loop re-entries included
    "_calculate_rewards": "reward",
    "compute_loss": "forward",  # the training forward + loss
    "_get_per_token_logps_and_entropies": "forward",  # no-grad log-prob forwards outside compute_loss
}
INCLUSIVE_METHODS = ("_generate_and_score_completions",)  # timed as a whole too (JSON only)


# ----------------------------------------------------------------------------------------------------------- memory
def rss_high_water_bytes() -> int | None:
    """The process's peak resident set since the last `reset_rss_high_water()` (VmHWM), None off Linux."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def reset_rss_high_water() -> bool:
    """Resets VmHWM to the current RSS (writing "5" to /proc/self/clear_refs); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def getrusage_peak_rss_bytes() -> int:
    """`getrusage`'s peak RSS. Linux computes it from the same high-water mark that `reset_rss_high_water` resets,
    so after a reset it no longer covers what came before: `StepProbe.process_peak_rss_bytes` keeps the maximum."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


# ------------------------------------------------------------------------------------------------------ phase clock
class PhaseClock:
    """Exclusive CPU (`time.process_time`: every thread of the process) and wall time per phase. On CUDA the device
    is synchronised at every boundary, so the wall times hold the device work of their phase."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.stack: list[str] = []
        self.peak_rss: dict[str, int] = defaultdict(int)  # phase ("other" outside every phase) -> VmHWM bytes
        self.track_rss = False  # set by `StepProbe` when the high-water mark can be reset
        self.listeners: list = []  # called with the phase just charged at every boundary (`flop_floor.FloorProbe`)
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.inclusive_cpu: dict[str, float] = defaultdict(float)
        self.inclusive_wall: dict[str, float] = defaultdict(float)
        self._last = self.now()

    def now(self) -> tuple[float, float]:
        if self.cuda:
            torch.cuda.synchronize()
        return time.process_time(), time.perf_counter()

    def reset(self) -> None:
        self.cpu.clear()
        self.wall.clear()
        self.inclusive_cpu.clear()
        self.inclusive_wall.clear()
        self.peak_rss.clear()
        self._last = self.now()

    def _charge(self) -> None:
        cpu, wall = self.now()
        if self.stack:
            self.cpu[self.stack[-1]] += cpu - self._last[0]
            self.wall[self.stack[-1]] += wall - self._last[1]
        if self.track_rss:  # the high-water mark since the last boundary belongs to the phase that just ran
            phase = self.stack[-1] if self.stack else "other"
            self.peak_rss[phase] = max(self.peak_rss[phase], rss_high_water_bytes() or 0)
            reset_rss_high_water()
        for listener in self.listeners:
            listener(self.stack[-1] if self.stack else "other")
        self._last = cpu, wall

    def enter(self, phase: str) -> None:
        self._charge()
        self.stack.append(phase)

    def exit(self) -> None:
        self._charge()
        self.stack.pop()

    def timed(self, fn, phase: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return wrapper

    def timed_inclusive(self, fn, name: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            cpu, wall = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu2, wall2 = self.now()
                self.inclusive_cpu[name] += cpu2 - cpu
                self.inclusive_wall[name] += wall2 - wall

        return wrapper


@dataclass
class StepRecord:
    """One optimizer step, from `on_step_begin` to `on_step_end` (TRL's logging after the step is not included)."""

    cpu_s: float
    wall_s: float
    phases_cpu: dict[str, float]
    phases_wall: dict[str, float]
    inclusive_cpu: dict[str, float]
    inclusive_wall: dict[str, float]
    peak_rss_bytes: int | None  # VmHWM during the step (None: the high-water mark could not be reset)
    phase_peak_rss: dict[str, int]  # the same per phase (the clock resets VmHWM at every phase boundary)
    peak_cuda_bytes: int | None  # torch.cuda.max_memory_allocated during the step
    rss_end_bytes: int | None = None
    extra: dict = field(default_factory=dict)


class StepProbe(TrainerCallback):
    """Per-step clocks and memory peaks; also times the optimizer step (`on_pre_optimizer_step` ->
    `on_optimizer_step`) as the `optim` phase."""

    def __init__(self, clock: PhaseClock):
        self.clock = clock
        self.records: list[StepRecord] = []
        self._start = (0.0, 0.0)
        self._hwm_reset = False
        self._lifetime_peak = 0  # high-water marks read before each reset
        self._cuda_peak = 0  # CUDA peaks erased by resets during the step

    def process_peak_rss_bytes(self) -> int:
        """The whole process's peak RSS so far (model loading included), across the per-step and per-phase resets
        (each step's peak is the maximum of its phases')."""
        steps = (r.peak_rss_bytes or 0 for r in self.records)
        return max(self._lifetime_peak, rss_high_water_bytes() or 0, getrusage_peak_rss_bytes(), *steps)

    def reset_cuda_peak(self, reset):
        """`torch.cuda.reset_peak_memory_stats` that keeps the peak it erases (the engine resets it at each
        rollout), so a step's peak covers the whole step."""
        @functools.wraps(reset)
        def wrapper(*args, **kwargs):
            self._cuda_peak = max(self._cuda_peak, torch.cuda.max_memory_allocated())
            return reset(*args, **kwargs)

        return wrapper

    def on_step_begin(self, args, state, control, **kwargs):
        if self.clock.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_peak = 0
        self._lifetime_peak = self.process_peak_rss_bytes()
        self._hwm_reset = reset_rss_high_water()
        self.clock.track_rss = self._hwm_reset
        self.clock.reset()
        self._start = self.clock.now()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.clock.enter("optim")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.clock.exit()

    def on_step_end(self, args, state, control, **kwargs):
        cpu, wall = self.clock.now()
        if self.clock.stack:
            raise RuntimeError(f"phases still open at the end of a step: {self.clock.stack}")
        status_rss = _current_rss_bytes()
        end_hwm = rss_high_water_bytes() if self._hwm_reset else None
        phase_peaks = dict(self.clock.peak_rss)
        if end_hwm is not None:
            phase_peaks["other"] = max(phase_peaks.get("other", 0), end_hwm)
        self.clock.track_rss = False
        self.records.append(StepRecord(
            cpu_s=cpu - self._start[0], wall_s=wall - self._start[1],
            phases_cpu={p: self.clock.cpu.get(p, 0.0) for p in PHASES},
            phases_wall={p: self.clock.wall.get(p, 0.0) for p in PHASES},
            inclusive_cpu=dict(self.clock.inclusive_cpu), inclusive_wall=dict(self.clock.inclusive_wall),
            peak_rss_bytes=max(phase_peaks.values()) if end_hwm is not None else None, phase_peak_rss=phase_peaks,
            peak_cuda_bytes=max(self._cuda_peak, torch.cuda.max_memory_allocated()) if self.clock.cuda else None,
            rss_end_bytes=status_rss,
        ))


def _current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmRSS:\s+(\d+)\s+kB", f.read())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


# -------------------------------------------------------------------------------------------------- forced lengths
class ForcedLengths:
    """Completion lengths fixed per rollout call: call k (the k-th first-turn `_generate_single_turn`) gets
    `calls[k]`, one list of G lengths per prompt in TRL's row order (each prompt G times in a row).

    Whatever path the trainer's rollout takes, the lengths are imposed at its innermost public call:
    - `model.generate` (TRL's regular path, and ours when it falls back to it): `ForcedLengthLogitsProcessor`, EOS
      banned before the row's target and forced at it;
    - `model.generate_batch` (TRL's continuous batching): one request per row with `max_new_tokens` = its target and
      EOS disabled (continuous batching takes no per-request logits processor): the same number of forwards, the
      last token is a sampled one instead of EOS;
    - `RolloutEngine.generate` (ours): `forced_lengths=...`, the engine's own benchmark option (EOS ignored).
    After the call every row's completion must have exactly its target length (`RuntimeError` otherwise)."""

    def __init__(self, calls: list[list[list[int]]], eos_token_ids: list[int]):
        self.calls = calls
        self.eos_token_ids = list(eos_token_ids)
        self.done = 0  # rollout calls forced and checked
        self.targets: list[int] | None = None  # rows of the call under way
        self._by_prompt: dict[tuple, deque[int]] = {}  # the rollout's lengths per prompt, in sample order
        self.used: set[str] = set()  # which hooks forced something (reported)

    def begin(self, prompt_ids: list[list[int]], num_generations: int) -> None:
        if self.done >= len(self.calls):
            raise RuntimeError(f"rollout call {self.done + 1} has no forced lengths (only {len(self.calls)} drawn)")
        groups = self.calls[self.done]
        if len(prompt_ids) != len(groups) * num_generations or any(len(g) != num_generations for g in groups):
            raise RuntimeError(f"forced lengths are drawn for {len(groups)} prompts x G={len(groups[0])} but the "
                               f"rollout got {len(prompt_ids)} rows with num_generations={num_generations}")
        self.targets = [n for g in groups for n in g]
        self._by_prompt = defaultdict(deque)
        for i, g in enumerate(groups):
            rows = prompt_ids[i * num_generations:(i + 1) * num_generations]
            if any(list(r) != list(rows[0]) for r in rows):
                raise RuntimeError("rows of one group hold different prompts: not TRL's layout")
            self._by_prompt[tuple(rows[0])].extend(g)

    def end(self, completion_ids: list) -> None:
        got = [len(c) for c in completion_ids]
        want, self.targets = self.targets, None
        if got != want:
            bad = sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
            raise RuntimeError(f"rollout call {self.done + 1}: {bad} of {len(want)} completions do not have their "
                               f"forced length (got {got}, want {want}); results discarded.")
        self.done += 1

    def _take(self, prompt, n: int) -> list[int]:
        """The next `n` lengths of this prompt's group (an engine call may take a group in parts)."""
        left = self._by_prompt.get(tuple(prompt))
        if left is None or len(left) < n:
            raise RuntimeError(f"the engine was asked for {n} samples of a prompt with "
                               f"{0 if left is None else len(left)} forced lengths left in this rollout")
        return [left.popleft() for _ in range(n)]

    # ---- hooks
    def generate(self, original):
        @functools.wraps(original)
        def generate(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if self.targets is None or ids is None or ids.shape[0] != len(self.targets):
                return original(*args, **kwargs)
            forced = ForcedLengthLogitsProcessor(self.targets, ids.shape[1], self.eos_token_ids, ids.device)
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), forced])
            self.used.add("generate")
            return original(*args, **kwargs)

        return generate

    def generate_batch(self, model, original):
        @functools.wraps(original)
        def generate_batch(inputs, generation_config=None, continuous_batching_config=None, **kwargs):
            if self.targets is None or len(inputs) != len(self.targets):
                return original(inputs, generation_config=generation_config,
                                continuous_batching_config=continuous_batching_config, **kwargs)
            self.used.add("generate_batch")
            return _forced_generate_batch(model, inputs, self.targets, generation_config, continuous_batching_config)

        return generate_batch

    def engine_generate(self, original):
        @functools.wraps(original)
        def generate(engine, prompt_ids, num_generations=1, sampling=None, forced_lengths=None, **kwargs):
            if self.targets is not None and forced_lengths is None:
                forced_lengths = [self._take(p, num_generations) for p in prompt_ids]
                self.used.add("engine")
            return original(engine, prompt_ids, num_generations=num_generations, sampling=sampling,
                            forced_lengths=forced_lengths, **kwargs)

        return generate


@torch.no_grad()
def _forced_generate_batch(model, inputs, targets, generation_config, cb_config) -> dict:
    """`generate_batch`'s loop with one `add_request` per row: `max_new_tokens` = the row's target, EOS disabled."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max(map(len, inputs)), max(targets), len(inputs))
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=cb_config, block=True, timeout=5,
        workload_hints=hints,
    ) as manager:
        ids = [f"forced_{i}" for i in range(len(inputs))]
        order = range(len(inputs))
        if getattr(manager, "_use_prefix_sharing", False):  # as `add_requests`: sorted for prefix-cache hits
            order = sorted(order, key=lambda i: inputs[i], reverse=True)
        for i in order:
            manager.add_request(list(inputs[i]), request_id=ids[i], max_new_tokens=targets[i], eos_token_id=-1)
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("continuous batching thread stopped before finishing every request")
    return {i: results[i] for i in ids}


# --------------------------------------------------------------------------------------------------------- attach
class Instrumented:
    """Attaches the clock, the probe and (optionally) the forced-length hooks to a built trainer; `detach()` undoes
    every patch."""

    def __init__(self, trainer, forced: ForcedLengths | None):
        self.trainer = trainer
        self.cuda = trainer.accelerator.device.type == "cuda"
        self.clock = PhaseClock(self.cuda)
        self.probe = StepProbe(self.clock)
        self.forced = forced
        self._undo: list = []
        for name, phase in PHASE_METHODS.items():
            original = getattr(trainer, name)
            wrapped = self.clock.timed(original, phase)
            if name == "_generate_single_turn" and forced is not None:
                wrapped = self._forcing_rollout(wrapped)
            self._set(trainer, name, wrapped)
        for name in INCLUSIVE_METHODS:
            self._set(trainer, name, self.clock.timed_inclusive(getattr(trainer, name), name))
        self._set(trainer.accelerator, "backward", self.clock.timed(trainer.accelerator.backward, "backward"))
        trainer.add_callback(self.probe)
        if self.cuda:
            self._set(torch.cuda, "reset_peak_memory_stats", self.probe.reset_cuda_peak(torch.cuda.reset_peak_memory_stats))
        self._undo.append(lambda: trainer.remove_callback(self.probe))
        if forced is not None:
            model = trainer.accelerator.unwrap_model(trainer.model)
            self._set(model, "generate", forced.generate(model.generate))
            self._set(model, "generate_batch", forced.generate_batch(model, model.generate_batch))
            from trl_infinite.engine import RolloutEngine

            original = RolloutEngine.generate
            RolloutEngine.generate = forced.engine_generate(original)
            self._undo.append(lambda: setattr(RolloutEngine, "generate", original))

    def _set(self, obj, name: str, value) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def _forcing_rollout(self, rollout):
        forced = self.forced

        @functools.wraps(rollout)
        def wrapper(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
            if forced.targets is not None:  # a re-entry (tool loop, fallback): the outer call checks
                return rollout(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
            forced.begin(prompt_ids, num_generations)
            try:
                completion_ids, logprobs = rollout(prompt_ids, images, multimodal_fields, num_generations, *args,
                                                   **kwargs)
            except BaseException:
                forced.targets = None
                raise
            forced.end(completion_ids)
            return completion_ids, logprobs

        return wrapper

    def detach(self) -> None:
        while self._undo:
            self._undo.pop()()
