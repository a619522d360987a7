"""Build the scheduling plug-ins from names, the same way for the engine and the trace simulator."""

from __future__ import annotations

from ..history import PromptHistory
from .base import AdmissionPolicy, SchedulePolicy
from .predictors import LengthPredictor, make_predictor
from .registry import BATCH_POLICIES, SCHEDULERS


def build_predictor(
    length_predictor="prefix", prefix_k: int = 16, history: PromptHistory | None = None,
    history_fallback: str = "none",
) -> LengthPredictor:
    """One predictor per engine (or simulated run): it keeps learning across `generate` calls and reads the
    engine's per-prompt `history`."""
    return make_predictor(length_predictor, prefix_k, history, history_fallback)


def build_policies(
    scheduler: str,
    batch_policy: str,
    predictor: LengthPredictor | None = None,
    num_slots: int | None = None,
    fptas_epsilon: float = 0.1,
    sla_decode_ms: float | None = None,
    max_batch: int | None = None,
) -> tuple[SchedulePolicy, AdmissionPolicy]:
    """A fresh (ordering policy, admission policy) pair for one `generate` call."""
    policy_cls = SCHEDULERS.get_or_raise(scheduler)
    admission_cls = BATCH_POLICIES.get_or_raise(batch_policy)
    policy = policy_cls(predictor=predictor, num_slots=num_slots, fptas_epsilon=fptas_epsilon)
    admission = admission_cls(sla_decode_ms=sla_decode_ms, max_batch=max_batch)
    return policy, admission
