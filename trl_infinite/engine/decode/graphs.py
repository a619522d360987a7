"""The decode step's CUDA graphs: one per step key (batch bucket, table widths, group slots), captured on first use.

Rules (each one exercised in CI through `cpu_graphs`):
- the warm-up before a capture runs the step for real without side effects: on copies of what the step advances
  (input tokens and positions, seen marks) and with the KV pool slots it writes saved and restored, so the replay
  after the capture is the rows' real next step;
- a graph replays on the buffers it was captured with: each replay checks that the step's arguments still have the
  addresses of the capture, and recaptures otherwise (`recaptures`); the KV pool keeps its addresses across calls
  (`KVCachePool(stable=True)`), so graphs outlive the pool's release between rollouts; `captures` counts every
  capture (`RolloutStats.graph_captures` per call);
- every graph's memory comes from the runtime's one private pool; `pool_memory` is read from the pool itself;
- a step the runtime cannot capture (a host sync or a data-dependent shape inside the model: MoE layers in fp32
  read their expert offsets on the host) turns graphs off for the engine with a warning naming the reason; the
  steps then run uncaptured (eager or compiled), with the same results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from trl_infinite.engine.attention import decode_metadata
from trl_infinite.engine.decode.cuda_graphs import GraphRuntime, PoolMemory, capture_lock, is_capture_error
from trl_infinite.engine.runner.kv_pool import KVCachePool

if TYPE_CHECKING:
    from trl_infinite.engine.decode.static import StepInputs as Args

logger = logging.getLogger(__name__)


class _Captured:
    """One graph, its static outputs and the addresses of the arguments it was captured with."""

    def __init__(self, graph, outputs, args: Args):
        self.graph, self.outputs = graph, outputs
        self.addresses = _addresses(args)


def _addresses(args: Args) -> tuple:
    return tuple((a.data_ptr(), a.stride()) if isinstance(a, torch.Tensor) else None for a in args)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with the same sizes and strides (a compiled step sees the same layout)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class StepGraphs:
    """The graphs of one decoder (see the module docstring). `max_rows`: the largest bucket captured; larger
    batches run uncaptured (as vLLM's and SGLang's largest capture size)."""

    def __init__(self, runtime: GraphRuntime, pool: KVCachePool, block_size: int, max_rows: int):
        self.runtime: GraphRuntime | None = runtime
        self.pool = pool
        self.block_size = block_size
        self.max_rows = max_rows
        self.graphs: dict[tuple, _Captured] = {}
        self.recaptures = 0
        self.captures = 0  # graphs captured over the decoder's life
        self.failure: str | None = None  # why graphs were turned off
        self._memory = PoolMemory()

    @property
    def enabled(self) -> bool:
        return self.runtime is not None

    def covers(self, rows: int) -> bool:
        """Whether a step padded to `rows` rows runs as a graph."""
        return self.runtime is not None and rows <= self.max_rows

    def clear(self) -> None:
        self.graphs.clear()

    def pool_memory(self) -> PoolMemory:
        return self._memory

    def replay(self, key: tuple, args: Args, run: Callable[[Args], Any], record: Callable[[Args], Any]) -> Any:
        """Replay the graph of `key` (capturing it first: `run(args)` is the step for the warm-up, `record(args)`
        what is captured). Returns the graph's outputs, or None once graphs are off (run the step uncaptured)."""
        captured = self.graphs.get(key)
        if captured is not None and captured.addresses != _addresses(args):  # the rows or tables moved
            captured = None
            self.recaptures += 1
        if captured is None:
            try:
                captured = self.graphs[key] = self._capture(args, run, record)
            except Exception as err:
                if not is_capture_error(err):
                    raise
                self.give_up(err)
                return None
        captured.graph.replay()
        return captured.outputs

    def give_up(self, err: BaseException) -> None:
        """Turn graphs off for good, with a warning (the runtime's pool memory stays with the graphs kept so far:
        none)."""
        self.failure = f"{type(err).__name__}: {str(err)[:300]}"
        logger.warning("CUDA graphs are off for this engine: its decode step cannot be captured (%s). Decode "
                       "steps run uncaptured instead (same results, more kernel-launch overhead).", self.failure)
        self.runtime = None
        self.graphs.clear()

    def _capture(self, args: Args, run: Callable[[Args], Any], record: Callable[[Args], Any]) -> _Captured:
        with capture_lock:  # no drafter-thread forward meanwhile (`cuda_graphs.capture_lock`)
            self._warm_up(args, run)
            graph, outputs = self.runtime.capture(partial(record, args))
        self.captures += 1
        self._memory = self.runtime.pool_memory()
        return _Captured(graph, outputs, args)

    def _warm_up(self, args: Args, run: Callable[[Args], Any]) -> None:
        """Run the step twice for real (Triton JIT and autotuning, cuBLAS workspaces, compilation) free of side
        effects (module docstring): each run on its own copies, same strides."""
        slots = decode_metadata(args.inputs[1], args.prompt_len, args.prefix_table, args.suffix_table, args.group,
                                self.block_size).slot_mapping  # [N]
        pool = self.pool
        saved = [(k[slots], v[slots]) for k, v in zip(pool.k_caches, pool.v_caches)]
        try:
            for _ in range(2):
                warm = args._replace(inputs=_copy(args.inputs), seen=None if args.seen is None else _copy(args.seen))
                self.runtime.warmup(partial(run, warm))
        finally:
            for (k, v), (sk, sv) in zip(zip(pool.k_caches, pool.v_caches), saved):
                k.index_copy_(0, slots, sk)
                v.index_copy_(0, slots, sv)
