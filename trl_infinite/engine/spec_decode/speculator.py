"""`Speculator`: the engine-lifetime part of speculative decoding; builds each call's step (coupled `step.py` or
decoupled `decoupled.py`)."""

from __future__ import annotations

from collections import deque

import torch

from trl_infinite.engine.config.engine_config import EngineConfig, SamplingParams
from trl_infinite.engine.config.registry import DRAFTERS
from trl_infinite.engine.decode.step import StepContext
from trl_infinite.engine.model.guard import model_guard
from trl_infinite.engine.model.support import ModelSupport, check_support
from trl_infinite.engine.spec_decode.adaptive import AcceptanceTracker, CostModel, sample_acceptance
from trl_infinite.engine.spec_decode.decoupled import DecoupledStep
from trl_infinite.engine.spec_decode.draft_check import check_vocabulary, draft_block_bytes, own_configs
from trl_infinite.engine.spec_decode.drafter import DraftContext, Drafter
from trl_infinite.engine.spec_decode.plan import DraftTimes, StepTimes
from trl_infinite.engine.spec_decode.step import SpeculativeStep


class Speculator:
    """Engine-lifetime state: the drafter's name and options (`config.speculative`), the draft model (loaded once),
    the engine's history, the cost models of verification and drafting (profiled once per model) and the mean
    acceptance (the decoupled plan's `p`, which changes little between calls)."""

    def __init__(self, config: EngineConfig, device: torch.device, history=None, target: torch.nn.Module | None = None,
                 target_support: ModelSupport | None = None):
        """`target` (the engine's model, with its `target_support`): the draft model is checked against it once
        (`_check_draft`), its `draft_support` kept for every call's drafter and the engine's KV budget."""
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
        self.draft_support: ModelSupport | None = None
        if self.config.draft_model is not None:
            from trl_infinite.engine.spec_decode.draft_model import load_draft_model

            self.draft_model = load_draft_model(self.config.draft_model, device)
            if target is not None:
                self.draft_support = self._check_draft(target, target_support)

    def _check_draft(self, target: torch.nn.Module, target_support: ModelSupport | None) -> ModelSupport:
        """The draft model checked like the target (`draft_check.py`); its support contract."""
        draft, decode = self.draft_model, self.engine_config.decode
        own_configs(draft, target)
        check_vocabulary(draft, target)
        if draft is target and target_support is not None:
            return target_support
        with model_guard(draft, "RolloutEngine(model) (checking `speculative_draft_model`)"):
            try:
                return check_support(draft, decode.attention_backend, decode.cpu_decode_kernel)
            except ValueError as e:
                raise ValueError(f"`speculative_draft_model`: {e}") from e

    def draft_block_bytes(self, block_size: int) -> int:
        """Bytes of one block of the draft model's pool (0 without a checked draft model): each block of the
        engine's byte budget pays for the target's and the draft's (`kv_pool.KVCachePool`)."""
        return 0 if self.draft_support is None else draft_block_bytes(self.draft_support, block_size)

    @property
    def max_tokens(self) -> int:
        return self.config.num_tokens

    def build_drafter(self, sampling: SamplingParams, pool_blocks: int | None = None) -> Drafter:
        """A fresh drafter for one `generate` call, the one `speculative_method` names (`DraftContext`)."""
        context = DraftContext(self.device, sampling, self.engine_config, self.history, self.draft_model,
                               self.draft_support, pool_blocks)
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
        drafter = self.build_drafter(sampling, ctx.runner.pool.num_blocks)
        if not self.config.decoupled:
            return SpeculativeStep(ctx, self, drafter, sampling)
        if not drafter.supports_ahead:
            raise ValueError(f"`speculative_decoupled=True` needs a drafter that drafts ahead (`propose_ahead`); "
                             f"{self.config.method!r} does not.")
        if self.draft_model is not None and self.draft_model is ctx.runner.model:
            raise ValueError("`speculative_decoupled=True` drafts while the target verifies: "
                             "`speculative_draft_model` must be another module than the model itself.")
        return DecoupledStep(ctx, self, drafter, sampling, self.config.draft_window, self.config.reconfigure_every)
