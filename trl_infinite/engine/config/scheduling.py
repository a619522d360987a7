"""`SchedulingConfig`, the section of `EngineConfig` that says which samples run together, and its plug-ins' own
sections (the length predictors', the scheduling and admission policies'); declared with `sections.py`'s machinery."""

from __future__ import annotations

from dataclasses import dataclass

from trl_infinite.engine.config.registry import BATCH_POLICIES, PREDICTORS, SAMPLING_MODES, SCHEDULERS
from trl_infinite.engine.config.sections import Section, section, setting
from trl_infinite.engine.config.validate import choice

HISTORY_FALLBACKS = ("none", "siblings", "prefix", "siblings+prefix")
DEFAULT_MAX_BATCH = 256  # largest decode batch where no slot limit bounds it (the SLA bound, CUDA graphs)

_POLICIES = "engine/sched/policies/"
_PREDICTORS = "engine/sched/predictors/"


@dataclass(frozen=True)
class PrefixPredictorConfig(Section):
    """The 'prefix' length predictor (also the prefix link of the 'history' chain)."""

    flag_prefix = "prefix_predictor_"
    k: int = setting(16, "k: prefix tokens the 'prefix' predictor reads.", (f"{_PREDICTORS}base.py", "sim/__main__.py"))
    min_train: int = setting(8, "'prefix' predictor: finished samples its head needs before it predicts.",
                             (f"{_PREDICTORS}base.py",))
    l2: float | None = setting(None, "'prefix' predictor: ridge penalty of its head (None = chosen by "
                               "leave-one-prompt-out error).", (f"{_PREDICTORS}base.py",))


@dataclass(frozen=True)
class HistoryPredictorConfig(Section):
    """The 'history' length predictor's chain after the prompt's own history."""

    flag_prefix = "history_"
    fallback: str = setting(
        "none", "length_predictor='history': what predicts a prompt with no history, before the mean of recent "
        "lengths: 'none', 'siblings' (this call's finished siblings, Seer), 'prefix' (the prefix head; unseen "
        "prompts' samples probe their first k tokens) or 'siblings+prefix'.",
        (f"{_PREDICTORS}history.py", "sim/__main__.py"),
        choices=HISTORY_FALLBACKS)
    mean_window: int = setting(4096, "length_predictor='history': recent finished lengths behind its global mean.",
                               (f"{_PREDICTORS}history.py",))


@dataclass(frozen=True)
class FPTASConfig(Section):
    flag_prefix = "fptas_"
    epsilon: float = setting(0.1, "FPTAS tolerance: plan <= (1 + eps) * optimum.", (f"{_POLICIES}length_aware.py",),
                             bounds="(0, 1]")


@dataclass(frozen=True)
class SLAConfig(Section):
    """batch_policy='sla': binary search of the batch bound on the measured decode step latency."""

    flag_prefix = "sla_"
    decode_ms: float | None = setting(None, "batch_policy='sla': target decode step latency in milliseconds.",
                                      (f"{_POLICIES}admission.py",))
    tolerance_ms: float | None = setting(
        None, "batch_policy='sla': band around `sla_decode_ms` within which the batch bound stays (None = 5% of the "
        "target).", (f"{_POLICIES}admission.py",))
    min_batch: int = setting(1, f"batch_policy='sla': smallest batch bound (the largest is `max_active_sequences`, "
                             f"{DEFAULT_MAX_BATCH} when None).", (f"{_POLICIES}admission.py",))
    alpha: int = setting(2, "batch_policy='sla': width of the batch-size search window.", (f"{_POLICIES}admission.py",))
    delta: int = setting(1, "batch_policy='sla': step by which the window widens.", (f"{_POLICIES}admission.py",),
                         minimum=0)
    window: int = setting(4, "batch_policy='sla': decode steps measured per adjustment of the bound.",
                          (f"{_POLICIES}admission.py",))


