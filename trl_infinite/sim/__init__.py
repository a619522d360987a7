"""Trace simulator: replays per-sample length traces through the engine's own `Scheduler` and scheduling policies
(no model, no torch). See `python -m trl_infinite.sim --help`."""

from trl_infinite.sim.replay import SimConfig, SimResult, oracle_bound, simulate

__all__ = ["SimConfig", "SimResult", "oracle_bound", "simulate"]
