"""Speculative rollout backend: drafters (registry `engine.registry.DRAFTERS`, built-ins loaded when first built),
lossless verification, adaptive draft lengths."""

from .adaptive import AcceptanceTracker, CostModel, best_length, plan_lengths
from .drafter import DRAFTERS, DraftContext, Drafter, Proposal, register_drafter
from .speculator import Speculator
from .step import SpeculativeStep
from .verify import Verified, verify_greedy, verify_sampling

__all__ = [
    "DRAFTERS", "AcceptanceTracker", "CostModel", "DraftContext", "Drafter", "Proposal", "SpeculativeStep",
    "Speculator", "Verified", "best_length", "plan_lengths", "register_drafter", "verify_greedy", "verify_sampling",
]
