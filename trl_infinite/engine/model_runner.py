"""Runs a Hugging Face causal LM over the paged KV pool: packed host-built segments, or a static decode batch."""

from __future__ import annotations

import torch

from .attention import (
    LayerSpec,
    PagedAttentionMetadata,
    PagedContext,
    Segment,
    attention_configs,
    build_metadata,
    cpu_decode,
    paged_attention,
    resolve_backend,
    temperature_tuned,
    torch_paged_attention,
)
from .kv_pool import KVCachePool, KVLayout


def decode_kernel_serves(device: torch.device, attention_backend: str, layers: dict[int, LayerSpec], kv: KVLayout,
                         dtype: torch.dtype) -> bool:
    """Whether the C++ CPU decode kernel would serve at least one layer of a model: CPU, the torch backend, and a
    layer `cpu_decode.serves` (float32 pool, plain softmax, head dims of the vector width). Builds nothing."""
    return (device.type == "cpu" and resolve_backend(attention_backend, device).attend is torch_paged_attention
            and any(cpu_decode.serves(spec, kv.k_dims[spec.pool_index], kv.v_dims[spec.pool_index], dtype)
                    for spec in layers.values()))


class ModelRunner:
    """One forward = one packed batch; returns the logits of the requested query tokens only."""

    def __init__(self, model: torch.nn.Module, pool: KVCachePool, attention_backend: str, layers: dict[int, LayerSpec],
                 cpu_decode_kernel: bool = False, capture_models: tuple[torch.nn.Module, ...] = ()):
        """`layers`: one `LayerSpec` per attention `layer_idx` (from `support.check_support`); `capture_models`: the
        models transformers installs its hidden-state hooks from (`ModelSupport.capture_models`). `cpu_decode_kernel`:
        decode forwards go through `attention/cpu_decode`'s C++ kernel where it serves the layer
        (`decode_kernel_serves`; built here if no engine built it before; if it cannot be built, the torch path).
        The engine passes `ModelSupport.decode_kernel`: True only once the kernel passed the exactness check."""
        self.model = model
        self.capture_models = capture_models
        self.pool = pool
        self.device = pool.device
        self.backend = resolve_backend(attention_backend, self.device)
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
        self.attn_configs = attention_configs(model)
        self.temperature_tuned = temperature_tuned(model)  # Llama 4's NoPE layers: scaled by position

    def routed(self):
        """Context in which the model's attention runs over the pool (wrap every `run` call in it)."""
        return paged_attention(self.model, self.attn_configs, self.temperature_tuned)

    def run(
        self,
        input_ids: torch.Tensor,  # [1, T]
        positions: torch.Tensor,  # [1, T]
        meta: PagedAttentionMetadata,
        logits_to_keep: torch.Tensor | int,  # [R] query indices whose logits are needed, or 0 for all
        output_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [R, V] (and the last hidden states [R, hidden] when `output_hidden`). Call inside `routed()`.
        Device tensors in, device tensors out: nothing here syncs with the host, so it can be compiled/captured."""
        meta = self.backend.prepare(meta, self.mask_keys)
        ctx = PagedContext(self.pool.k_caches, self.pool.v_caches, meta, self.attend, self.layers)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=False,
            paged_ctx=ctx,
            logits_to_keep=logits_to_keep,
            output_hidden_states=output_hidden,
        )
        logits = out.logits[0]
        keep = isinstance(logits_to_keep, torch.Tensor)
        if keep and logits.shape[0] != logits_to_keep.shape[0]:  # a model that ignores `logits_to_keep`
            logits = logits[logits_to_keep]
        hidden = None
        if output_hidden:
            last = out.hidden_states[-1][0]
            hidden = last[logits_to_keep] if keep else last
        return logits, hidden

    def forward(self, segments: list[Segment], logit_rows: torch.Tensor, output_hidden: bool = False):
        """Eager forward of host-side segments; `logit_rows` [R] indexes the packed query tokens whose logits are
        needed. Returns (logits [R, V], hidden [R, hidden] or None)."""
        input_ids, positions, meta = build_metadata(segments, self.pool.block_size, self.device)
        with self.routed():
            return self.run(input_ids, positions, meta, logit_rows.to(self.device), output_hidden)


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
