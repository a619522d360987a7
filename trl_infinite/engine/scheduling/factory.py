"""Build the scheduling plug-ins from names, the same way for the engine and the trace simulator."""

from __future__ import annotations

from ..config import EngineConfig
from ..history import PromptHistory
from ..registry import BATCH_POLICIES, SCHEDULERS
from .base import AdmissionPolicy, PolicyOptions, SchedulePolicy
from .predictors import LengthPredictor, PredictorOptions, make_predictor


def build_predictor(
    length_predictor="prefix", prefix_k: int = 16, history: PromptHistory | None = None,
    history_fallback: str = "none",
) -> LengthPredictor:
    """One predictor per engine (or simulated run): it keeps learning across `generate` calls and reads the
    engine's per-prompt `history`."""
    return make_predictor(length_predictor, PredictorOptions(prefix_k, history, history_fallback))


def predictor_from_config(config: EngineConfig, history: PromptHistory | None = None) -> LengthPredictor:
    """The length predictor `config` names, with its options from `config` (`prefix_predictor_*`, `history_*`)."""
    options = PredictorOptions(
        prefix_k=config.prefix_predictor_k, history=history, history_fallback=config.history_fallback,
        prefix_min_train=config.prefix_predictor_min_train, prefix_l2=config.prefix_predictor_l2,
        history_window=config.history_mean_window,
    )
    return make_predictor(config.length_predictor, options)


def policy_options(config: EngineConfig, predictor: LengthPredictor | None = None) -> PolicyOptions:
    """`PolicyOptions` from the `EngineConfig` fields of the same names (the SLA bound's maximum is the slot
    count `max_active_sequences`)."""
    names = [f for f in PolicyOptions.__dataclass_fields__ if f not in ("predictor", "num_slots", "sla_max_batch")]
    return PolicyOptions(predictor=predictor, num_slots=config.slot_limit, sla_max_batch=config.max_active_sequences,
                         **{name: getattr(config, name) for name in names})


def build_policies(
    scheduler: str, batch_policy: str, predictor: LengthPredictor | None = None, **options
) -> tuple[SchedulePolicy, AdmissionPolicy]:
    """A fresh (ordering policy, admission policy) pair for one `generate` call; `options`: `PolicyOptions` fields."""
    return policies_from_options(scheduler, batch_policy, PolicyOptions(predictor=predictor, **options))


def policies_from_options(
    scheduler: str, batch_policy: str, options: PolicyOptions
) -> tuple[SchedulePolicy, AdmissionPolicy]:
    policy = SCHEDULERS.get_or_raise(scheduler).from_options(options)
    admission = BATCH_POLICIES.get_or_raise(batch_policy).from_options(options)
    return policy, admission


def policies_from_config(
    config: EngineConfig, predictor: LengthPredictor | None = None
) -> tuple[SchedulePolicy, AdmissionPolicy]:
    """The (ordering, admission) pair `config` names, with every option from `config`."""
    return policies_from_options(config.scheduler, config.batch_policy, policy_options(config, predictor))
