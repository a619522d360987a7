"""The static decode step: one token per running sample through fixed-shape device state, sampled in the same region.

`DecodeRows` holds the batch on the device; a step pads it to a bucket of rows (`bucket_sizes`; on CPU multiples of
`ModelRunner.row_multiple`, so that a row's logits do not depend on the batch size: `runner/row_plan.py`) and runs
`StaticDecoder._step` over fixed shapes: metadata from the persistent tables, the model forward, the logits
processors and the inverse-CDF draw. Nothing in `_step` reads device data on the host, so it runs
- eagerly (the default off CUDA),
- compiled with `torch.compile(fullgraph=True)` (`EngineConfig.compile`, on any device), and/or
- captured in one CUDA graph per bucket and replayed (`EngineConfig.cuda_graphs`, on CUDA; `graphs.py`), up to
  `EngineConfig.cuda_graph_max_batch` rows.
The step's inputs are named (`StepInputs`), and so is its compile key. The host's work per step is
`DecodeRows.update` (incremental, non-blocking uploads) and one copy of the sampled tokens and log-probabilities
back (`step.pack`, `step.ReadBack`: into pinned memory, without blocking the host).
"""

from __future__ import annotations

import time
from functools import partial
from typing import NamedTuple

import torch

from trl_infinite.engine.attention import decode_metadata
from trl_infinite.engine.attention import triton_tiles as tiles
from trl_infinite.engine.config.inputs import text_config
from trl_infinite.engine.config.sampling_params import SamplingParams
from trl_infinite.engine.decode.compiled import CompiledStep
from trl_infinite.engine.decode.cuda_graphs import PoolMemory, graph_runtime
from trl_infinite.engine.decode.graphs import StepGraphs
from trl_infinite.engine.decode.output_capture import install_capturing_hooks
from trl_infinite.engine.decode.rows import DecodeRows
from trl_infinite.engine.decode.step import DecodeStep, Pending, ReadBack, StepContext, one_token, pack
from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.runner.model_runner import ModelRunner, padded_count
from trl_infinite.engine.runner.sampler import Sampler, row_keys, seed_base
from trl_infinite.engine.runner.weight_state import weights_fingerprint
from trl_infinite.engine.sched.batch import ScheduledBatch


def bucket_sizes(capacity: int, multiple: int = 1) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 8 up to 64, of 16 up to 256, of 32 beyond; `capacity` last.
    With `multiple` (a power of two; `ModelRunner.row_multiple`, derived on CPU) only multiples of it: the sizes
    below `multiple` are dropped, the steps are at least `multiple`, and `capacity` is rounded up to one."""
    capacity = padded_count(capacity, multiple)
    sizes, n = [], multiple
    while n < capacity:
        sizes.append(n)
        n = n * 2 if n < 8 else n + max(multiple, 8 if n < 64 else 16 if n < 256 else 32)
    return sizes + [capacity]


def static_step_bytes(model_config, rows: int) -> int:
    """Upper estimate of what one static decode step at `rows` rows allocates: the logits and the sampler's copies
    of them ([rows, V] in float32 / float64, about six), the per-layer temporaries, and the split partial outputs of
    the Triton attention kernels (fp32, `triton_tiles`: the prompt's capped, the own tokens' at most 16 splits).
    CUDA graphs share one private memory pool, so this is the graphs' memory (reserved from a `kv_cache_fraction`
    budget; the measured figure is `RolloutStats.extra["cuda_graph_bytes"]`)."""
    cfg = text_config(model_config)
    width = cfg.hidden_size * 8 + getattr(cfg, "intermediate_size", 4 * cfg.hidden_size) * 3
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_split = rows * heads * head_dim * 4
    partials = min(tiles.MAX_PARTIAL_BYTES, per_split * tiles.MAX_PREFIX_SPLITS) + per_split * tiles.MAX_SUFFIX_SPLITS
    return rows * (cfg.vocab_size * 4 * 6 + width * 4 * 2) + partials


def _pow2_at_least(n: int, cap: int) -> int:
    return min(cap, 1 << max(n - 1, 1).bit_length())


class StepInputs(NamedTuple):
    """The static step's inputs over rows `0 .. padded-1` (views of `DecodeRows`, or contiguous copies of the
    tables' columns in use). The step advances `inputs` and `seen` in place."""

    inputs: torch.Tensor  # [2, N] token; position
    prompt_len: torch.Tensor  # [N]
    group: torch.Tensor  # [N] (-1: padding row)
    sample: torch.Tensor  # [N]
    prefix_table: torch.Tensor  # [N, prompt columns]
    suffix_table: torch.Tensor  # [N, own columns]
    seen: torch.Tensor | None  # [N, V] ids in each row's context (repetition penalty)
    seed: torch.Tensor  # 0-dim
    group_slot: torch.Tensor | None  # [N] (cascade decode only)
    group_prefix: torch.Tensor | None  # [group slots, prompt columns] (cascade decode only)
    groups: int  # bucket of the batch's group count (kernels that read whole tables), else 0