@dataclass(frozen=True)
class MemoryConfig(Section):
    """batch_policy='memory': admission from the expected KV growth of the running samples."""

    flag_prefix = "memory_"
    eps: float = setting(
        0.05, "batch_policy='memory': eps_m, the probability that the running samples outgrow the pool (the safety "
        "buffer is Phi^-1(1 - eps_m) standard deviations).", (f"{_POLICIES}admission.py",), bounds="(0, 1)")
    min_observations: int = setting(
        4, "batch_policy='memory': finished samples before their length statistics are used (until then every "
        "sample is assumed to reach `max_new_tokens`).", (f"{_POLICIES}admission.py",))


@dataclass(frozen=True)
class SchedulingConfig(Section):
    """Which samples run together: the sampling mode, the ordering (scheduler) and admission (batch policy) plug-ins
    with their options, the length predictor, divided rollout."""

    sampling_mode: str = setting(
        "fixed_slot", f"How samples share the decode batch: one of {list(SAMPLING_MODES)}.", ("engine/call.py",),
        choices=SAMPLING_MODES)
    max_active_sequences: int | None = setting(
        32, "g: decode slots (micro-group size) of `micro_group` and `fixed_slot`. `full_group` runs every sample at "
        "once and `dynamic_slot` as many as memory allows, so both ignore it.",
        ("engine/sched/slot_modes.py", f"{_POLICIES}admission.py", "sim/replay.py", "sim/__main__.py", "trainer/reward_scoring.py"))
    scheduler: str = setting(
        "lfs", "Order in which pending samples take free slots. Default 'lfs' with the 'history' predictor: prompts "
        "that produced longer completions on earlier visits start first (FIFO order for prompts never seen); chosen "
        "from the simulator on recorded traces (benchmarks/RESULTS.md).", ("engine/call.py",), choices=SCHEDULERS)
    batch_policy: str = setting("static", "How many samples run at once.", ("engine/call.py",), choices=BATCH_POLICIES)
    length_predictor: object = setting(
        "history", "Length predictor of length-aware schedulers (sjf, lfs, lrf, fptas, infinite): 'history' (the "
        "prompt's lengths on earlier calls, then `history_fallback`, then the mean of recent lengths), 'prefix' "
        "(online regression head on the policy's hidden state at completion token k), 'group', 'oracle' (forced "
        "lengths; benchmarks), 'none', a callable (prompt_ids, prefix_ids) -> length, or a sequence-classification "
        "model.", (f"{_PREDICTORS}base.py", "sim/__main__.py"))
    chunk_tokens: int | None = setting(
        None, "Divided rollout: a sample decodes at most this many tokens, then returns to the queue with its KV kept "
        "(moved to host memory when the pool needs room). None = off.", ("engine/call.py", "sim/__main__.py"))
    prefix_predictor: PrefixPredictorConfig = section(PrefixPredictorConfig)
    history_predictor: HistoryPredictorConfig = section(HistoryPredictorConfig)
    fptas: FPTASConfig = section(FPTASConfig)
    sla: SLAConfig = section(SLAConfig)
    memory: MemoryConfig = section(MemoryConfig)

    def __post_init__(self) -> None:
        super().__post_init__()  # registry names only: the plug-ins are imported when the engine builds them
        if self.max_active_sequences is None and SAMPLING_MODES.get_or_raise(self.sampling_mode).uses_slots:
            raise ValueError("`max_active_sequences` must be a positive integer for "
                             f"sampling_mode={self.sampling_mode!r}.")
        if isinstance(self.length_predictor, str) or not callable(self.length_predictor):
            choice("length_predictor", self.length_predictor, PREDICTORS)
        if self.batch_policy == "sla":
            if self.sla.decode_ms is None:
                raise ValueError("`batch_policy='sla'` needs `sla_decode_ms` (target decode step latency in ms).")
            if self.sla.min_batch > self.max_batch:
                raise ValueError(f"`sla_min_batch` must be <= the largest batch bound {self.max_batch} "
                                 f"(`max_active_sequences`), got {self.sla.min_batch!r}.")

    @property
    def max_batch(self) -> int:
        """The largest batch bound of the SLA policy: `max_active_sequences`, `DEFAULT_MAX_BATCH` when None."""
        return self.max_active_sequences or DEFAULT_MAX_BATCH
