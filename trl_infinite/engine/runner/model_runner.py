"""Runs a Hugging Face causal LM over the paged KV pool: packed host-built segments, or a static decode batch.

Row-count invariance on CPU (`row_plan.RowPlan`): a row's logits must not depend on how many rows share its
forward, or a seed's samples would change with the schedule (a tail batch of 1-3 rows) and with speculation (a
verification forward of another row count than the plain step), since at temperature 1 a near-tie of the inverse CDF
flips on the last bit. CPU BLAS (MKL) multiplies a matrix of few rows by other kernels than a matrix of many, and with
several threads may split a product differently at some row counts; which counts agree depends on the machine, the
shape and the thread count. So each runner derives its plan on the machine at the current thread count
(`row_plan.derive_plan`, refreshed per call by `refresh_rows`): every forward runs a multiple of `plan.multiple`
rows (`forward` adds one-token padding segments that write the pool's null block, the logits kept
(`logits_to_keep`) are padded the same way, the static decode step pads its rows to buckets of multiples of it,
`decode.static.bucket_sizes`), and a forward of more rows than a product was verified at runs that product on chunks
(`RowPlan.split`). `tests/engine/decode/test_row_invariance.py` pins it. Attention is row-invariant by construction
where the C++ decode kernel serves (one (row, head) per work item); the verification forward runs its query tokens as
decode rows of their own (`spec_decode/step.py`), so it goes through the same kernel as the plain step.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

import trl_infinite.engine.attention as attention
from trl_infinite.engine.attention import LayerSpec, Segment, cpu_decode
from trl_infinite.engine.runner.kv_layout import KVLayout
from trl_infinite.engine.runner.kv_pool import KVCachePool
from trl_infinite.engine.runner.row_plan import RowPlan, derive_plan
from trl_infinite.engine.sched.sequence import Sequence


def padded_count(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def decode_kernel_serves(device: torch.device, attention_backend: str, layers: dict[int, LayerSpec], kv: KVLayout,
                         dtype: torch.dtype) -> bool:
    """Whether the C++ CPU decode kernel would serve at least one layer of a model: CPU, the torch backend, and a
    layer `cpu_decode.serves` (float32 pool, plain softmax, head dims of the vector width). Builds nothing."""
    return (device.type == "cpu"
            and attention.resolve_backend(attention_backend, device).attend is attention.torch_paged_attention
            and any(cpu_decode.serves(spec, kv.k_dims[spec.pool_index], kv.v_dims[spec.pool_index], dtype)
                    for spec in layers.values()))


class ModelRunner:
    """One forward = one packed batch; returns the logits of the requested query tokens only."""

    def __init__(self, model: torch.nn.Module, pool: KVCachePool, attention_backend: str, layers: dict[int, LayerSpec],
                 cpu_decode_kernel: bool = False, capture_models: tuple[torch.nn.Module, ...] = (),
                 autocast: torch.dtype | None = None):
        """`layers`: one `LayerSpec` per attention `layer_idx` (from `support.check_support`); `capture_models`: the
        models transformers installs its hidden-state hooks from (`ModelSupport.capture_models`). `cpu_decode_kernel`:
        decode forwards go through `attention/cpu_decode`'s C++ kernel where it serves the layer
        (`decode_kernel_serves`; built here if no engine built it before; if it cannot be built, the torch path).
        The engine passes `ModelSupport.decode_kernel`: True only once the kernel passed the exactness check.
        `autocast`: the autocast dtype the model's forward runs under (`ModelSupport.autocast`), for the row plan."""
        self.model = model
        self.capture_models = capture_models
        self.pool = pool
        self.device = pool.device
        self.backend = attention.resolve_backend(attention_backend, self.device)
        self.attend = self.backend.attend
        # every layer's decode attention is the kernel's (none falls back to the torch path)
        self.decode_kernel_everywhere = False
        if (cpu_decode_kernel and decode_kernel_serves(self.device, attention_backend, layers, pool.layout, pool.dtype)
                and cpu_decode.build()):
            self.attend = cpu_decode.with_kernel(self.backend.attend)
            self.decode_kernel_everywhere = cpu_decode.covers(list(layers.values()), pool.layout.k_dims,
                                                              pool.layout.v_dims, pool.dtype)
        # decode steps split each row's context at the prompt: the torch backend's cascade on CPU, fed the group slots
        # by the static step, wherever a layer falls back to the torch path. (With a 16-bit pool its two flash calls
        # round their partial outputs to 16 bits before the merge, a rounding order the model's single attention
        # call does not have: within the 16-bit tolerance, and on the greedy benchmark of
        # `benchmarks/autocast_exactness.py` as close to `generate` as the whole-context path, at 0.54x to 0.6x the
        # decode step time on SmolLM2-135M's shape; see benchmarks/RESULTS.md.)
        self.cascade_decode = (self.device.type == "cpu" and self.backend.gathers_columns
                               and not self.decode_kernel_everywhere)
        self.layers = layers
        # the distinct mask patterns (sliding window, chunk) of the layers: their masks are built once per forward
        self.mask_keys = tuple(dict.fromkeys((s.sliding_window, s.chunk_size) for s in layers.values()))
        self.attn_configs = attention.attention_configs(model)
        self.temperature_tuned = attention.temperature_tuned(model)  # Llama 4's NoPE layers: scaled by position
        # CPU: every forward at a row count the machine's BLAS was verified at (module docstring); derived at the
        # first call (the weights must be whole then: under FSDP they are only inside the trainer's rollout)
        self.autocast = autocast
        self.plan: RowPlan | None = None if self.device.type == "cpu" else RowPlan(1, 0)

    @property
    def row_plan(self) -> RowPlan:
        """The plan of the current call (`refresh_rows`; derived here if no call refreshed it yet)."""
        return self.plan or self.refresh_rows()

    @property
    def row_multiple(self) -> int:
        """Every forward's rows are padded to a multiple of this (1 off CPU; `RowPlan.multiple`)."""
        return self.row_plan.multiple

    def refresh_rows(self) -> RowPlan:
        """The row plan of the model as it is now (an adapter added since, another thread count: the probes are
        cached per shape, so this walks the modules and looks their shapes up); off CPU, no padding or chunking."""
        if self.device.type == "cpu":
            self.plan = derive_plan(self.model, self.autocast)
        return self.plan

    def routed(self):
        """Context in which the model's attention runs over the pool (wrap every `run` call in it)."""
        return attention.paged_attention(self.model, self.attn_configs, self.temperature_tuned)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: attention.PagedAttentionMetadata,
            logits_to_keep: torch.Tensor | int, output_hidden: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`input_ids`, `positions`: [1, T]; `logits_to_keep`: [R] query indices whose logits are needed, or 0 for
        all. Logits [R, V] (and the last hidden states [R, hidden] when `output_hidden`). Call inside `routed()`.
        Device tensors in, device tensors out: nothing here syncs with the host, so it can be compiled/captured."""
        meta = self.backend.prepare(meta, self.mask_keys)
        ctx = attention.PagedContext(self.pool.k_caches, self.pool.v_caches, meta, self.attend, self.layers)
        keep = isinstance(logits_to_keep, torch.Tensor)
        num_keep = logits_to_keep.shape[0] if keep else 0
        if keep and num_keep % self.row_multiple:  # the LM head at a row-invariant count (module docstring)
            pad = padded_count(num_keep, self.row_multiple) - num_keep
            logits_to_keep = torch.cat([logits_to_keep, logits_to_keep[-1:].expand(pad)])
        split = (self.row_plan.split(input_ids.shape[1]) if self.device.type == "cpu"
                 and not torch.compiler.is_compiling() else nullcontext())  # compiled: inductor's own products
        with split:
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, paged_ctx=ctx,
                             logits_to_keep=logits_to_keep, output_hidden_states=output_hidden)
        logits = out.logits[0]
        if keep and logits.shape[0] != logits_to_keep.shape[0]:  # a model that ignores `logits_to_keep`
            logits = logits[logits_to_keep]
        hidden = None
        if output_hidden:
            last = out.hidden_states[-1][0]
            hidden = last[logits_to_keep[:num_keep]] if keep else last
        return (logits[:num_keep], hidden) if keep else (logits, hidden)

    def forward(self, segments: list[Segment], logit_rows: torch.Tensor, output_hidden: bool = False):
        """Eager forward of host-side segments; `logit_rows` [R] indexes the packed query tokens whose logits are
        needed. Returns (logits [R, V], hidden [R, hidden] or None). On CPU the packed tokens are padded to a
        multiple of `row_multiple` with one-token segments writing the pool's null block (module docstring)."""
        num_tokens = sum(len(s.tokens) for s in segments)
        if num_tokens % self.row_multiple:
            pad = Segment(0, [], [self.pool.null_block], 0, [0], -1)
            segments = segments + [pad] * (padded_count(num_tokens, self.row_multiple) - num_tokens)
        input_ids, positions, meta = attention.build_metadata(segments, self.pool.block_size, self.device)
        with self.routed():
            return self.run(input_ids, positions, meta, logit_rows.to(self.device), output_hidden)