class StaticDecoder(DecodeStep):
    """Runs decode steps on the static path for one engine (its model, pool and backend)."""

    def __init__(self, runner: ModelRunner, compile: bool, cuda_graphs: bool, compile_backend: str,
                 max_graph_rows: int):
        self.runner = runner
        self.device = runner.device
        self.block_size = runner.pool.block_size
        # CUDA graphs on CUDA; off CUDA, the CPU stand-in while `cpu_graphs.emulate_cuda_graphs` is active
        runtime = graph_runtime(self.device) if cuda_graphs else None
        self.graphs = None if runtime is None else StepGraphs(runtime, runner.pool, self.block_size,
                                                                       padded_count(max_graph_rows, runner.row_multiple))
        # kernels whose work follows each row's length read whole tables; a gathering backend only the columns used
        self.full_tables = not runner.backend.gathers_columns
        # only the torch backend's cascade decode on CPU reads the group slots (see `metadata.with_context`), and not
        # where the C++ kernel serves every layer (`attention/cpu_decode.py`; `ModelRunner.cascade_decode`);
        # elsewhere the step passes no group tables, so no slot bucket multiplies the compiled graphs
        self.cascade_slots = runner.cascade_decode
        self.rows: DecodeRows | None = None
        self.sampler: Sampler | None = None
        self.want_hidden = False
        self.seed = torch.zeros((), dtype=torch.long, device=self.device)
        self.stats = RolloutStats()  # the call's (`begin`)
        self._fingerprint: tuple = ()
        self._compiled: CompiledStep | None = None
        if compile:
            # on CPU, inductor's C++ wrapper calls the kernels without a Python frame per kernel (about a fifth of a
            # small model's compiled step); on CUDA the graphs replay without any wrapper anyway. Without size
            # asserts: the wrapper would re-check every input's sizes and strides (each parameter's) on every step,
            # which the dispatch already rules out (shapes are in its key, tables are contiguous copies, the rows
            # persistent, and moved parameters re-arm Dynamo's full guards, `CompiledStep.reset`)
            options = ({"cpp_wrapper": True, "size_asserts": False}
                       if compile_backend == "inductor" and self.device.type == "cpu" else None)
            self._compiled = CompiledStep(self._step, compile_backend, options)

    def begin(self, ctx: StepContext, capacity: int, prompt_blocks: int, own_blocks: int) -> None:
        """Prepare for one `generate` call: the rows' capacity and table widths, and from `ctx` the sampler, the seed,
        the stats and whether hidden states are wanted (`ctx.predictor`)."""
        sampler, seed, want_hidden, self.stats = ctx.sampler, ctx.seed, ctx.predictor is not None, ctx.stats
        vocab = text_config(self.runner.model).vocab_size if sampler.uses_context else None
        cap = bucket_sizes(capacity, self.runner.row_multiple)[-1]
        pcols, ocols = _pow2_at_least(prompt_blocks, 1 << 30), _pow2_at_least(own_blocks, 1 << 30)
        pool = self.runner.pool
        if self.rows is None or not self.rows.fits(cap, pcols, ocols, vocab) or self.rows.null_block != pool.null_block:
            self.rows = DecodeRows(cap, pcols, ocols, self.block_size, pool.null_block, self.device, vocab)
            self._clear_graphs()
        if want_hidden:  # before the first step asking for them, which may be compiled (`output_capture.py`)
            install_capturing_hooks(self.runner.capture_models)
        if self.sampler is None or self.sampler.params_key != sampler.params_key or want_hidden != self.want_hidden:
            self.sampler, self.want_hidden = sampler, want_hidden
            self._clear_graphs()
        self.seed.fill_(seed_base(seed))
        fingerprint = weights_fingerprint(self.runner.model, *pool.k_caches, *pool.v_caches, versions=False)
        # parameters gathered into new storage (ZeRO-3, FSDP), a new KV pool (sized per call), or a PEFT adapter
        # disabled / switched / merged (the captured step would run the old adapter's code path): recapture
        if fingerprint != self._fingerprint:
            self._fingerprint = fingerprint
            self._clear_graphs()
            if self._compiled is not None:
                self._compiled.reset()

    @property
    def use_graphs(self) -> bool:
        return self.graphs is not None and self.graphs.enabled

    def graph_memory(self) -> PoolMemory:
        """Memory of the graphs' pool (zero without graphs)."""
        return self.graphs.pool_memory() if self.graphs is not None else PoolMemory()

    def _clear_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()

    def check_capture(self) -> None:
        """Part of the support check where graphs are on: warm up and capture one step of a single padding row
        (it writes only the pool's null block), uncompiled. A model whose step cannot be captured turns graphs off
        here, with a warning, before any rollout (`StepGraphs.give_up`)."""
        if not self.use_graphs:
            return
        self.begin(StepContext(self.runner, Sampler(SamplingParams(temperature=0.0)), 0, RolloutStats(), 0, self),
                   capacity=1, prompt_blocks=1, own_blocks=1)
        try:
            uncompiled = partial(self._run, compiled=False)
            self.graphs.replay(("check",), self._inputs(1, captured=True)[0], uncompiled, uncompiled)
        finally:
            self._clear_graphs()
            self.rows = self.sampler = None

    def end(self) -> None:
        """Release the rows of the finished call (their samples are done)."""
        self.invalidate()

    def invalidate(self) -> None:
        """Tokens were appended by another path (a verification forward): rebuild every row at the next step."""
        if self.rows is not None:
            self.rows.clear()

    def launch(self, batch: ScheduledBatch) -> Pending:
        """Start one decode step over `batch.decode` (one token per sample); returns the function that waits for it.
        On CUDA the step runs asynchronously between the two calls (the host is free, e.g. to score rewards), and
        the tokens come back through one non-blocking copy into pinned memory. Adds the host time of the upload and
        the read-back to `stats.host_time_s`, the forward's (up to the read-back) to `stats.decode_forward_s`."""
        t0 = time.perf_counter()
        stats = self.stats
        row_of = self.rows.update(batch.decode, batch.grown, batch.readmitted)
        n = len(row_of)
        padded = next(b for b in bucket_sizes(self.rows.capacity, self.runner.row_multiple) if b >= n)
        captured = self.graphs is not None and self.graphs.covers(padded)
        x, key = self._inputs(padded, captured)
        t1 = time.perf_counter()
        out = None
        if captured:
            before = self.graphs.captures
            out = self.graphs.replay(key, x, self._run, partial(self._run, capture=True))
            stats.graph_captures += self.graphs.captures - before
        if out is None:  # inline rather than `self._run(x)`: one frame less on every step (benchmarks/decode_path.py)
            with self.runner.routed():
                out = self._step(x) if self._compiled is None else self._compiled(self._compile_key(x), x)
        packed, hidden = out  # [padded, 2 or 3] float64
        read = ReadBack(packed, non_blocking=True)
        t2 = time.perf_counter()

        def finish():
            t3 = time.perf_counter()
            read.wait()
            t4 = time.perf_counter()
            decoded = one_token(read.rows(), row_of, hidden)
            stats.host_time_s += (t1 - t0) + (time.perf_counter() - t4)
            stats.decode_forward_s += (t2 - t1) + (t4 - t3)
            return decoded

        return finish

    def _inputs(self, padded: int, captured: bool) -> tuple[StepInputs, tuple]:
        """The step's inputs over rows `0 .. padded-1`, and its graph key. A graph keeps the views' addresses;
        otherwise the tables are contiguous copies of the columns in use (one memory layout whatever the widths)."""
        rows = self.rows
        pcols, ocols = rows.prefix_cols, rows.own_cols
        if not self.full_tables:  # a gathering backend reads every column: only the used ones (a graph: bucketed)
            if captured:
                pcols, ocols = _pow2_at_least(rows.max_prompt_blocks, pcols), _pow2_at_least(rows.max_own_blocks, ocols)
            else:  # at least 2: a width of 1 would be specialised by the compiler (tables have >= 2 columns)
                pcols, ocols = max(2, rows.max_prompt_blocks), max(2, rows.max_own_blocks)
        tables = [rows.prefix_table[:padded, :pcols], rows.suffix_table[:padded, :ocols]]
        # the group slots in use, bucketed to powers of two (a static size: one compiled graph per bucket), only where
        # they are read (`cascade_slots`); elsewhere none are passed (a layer that still falls back to the torch path
        # takes its whole-context attention)
        group_slot, slots = None, 0
        if self.cascade_slots:
            used = rows.group_slots_used
            slots = 1 if used <= 1 else min(rows.group_prefix.shape[0], _pow2_at_least(used, 1 << 30))
            group_slot = rows.group_slot[:padded]
            tables.append(rows.group_prefix[:slots, :pcols])
        if not captured:
            tables = [t.clone(memory_format=torch.contiguous_format) for t in tables]
        # kernels that read whole tables (Triton's) size their prompt splits by the batch's group count: a bucket
        # (host int) in the key, so a graph replays the splits it captured; 0 (unused) elsewhere
        groups = tiles.group_bucket(rows.num_groups) if self.full_tables else 0
        x = StepInputs(rows.inputs[:, :padded], rows.prompt_len[:padded], rows.group[:padded], rows.sample[:padded],
                       tables[0], tables[1], None if rows.seen is None else rows.seen[:padded], self.seed, group_slot,
                       tables[2] if self.cascade_slots else None, groups)
        return x, (padded, pcols, ocols, slots, groups)

    def _run(self, x: StepInputs, compiled: bool = True, capture: bool = False):
        """The step, eager or compiled (a graph's warm-up); `capture`: what a graph records (the compiled graph the
        warm-up ran, called without entering Dynamo: nothing is traced or guarded inside a capture)."""
        with self.runner.routed():
            if self._compiled is None or not compiled:
                return self._step(x)
            if not capture:
                return self._compiled(self._compile_key(x), x)
            entry = self._compiled.entry(self._compile_key(x))
            return entry(x) if entry is not None else self._compiled.guarded(x)

    def _compile_key(self, x: StepInputs) -> tuple:
        """One compiled entry per (bucket, group slots, group count bucket, sampling settings, hidden states wanted,
        seen tokens kept), dispatched without Dynamo's guards after its first call (`CompiledStep`)."""
        if not self.full_tables:  # context widths grow with the samples: one compiled graph for all widths
            for table in (x.prefix_table, x.suffix_table, x.group_prefix):
                if table is not None:
                    torch._dynamo.maybe_mark_dynamic(table, 1)
        slots = 0 if x.group_prefix is None else x.group_prefix.shape[0]
        return (x.inputs.shape[1], slots, x.groups, self.sampler.params_key, self.want_hidden, x.seen is None)

    def _step(self, x: StepInputs):
        """The static region: the rows' state in; the sampled tokens and their log-probs packed into one [N, 2]
        float64 tensor ([N, 3] with raw log-probs; ids are exact in float64: `step.pack`) and the hidden states (or
        None) out. Advances the rows for the next step on the device: input token := the sampled token, position +
        1, the token marked seen (padding rows, group -1, keep position 0)."""
        ids, pos = x.inputs[0], x.inputs[1]
        meta = decode_metadata(pos, x.prompt_len, x.prefix_table, x.suffix_table, x.group, self.block_size,
                               x.group_slot, x.group_prefix, x.groups or None)
        logits, hidden = self.runner.run(ids[None], pos[None], meta, 0, self.want_hidden)
        logprobs = self.sampler.process(logits, x.seen)
        keys = row_keys(x.seed, x.group, x.sample, pos + 1)
        tokens, token_logprobs = self.sampler.sample(logprobs, keys, logits)
        x.inputs[0].copy_(tokens)
        x.inputs[1].add_((x.group >= 0).long())
        if x.seen is not None:
            x.seen.scatter_(1, tokens[:, None], True)  # (`seen[rows, tokens] = True` uploads a host scalar)
        return pack(tokens, token_logprobs), hidden
