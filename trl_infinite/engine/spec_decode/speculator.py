"""`Speculator`: the engine-lifetime part of speculative decoding; builds each call's step (coupled `step.py` or
decoupled `decoupled.py`)."""

from __future__ import annotations

from collections import deque

import torch

from ..config import EngineConfig, SamplingParams
from ..executor import StepContext
from ..registry import DRAFTERS
from .adaptive import AcceptanceTracker, CostModel, sample_acceptance
from .decoupled import DecoupledStep
from .drafter import DraftContext, Drafter
from .plan import DraftTimes, StepTimes
from .step import SpeculativeStep


class Speculator:
    """Engine-lifetime state: the drafter's name and options (`config.speculative`), the draft model (loaded once),
    the engine's history, the cost models of verification and drafting (profiled once per model) and the mean
    acceptance (the decoupled plan's `p`, which changes little between calls)."""

    def __init__(self, config: EngineConfig, device: torch.device, history=None):
        self.engine_config = config
        self.config = config.speculative
        self.adaptive = self.config.adaptive
        self.device = device
        self.cost = CostModel()
        self.draft_times = DraftTimes()
        self.acceptance = AcceptanceTracker(decay=0.995)  # key None: every verified draft of every call
        self.sample_acceptance: deque[float] = deque(maxlen=1024)  # per finished sample, the latest calls'
        self.history = history  # the engine's `PromptHistory` (drafts from earlier visits)
        self.draft_model = None
        if self.config.draft_model is not None:
            from .draft_model import load_draft_model

            self.draft_model = load_draft_model(self.config.draft_model, device)

    @property
    def max_tokens(self) -> int:
        return self.config.num_tokens

    def build_drafter(self, sampling: SamplingParams) -> Drafter:
        """A fresh drafter for one `generate` call, the one `speculative_method` names."""
        context = DraftContext(self.device, sampling, self.engine_config, self.history, self.draft_model)
        return DRAFTERS.build(self.config.method, self.config, context)

    def step_times(self) -> StepTimes | None:
        """The fitted verification and drafting step times, None until both models have data."""
        if not (self.cost.ready and self.draft_times.ready):
            return None
        return StepTimes(self.cost.coef, self.draft_times.fit.coef)

    def record_samples(self, counts) -> None:
        """The per-sample acceptance of a finished call, `counts` = (accepted drafts, drafts verified, verifications
        that rejected one) per sample: `adaptive.sample_acceptance` of each sample that verified drafts."""
        self.sample_acceptance.extend(sample_acceptance(a, r) for a, n, r in counts if n > 0)

    def slowest_acceptance(self, rows: int) -> float | None:
        """The expected acceptance of the slowest of `rows` samples without data of their own: the 1 / (rows + 1)
        quantile of the recorded per-sample acceptance (None with fewer than 8 samples recorded). The drain plan
        gives it to such rows, since the call waits for the slowest of them."""
        if len(self.sample_acceptance) < 8 or rows <= 0:
            return None
        return float(torch.tensor(list(self.sample_acceptance), dtype=torch.float64).quantile(1.0 / (rows + 1)))

    def begin(self, ctx: StepContext, sampling: SamplingParams) -> SpeculativeStep:
        drafter = self.build_drafter(sampling)
        if not self.config.decoupled:
            return SpeculativeStep(ctx, self, drafter, sampling)
        if not drafter.supports_ahead:
            raise ValueError(f"`speculative_decoupled=True` needs a drafter that drafts ahead (`propose_ahead`); "
                             f"{self.config.method!r} does not.")
        if self.draft_model is not None and self.draft_model is ctx.runner.model:
            raise ValueError("`speculative_decoupled=True` drafts while the target verifies: "
                             "`speculative_draft_model` must be another module than the model itself.")
        return DecoupledStep(ctx, self, drafter, sampling, self.config.draft_window, self.config.reconfigure_every)