def sample_segment(seq: Sequence, start_pos: int, tokens: list[int]) -> Segment:
    """The segment of `tokens` of sample `seq` from position `start_pos`: its prompt's blocks as the prefix, its own
    blocks as the suffix."""
    return Segment(seq.prompt_len, seq.group.prompt_blocks, seq.blocks, start_pos, tokens, seq.group_id)


def last_rows(segments: list[Segment]) -> torch.Tensor:
    """Index of each segment's last token in the packed batch ([S])."""
    ends = torch.cumsum(torch.tensor([len(s.tokens) for s in segments], dtype=torch.long), 0)
    return ends - 1


def chunk_segments(segments: list[Segment], max_tokens: int) -> list[list[Segment]]:
    """Split a list of segments into forwards of at most `max_tokens` tokens (a long segment is cut in pieces,
    each piece's context being everything before it)."""
    batches: list[list[Segment]] = [[]]
    used = 0
    for seg in segments:
        start = 0
        while start < len(seg.tokens):
            room = max_tokens - used
            if room == 0:
                batches.append([])
                used, room = 0, max_tokens
            piece = seg.tokens[start : start + room]
            batches[-1].append(  # the copies run with the first piece (they fill context before the segment)
                Segment(seg.prompt_len, seg.prefix_blocks, seg.suffix_blocks, seg.start_pos + start, piece,
                        seg.group_index, seg.copies if start == 0 else [])
            )
            used += len(piece)
            start += len(piece)
    return [b for b in batches if b]
