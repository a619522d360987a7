"""Speculative rollout backend: drafters (registry `engine.registry.DRAFTERS`, built-ins loaded when first built),
lossless verification, adaptive draft lengths."""

from trl_infinite.engine.spec_decode.adaptive import AcceptanceTracker, CostModel, best_length, plan_lengths
from trl_infinite.engine.spec_decode.drafter import DRAFTERS, DraftContext, Drafter, Proposal, register_drafter
from trl_infinite.engine.spec_decode.speculator import Speculator
from trl_infinite.engine.spec_decode.step import SpeculativeStep
from trl_infinite.engine.spec_decode.verify import Verified, verify_greedy, verify_sampling

__all__ = [
    "DRAFTERS", "AcceptanceTracker", "CostModel", "DraftContext", "Drafter", "Proposal", "SpeculativeStep",
    "Speculator", "Verified", "best_length", "plan_lengths", "register_drafter", "verify_greedy", "verify_sampling",
]
