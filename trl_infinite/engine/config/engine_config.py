"""User-facing configuration of the rollout engine: `EngineConfig` (how to run), nested in sections (the scheduling
ones in `scheduling.py`); `SamplingParams` (what to sample) lives in `sampling_params.py` and is re-exported here.

Every setting has one name, its *flag* (`sections.py`): the keyword of the flat form `EngineConfig(kv_cache_tokens=...,
scheduler="lfs")`, the trainer field `rollout_<flag>`, the name its `ValueError` gives; in code it is read through its
section (`config.kv_cache.tokens`, `config.scheduling.scheduler`), by the modules its `readers` name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from difflib import get_close_matches
from typing import Any

from trl_infinite.engine.config.registry import ATTENTION_BACKENDS as _BACKENDS
from trl_infinite.engine.config.registry import DRAFTERS, SAMPLING_MODES
from trl_infinite.engine.config.sampling_params import SamplingParams
from trl_infinite.engine.config.scheduling import DEFAULT_MAX_BATCH, SchedulingConfig
from trl_infinite.engine.config.sections import Section, flags, section, setting, with_flags
from trl_infinite.engine.config.validate import choice, integer

ATTENTION_BACKENDS = ("auto", *_BACKENDS)  # "auto": Triton on CUDA when importable, else the torch reference
SUFFIX_SOURCES = ("siblings+history", "siblings", "history")
WEIGHT_COPY_MODES = ("auto", "off")

__all__ = ["ATTENTION_BACKENDS", "EngineConfig", "SAMPLING_MODES", "SUFFIX_SOURCES", "SamplingParams"]

_SPEC = "engine/spec_decode/"
COMPILE_MIN_TORCH = (2, 9)  # the oldest torch whose Dynamo was checked to trace the decode step (README)


def compile_supported(version: str | None = None) -> bool:
    """Whether `compile=True` is available on torch `version` (this one when None): older Dynamo cannot trace the
    step (torch 2.6: `dataclasses.replace` of the attention metadata; 2.7: a data-dependent operator after a
    parameter update)."""
    import torch
    from torch.torch_version import TorchVersion

    return TorchVersion(version or torch.__version__) >= COMPILE_MIN_TORCH


@dataclass(frozen=True)
class KVCacheConfig(Section):
    """The KV budget: a token count (`tokens`) or gigabytes (`gb`); with neither, `fraction` of the free accelerator
    memory on CUDA (read at each call) and `cpu_tokens` on CPU. Each `generate` call allocates the pool it can use,
    never more than the budget, and releases it at the end (`release`)."""

    flag_prefix = "kv_cache_"
    tokens: int | None = setting(None, "KV pool size in tokens (all layers).",
                                 ("engine/runner/kv_pool.py", f"{_SPEC}draft_model.py", "sim/replay.py"))
    gb: float | None = setting(None, "KV pool size in GB (K and V, all layers).", ("engine/runner/kv_pool.py",))
    fraction: float = setting(
        0.5, "Fraction of free CUDA memory for the KV pool when no explicit budget is set (with CUDA graphs, an "
        "estimate of the captured decode step's memory is taken out of it first).", ("engine/runner/kv_pool.py",),
        bounds="(0, 1]")
    cpu_tokens: int = setting(65536, "KV pool tokens on CPU with no budget set.",
                              ("engine/runner/kv_pool.py", f"{_SPEC}draft_model.py"))
    release: bool = setting(
        True, "Release the KV pool at the end of each `generate` call (its memory goes back to the allocator, e.g. "
        "for the training step between two rollouts); each call allocates the pool it can use (its prompts and the "
        "completions of the samples that can run together, rounded up by at most 12.5%), never above the budget. "
        "False: the pool is kept between calls (grown when a call needs more, up to the budget): no re-allocation, "
        "and on CUDA no re-capture of the decode graphs.", ("engine/engine.py",))
    reuse_across_calls: bool = setting(
        False, "Where the pool is kept between calls (`kv_cache_release=False`): keep what was computed from the "
        "weights (cached prefixes, the 16-bit weight copy) for the next call too. Set it only if you report every "
        "weight change: call `RolloutEngine.reset_prefix_cache()` after each (an optimizer step, a weight load, an "
        "in-place edit); the trainer does so at every optimizer step and weight load. False: recomputed at every call "
        "(the calls of one `keep_pool=True` run share them either way). Address, version-counter and PEFT adapter "
        "changes are caught in both cases, but fused optimizers, `p.data.copy_` and inference-mode tensors change "
        "weights without either (`engine/runner/weight_state.py`).", ("engine/engine.py",))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokens is not None and self.gb is not None:
            raise ValueError("Set at most one of `kv_cache_tokens` and `kv_cache_gb`, not both.")


@dataclass(frozen=True)
class DecodeConfig(Section):
    """How the forwards run: the paged attention backend, compilation, CUDA graphs, the CPU decode kernel."""

    attention_backend: str = setting(
        "auto", f"Paged attention backend: one of {list(ATTENTION_BACKENDS)}.",
        ("engine/engine.py", "engine/model/support.py", f"{_SPEC}draft_model.py", f"{_SPEC}speculator.py"),
        choices=ATTENTION_BACKENDS)
    cuda_graphs: bool = setting(
        True, "On CUDA, capture the decode step (forward + sampling) in one CUDA graph per batch bucket on first use "
        "and replay it every step; recaptured when parameter storage changes. Ignored off CUDA.", ("engine/engine.py",))
    cuda_graph_max_batch: int = setting(
        DEFAULT_MAX_BATCH, "Largest decode batch (rows, padded to its bucket) captured in a CUDA graph; larger "
        "batches run uncaptured (they are not launch-bound). The graphs' memory taken out of a `kv_cache_fraction` "
        "budget is sized for this batch, or for `max_active_sequences` where that is smaller.", ("engine/engine.py",))
    compile: bool = setting(
        False, "torch.compile the static decode step (fullgraph, one graph per batch bucket); works on CPU too. "
        "Combined with `cuda_graphs`, the compiled step is what gets captured. Dynamo's guards are checked on a "
        "bucket's first call and skipped after it (checked again when parameter storage moves): after changing the "
        "model otherwise (switching adapters, config flags), start a new engine.", ("engine/engine.py",))
    cpu_decode_kernel: bool = setting(
        True, "On CPU with a float32 KV pool (float32 weights, no autocast), decode steps (eager and compiled) run "
        "their attention in one C++ kernel call per layer that reads the KV pool through the block tables "
        "(`engine/attention/cpu_decode.py`). It is built with the system's C++ compiler and ninja when the first "
        "engine that uses it starts, after the model passed the support checks and only if a layer's head dims suit "
        "it (about half a minute once per machine, then cached in TORCH_EXTENSIONS_DIR); if it cannot be built, a "
        "warning and the torch path. False: always the torch path. Ignored off CPU.",
        ("engine/engine.py", "engine/model/support.py", f"{_SPEC}draft_model.py", f"{_SPEC}speculator.py"))
    weight_copy: str = setting(
        "auto", "Float32 weights under bfloat16 / float16 autocast (mixed precision): each rollout runs on a 16-bit "
        "copy of the weights autocast casts (Linear weights and biases; norms, embeddings stay float32), made once "
        "per call instead of cast at every forward; bit-identical logits, freed with the KV pool (before the training "
        "step), its bytes taken out of the KV budget first (`engine/runner/weight_copy.py`). 'auto': wherever that applies "
        "(CUDA and CPU); 'off': never (the float32 weights, cast at every forward).", ("engine/engine.py",),
        choices=WEIGHT_COPY_MODES)
    compile_backend: str = setting(
        "inductor", "torch.compile backend of `compile=True` (a name from `torch._dynamo.list_backends()`, e.g. "
        "'inductor', or 'eager' / 'aot_eager' to debug).", ("engine/engine.py",))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compile:
            import torch._dynamo

            # the value first: a bad backend name is named on every torch
            choice("compile_backend", self.compile_backend, tuple(torch._dynamo.list_backends(exclude_tags=())))
            if not compile_supported():
                raise ValueError(f"`compile=True` needs torch >= {'.'.join(map(str, COMPILE_MIN_TORCH))} (this is "
                                 f"{torch.__version__}, whose Dynamo cannot trace the decode step); `compile=False` "
                                 "generates the same tokens uncompiled.")


@dataclass(frozen=True)
class SuffixConfig(Section):
    flag_prefix = "speculative_suffix_"
    sources: str = setting(
        "siblings+history", f"Texts the 'suffix' drafter matches: one of {list(SUFFIX_SOURCES)} ('history' = the "
        "prompt's completions from earlier calls, kept in the engine's per-prompt history).", (f"{_SPEC}suffix.py",),
        choices=SUFFIX_SOURCES)
    max_depth: int = setting(24, "'suffix' drafter: depth of its suffix trie (longest match and draft).",
                             (f"{_SPEC}suffix.py",))
    min_confidence: float = setting(0.1, "'suffix' drafter: a draft stops where the product of its tokens' "
                                    "frequency shares falls below this.", (f"{_SPEC}suffix.py",), bounds="[0, 1]")
    min_match: int = setting(1, "'suffix' drafter: shortest matched context (tokens) that may draft.",
                             (f"{_SPEC}suffix.py",))


@dataclass(frozen=True)
class NgramConfig(Section):
    flag_prefix = "speculative_ngram_"
    max_n: int = setting(4, "'ngram' drafter: longest n-gram matched.", (f"{_SPEC}ngram.py",))
    min_n: int = setting(2, "'ngram' drafter: shortest n-gram matched.", (f"{_SPEC}ngram.py",))

    def __post_init__(self) -> None:
        super().__post_init__()
        integer(self.flag("max_n"), self.max_n, minimum=self.min_n)


@dataclass(frozen=True)
class BestOfNConfig(Section):
    flag_prefix = "speculative_best_of_n_"
    tail_batch: int = setting(4, "'best_of_n' drafter: batch size at or below which costly members (a draft "
                              "model) draft for every sample (the tail).", (f"{_SPEC}best_of_n.py",), minimum=0)


@dataclass(frozen=True)
class SpeculativeConfig(Section):
    """Lossless speculative decoding: the drafter, its options, the draft length controller."""

    flag_prefix = "speculative_"
    method: str | None = setting(
        None, "Speculative drafter: None (off), 'suffix', 'ngram', 'draft_model', 'best_of_n' or a registered name. "
        "Verification is lossless (greedy output is token-identical).", ("engine/engine.py", f"{_SPEC}speculator.py"),
        choices=DRAFTERS)
    num_tokens: int = setting(5, "Most draft tokens verified per sample and step (k).", (f"{_SPEC}speculator.py",))
    draft_model: object = setting(
        None, "Draft model (path or `nn.Module`) for 'draft_model' (and 'best_of_n').", (f"{_SPEC}speculator.py",))
    adaptive: bool = setting(
        True, "Per-sample draft length from recent acceptance and a batch switch from an online cost model "
        "(speculation off while the batch is large). False = always draft `speculative_num_tokens`.",
        (f"{_SPEC}speculator.py",))
    decoupled: bool = setting(
        False, "Decoupled speculation (SpecActor §4.1): the drafter drafts the next window on its own thread (its "
        "own CUDA stream on GPU) while the verification forward runs, assuming its drafts are accepted; the window "
        "and the coupled fallback are planned by the TGS model, per request (Alg. 1, 2). Lossless as coupled.",
        (f"{_SPEC}speculator.py",))
    draft_window: int | None = setting(
        None, "Decoupled speculation: drafting window w (drafts verified per sample and step, <= "
        "`speculative_num_tokens`). None = chosen by the TGS plan from measured step times and acceptance.",
        (f"{_SPEC}speculator.py",))
    reconfigure_every: int = setting(
        16, "Decoupled speculation: decode steps between re-plans at the current batch, each followed by the per-request "
        "reconfiguration (Alg. 2: samples below the mean acceptance get a smaller window or coupled execution). Once "
        "nothing is left to admit, the drain plan (per-row windows for the least makespan) instead: made at once, "
        "then at every step while it drafts and at this period while it does not. 0 = plan once.",
        (f"{_SPEC}speculator.py",), minimum=0)
    suffix: SuffixConfig = section(SuffixConfig)
    ngram: NgramConfig = section(NgramConfig)
    best_of_n: BestOfNConfig = section(BestOfNConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_window is not None and self.draft_window > self.num_tokens:
            raise ValueError(f"`speculative_draft_window` must be <= `speculative_num_tokens` ({self.num_tokens}), "
                             f"got {self.draft_window!r}.")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("`speculative_method='draft_model'` needs `speculative_draft_model` (a path or module).")
        if self.draft_model is not None and not isinstance(self.draft_model, (str, os.PathLike)):
            import torch  # only where a non-path value was given

            if not isinstance(self.draft_model, torch.nn.Module):
                raise ValueError("`speculative_draft_model` must be a `torch.nn.Module`, a local path or a Hub model "
                                 f"id (str / os.PathLike) or None, got {type(self.draft_model).__name__} "
                                 f"{self.draft_model!r:.60}.")


@dataclass(frozen=True)
class HistoryConfig(Section):
    """The engine's per-prompt history across `generate` calls (lengths for prediction, completions for drafts)."""

    flag_prefix = "history_"
    max_prompts: int = setting(
        4096, "Per-prompt history across `generate` calls (length prediction, drafts): most prompts kept, least "
        "recently visited dropped first. 0 = no history.", ("engine/sched/history.py",), minimum=0)
    max_visits: int = setting(2, "Visits (calls) remembered per prompt, most recent kept.", ("engine/sched/history.py",),
                              minimum=0)
    max_tokens: int = setting(
        2_000_000, "Most completion token ids the history keeps for drafts (int32, oldest visits dropped first; their "
        "lengths stay). 0 = lengths only.", ("engine/sched/history.py",), minimum=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_prompts > 0 and self.max_visits < 1:
            raise ValueError(f"`history_max_visits` must be >= 1 while `history_max_prompts` > 0, got "
                             f"{self.max_visits!r}.")


@dataclass(frozen=True, init=False)
class EngineConfig(Section):
    """How the rollout engine runs, in sections: `kv_cache` (the KV budget), `decode` (attention backend, compile,
    CUDA graphs), `scheduling` (sampling mode, scheduler, batch policy, length predictor and their options),
    `speculative` (drafter and options), `history` (the per-prompt history across calls).

    Build it from sections, from flags (`EngineConfig(kv_cache_tokens=4096, scheduler="sjf")`: each setting's flag is
    its section's prefix + its name, the trainer's field without `rollout_`), or both (flags apply on top of the
    sections given); an unknown keyword is a `TypeError` naming it, a bad value a `ValueError` naming the flag.
    """

    block_size: int = setting(16, "Tokens per KV block.", ("engine/runner/kv_pool.py", "engine/call.py", "engine/engine.py",
                                                            f"{_SPEC}draft_model.py", "sim/replay.py"))
    max_prefill_tokens: int = setting(
        4096, "Most prompt/recompute tokens run through the model in one prefill forward.", ("engine/engine.py",))
    prefix_cache: bool = setting(
        True, "Automatic prefix caching: full KV blocks are found again by the token ids they hold and all before "
        "them (a hash chain, ids compared on every hit) and shared copy-free: a system prompt or few-shot header "
        "shared by the prompts of a call, the earlier turns of a tool loop, a prompt seen by an earlier call, are "
        "prefilled once. Unreferenced cached blocks are evicted least recently used first when the pool needs "
        "room. Entries outlive a call only within a run of `keep_pool=True` calls (one trainer rollout), or where the "
        "pool is kept (`kv_cache_release=False`) and `kv_cache_reuse_across_calls` declares that every weight change "
        "is reported (`RolloutEngine.reset_prefix_cache()`). Lossless.",
        ("engine/runner/kv_pool.py", "sim/replay.py"))
    kv_cache: KVCacheConfig = section(KVCacheConfig)
    decode: DecodeConfig = section(DecodeConfig)
    scheduling: SchedulingConfig = section(SchedulingConfig)
    speculative: SpeculativeConfig = section(SpeculativeConfig)
    history: HistoryConfig = section(HistoryConfig)

    def __init__(self, **kwargs: Any) -> None:
        names = {f.name for f in fields(self)}
        given = {k: v for k, v in kwargs.items() if k in names}
        values = {k: v for k, v in kwargs.items() if k not in names}
        for name, value in with_flags(type(self), given, values).items():
            object.__setattr__(self, name, value)
        if values:
            name = next(iter(values))
            close = get_close_matches(name, [f.name for f in flags(EngineConfig)], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else " (`sections.flags(EngineConfig)` lists the flags)"
            raise TypeError(f"EngineConfig() got an unexpected keyword argument {name!r}{hint}")
        self.__post_init__()

