"""User-facing configuration of the rollout engine: `EngineConfig` (how to run); `SamplingParams` (what to sample)
lives in `sampling_params.py` and is re-exported here."""

from __future__ import annotations

from dataclasses import dataclass, field

from .registry import ATTENTION_BACKENDS as _BACKENDS
from .registry import BATCH_POLICIES, DRAFTERS, PREDICTORS, SCHEDULERS
from .sampling_params import SamplingParams
from .validate import choice, integer, number, positive

SAMPLING_MODES = ("full_group", "micro_group", "fixed_slot", "dynamic_slot")
ATTENTION_BACKENDS = ("auto", *_BACKENDS)  # "auto": Triton on CUDA when importable, else the torch reference
SUFFIX_SOURCES = ("siblings+history", "siblings", "history")
HISTORY_FALLBACKS = ("none", "siblings", "prefix", "siblings+prefix")

__all__ = ["ATTENTION_BACKENDS", "EngineConfig", "SAMPLING_MODES", "SUFFIX_SOURCES", "SamplingParams"]


@dataclass
class EngineConfig:
    """How the rollout engine runs.

    The KV budget is given either as a token count (`kv_cache_tokens`) or in gigabytes (`kv_cache_gb`); with neither,
    the engine takes `kv_cache_fraction` of the free accelerator memory on CUDA (read at each call) and
    `default_cpu_kv_tokens` on CPU. Each `generate` call allocates the pool it can use, never more than the budget,
    and releases it at the end (`kv_cache_release`).
    """

    sampling_mode: str = field(
        default="fixed_slot",
        metadata={"help": f"How samples share the decode batch: one of {list(SAMPLING_MODES)}."},
    )
    max_active_sequences: int | None = field(
        default=32,
        metadata={"help": "g: decode slots (micro-group size) of `micro_group` and `fixed_slot`. `full_group` runs "
                  "every sample at once and `dynamic_slot` as many as memory allows, so both ignore it."},
    )
    kv_cache_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens (all layers)."})
    kv_cache_gb: float | None = field(default=None, metadata={"help": "KV pool size in GB (K and V, all layers)."})
    kv_cache_fraction: float = field(
        default=0.5,
        metadata={"help": "Fraction of free CUDA memory for the KV pool when no explicit budget is set (with CUDA "
                  "graphs, an estimate of the captured decode step's memory is taken out of it first)."},
    )
    default_cpu_kv_tokens: int = field(default=65536, metadata={"help": "KV pool tokens on CPU with no budget set."})
    kv_cache_release: bool = field(
        default=True,
        metadata={"help": "Release the KV pool at the end of each `generate` call (its memory goes back to the "
                  "allocator, e.g. for the training step between two rollouts); each call allocates the pool it can "
                  "use (its prompts and the completions of the samples that can run together, rounded up by at most "
                  "12.5%), never above the budget. False: the pool is kept between calls (grown when a call needs "
                  "more, up to the budget): no re-allocation, and on CUDA no re-capture of the decode graphs."},
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per KV block."})
    max_prefill_tokens: int = field(
        default=4096, metadata={"help": "Most prompt/recompute tokens run through the model in one prefill forward."}
    )
    attention_backend: str = field(
        default="auto", metadata={"help": f"Paged attention backend: one of {list(ATTENTION_BACKENDS)}."}
    )
    cuda_graphs: bool = field(
        default=True,
        metadata={"help": "On CUDA, capture the decode step (forward + sampling) in one CUDA graph per batch bucket "
                  "on first use and replay it every step; recaptured when parameter storage changes. Ignored off "
                  "CUDA."},
    )
    cuda_graph_max_batch: int = field(
        default=256,
        metadata={"help": "Largest decode batch (rows, padded to its bucket) captured in a CUDA graph; larger batches "
                  "run uncaptured (they are not launch-bound). The graphs' memory taken out of a `kv_cache_fraction` "
                  "budget is sized for this batch, or for `max_active_sequences` where that is smaller."},
    )
    compile: bool = field(
        default=False,
        metadata={"help": "torch.compile the static decode step (fullgraph, one graph per batch bucket); works on "
                  "CPU too. Combined with `cuda_graphs`, the compiled step is what gets captured. Dynamo's guards "
                  "are checked on a bucket's first call and skipped after it (checked again when parameter storage "
                  "moves): after changing the model otherwise (switching adapters, config flags), start a new engine."},
    )
    cpu_decode_kernel: bool = field(
        default=True,
        metadata={"help": "On CPU with a float32 KV pool (float32 weights, no autocast), decode steps (eager and "
                  "compiled) run their attention in one C++ kernel call per layer that reads the KV pool through the "
                  "block tables (`engine/attention/cpu_decode.py`). It is built with the system's C++ compiler and "
                  "ninja when the first engine that uses it starts, after the model passed the support checks and "
                  "only if a layer's head dims suit it (about half a minute once per machine, then cached in "
                  "TORCH_EXTENSIONS_DIR); if it cannot be built, a warning and the torch path. False: always the "
                  "torch path. Ignored off CPU."},
    )
    compile_backend: str = field(
        default="inductor",
        metadata={"help": "torch.compile backend of `compile=True` (a name from `torch._dynamo.list_backends()`, "
                  "e.g. 'inductor', or 'eager' / 'aot_eager' to debug)."},
    )
    scheduler: str = field(
        default="lfs",
        metadata={"help": "Order in which pending samples take free slots. Default 'lfs' with the 'history' "
                  "predictor: prompts that produced longer completions on earlier visits start first (FIFO order "
                  "for prompts never seen); chosen from the simulator on recorded traces (benchmarks/RESULTS.md)."},
    )
    batch_policy: str = field(default="static", metadata={"help": "How many samples run at once."})
    length_predictor: object = field(
        default="history",
        metadata={"help": "Length predictor of length-aware schedulers (sjf, lfs, lrf, fptas, infinite): 'history' "
                  "(the prompt's lengths on earlier calls, then `history_fallback`, then the mean of recent "
                  "lengths), 'prefix' (online regression head on the policy's hidden state at completion token k), "
                  "'group', 'oracle' (forced lengths; benchmarks), 'none', a callable (prompt_ids, prefix_ids) -> "
                  "length, or a sequence-classification model."},
    )
    prefix_predictor_k: int = field(default=16, metadata={"help": "k: prefix tokens the 'prefix' predictor reads."})
    prefix_predictor_min_train: int = field(
        default=8, metadata={"help": "'prefix' predictor: finished samples its head needs before it predicts."}
    )
    prefix_predictor_l2: float | None = field(
        default=None, metadata={"help": "'prefix' predictor: ridge penalty of its head (None = chosen by "
                                "leave-one-prompt-out error)."}
    )
    fptas_epsilon: float = field(default=0.1, metadata={"help": "FPTAS tolerance: plan <= (1 + eps) * optimum."})
    chunk_tokens: int | None = field(
        default=None,
        metadata={"help": "Divided rollout: a sample decodes at most this many tokens, then returns to the queue "
                  "with its KV kept (moved to host memory when the pool needs room). None = off."},
    )
    sla_decode_ms: float | None = field(
        default=None, metadata={"help": "batch_policy='sla': target decode step latency in milliseconds."}
    )
    sla_tolerance_ms: float | None = field(
        default=None,
        metadata={"help": "batch_policy='sla': band around `sla_decode_ms` within which the batch bound stays "
                  "(None = 5% of the target)."},
    )
    sla_min_batch: int = field(
        default=1, metadata={"help": "batch_policy='sla': smallest batch bound (the largest is "
                             "`max_active_sequences`, 256 when None)."}
    )
    sla_alpha: int = field(default=2, metadata={"help": "batch_policy='sla': width of the batch-size search window."})
    sla_delta: int = field(default=1, metadata={"help": "batch_policy='sla': step by which the window widens."})
    sla_window: int = field(
        default=4, metadata={"help": "batch_policy='sla': decode steps measured per adjustment of the bound."}
    )
    memory_eps: float = field(
        default=0.05,
        metadata={"help": "batch_policy='memory': eps_m, the probability that the running samples outgrow the pool "
                  "(the safety buffer is Phi^-1(1 - eps_m) standard deviations)."},
    )
    memory_min_observations: int = field(
        default=4,
        metadata={"help": "batch_policy='memory': finished samples before their length statistics are used "
                  "(until then every sample is assumed to reach `max_new_tokens`)."},
    )
    speculative_method: str | None = field(
        default=None,
        metadata={"help": "Speculative drafter: None (off), 'suffix', 'ngram', 'draft_model', 'best_of_n' or a "
                  "registered name. Verification is lossless (greedy output is token-identical)."},
    )
    num_speculative_tokens: int = field(
        default=5, metadata={"help": "Most draft tokens verified per sample and step (k)."}
    )
    speculative_draft_model: object = field(
        default=None, metadata={"help": "Draft model (path or `nn.Module`) for 'draft_model' (and 'best_of_n')."}
    )
    speculative_suffix_sources: str = field(
        default="siblings+history",
        metadata={"help": f"Texts the 'suffix' drafter matches: one of {list(SUFFIX_SOURCES)} ('history' = the "
                  "prompt's completions from earlier calls, kept in the engine's per-prompt history)."},
    )
    speculative_ngram_max_n: int = field(default=4, metadata={"help": "'ngram' drafter: longest n-gram matched."})
    speculative_ngram_min_n: int = field(default=2, metadata={"help": "'ngram' drafter: shortest n-gram matched."})
    speculative_suffix_max_depth: int = field(
        default=24, metadata={"help": "'suffix' drafter: depth of its suffix trie (longest match and draft)."}
    )
    speculative_suffix_min_confidence: float = field(
        default=0.1, metadata={"help": "'suffix' drafter: a draft stops where the product of its tokens' "
                             "frequency shares falls below this."}
    )
    speculative_suffix_min_match: int = field(
        default=1, metadata={"help": "'suffix' drafter: shortest matched context (tokens) that may draft."}
    )
    speculative_best_of_n_tail_batch: int = field(
        default=4, metadata={"help": "'best_of_n' drafter: batch size at or below which costly members "
                            "(a draft model) draft for every sample (the tail)."}
    )
    speculative_adaptive: bool = field(
        default=True,
        metadata={"help": "Per-sample draft length from recent acceptance and a batch switch from an online cost "
                  "model (speculation off while the batch is large). False = always draft `num_speculative_tokens`."},
    )

    history_fallback: str = field(
        default="none",
        metadata={"help": "length_predictor='history': what predicts a prompt with no history, before the mean of "
                  "recent lengths: 'none', 'siblings' (this call's finished siblings, Seer), 'prefix' (the prefix "
                  "head; unseen prompts' samples probe their first k tokens) or 'siblings+prefix'."},
    )
    history_max_prompts: int = field(
        default=4096,
        metadata={"help": "Per-prompt history across `generate` calls (length prediction, drafts): most prompts "
                  "kept, least recently visited dropped first. 0 = no history."},
    )
    history_max_visits: int = field(
        default=2, metadata={"help": "Visits (calls) remembered per prompt, most recent kept."}
    )
    history_mean_window: int = field(
        default=4096, metadata={"help": "length_predictor='history': recent finished lengths behind its global mean."}
    )
    history_max_tokens: int = field(
        default=2_000_000,
        metadata={"help": "Most completion token ids the history keeps for drafts (int32, oldest visits dropped "
                  "first; their lengths stay). 0 = lengths only."},
    )

    def __post_init__(self) -> None:
        choice("sampling_mode", self.sampling_mode, SAMPLING_MODES)
        choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        integer("max_active_sequences", self.max_active_sequences, allow_none=True)
        if self.max_active_sequences is None and self.sampling_mode in ("micro_group", "fixed_slot"):
            raise ValueError(
                f"`max_active_sequences` must be a positive integer for sampling_mode={self.sampling_mode!r}."
            )
        integer("kv_cache_tokens", self.kv_cache_tokens, allow_none=True)
        positive("kv_cache_gb", self.kv_cache_gb, allow_none=True)
        if self.kv_cache_tokens is not None and self.kv_cache_gb is not None:
            raise ValueError("Set at most one of `kv_cache_tokens` and `kv_cache_gb`, not both.")
        number("kv_cache_fraction", self.kv_cache_fraction)
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"`kv_cache_fraction` must be in (0, 1], got {self.kv_cache_fraction!r}.")
        integer("default_cpu_kv_tokens", self.default_cpu_kv_tokens)
        integer("block_size", self.block_size)
        integer("max_prefill_tokens", self.max_prefill_tokens)
        integer("cuda_graph_max_batch", self.cuda_graph_max_batch)
        for name in ("cuda_graphs", "compile", "cpu_decode_kernel", "kv_cache_release"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        if self.compile:
            import torch._dynamo

            choice("compile_backend", self.compile_backend, tuple(torch._dynamo.list_backends(exclude_tags=())))
        SCHEDULERS.check(self.scheduler)  # names only: the plug-ins are imported when the engine builds them
        BATCH_POLICIES.check(self.batch_policy)
        self._check_scheduling()
        self._check_speculative()
        self._check_history()

    def _check_history(self) -> None:
        choice("history_fallback", self.history_fallback, ("none", "siblings", "prefix", "siblings+prefix"))
        integer("history_mean_window", self.history_mean_window)
        for name in ("history_max_prompts", "history_max_visits", "history_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"`{name}` must be an integer >= 0, got {value!r}.")
        if self.history_max_prompts > 0 and self.history_max_visits < 1:
            raise ValueError(f"`history_max_visits` must be >= 1 while `history_max_prompts` > 0, got "
                             f"{self.history_max_visits!r}.")

    def _check_scheduling(self) -> None:
        if isinstance(self.length_predictor, str) or not callable(self.length_predictor):
            PREDICTORS.check(self.length_predictor)
        integer("prefix_predictor_k", self.prefix_predictor_k)
        integer("prefix_predictor_min_train", self.prefix_predictor_min_train)
        positive("prefix_predictor_l2", self.prefix_predictor_l2, allow_none=True)
        if not isinstance(self.fptas_epsilon, (int, float)) or not 0.0 < self.fptas_epsilon <= 1.0:
            raise ValueError(f"`fptas_epsilon` must be in (0, 1], got {self.fptas_epsilon!r}.")
        integer("chunk_tokens", self.chunk_tokens, allow_none=True)
        positive("sla_decode_ms", self.sla_decode_ms, allow_none=True)
        if self.batch_policy == "sla" and self.sla_decode_ms is None:
            raise ValueError("`batch_policy='sla'` needs `sla_decode_ms` (target decode step latency in ms).")
        self._check_admission()

    def _check_admission(self) -> None:
        positive("sla_tolerance_ms", self.sla_tolerance_ms, allow_none=True)
        integer("sla_min_batch", self.sla_min_batch)
        top = self.max_active_sequences or 256
        if self.batch_policy == "sla" and self.sla_min_batch > top:
            raise ValueError(f"`sla_min_batch` must be <= the largest batch bound {top} (`max_active_sequences`), "
                             f"got {self.sla_min_batch!r}.")
        integer("sla_alpha", self.sla_alpha)
        integer("sla_delta", self.sla_delta, minimum=0)
        integer("sla_window", self.sla_window)
        number("memory_eps", self.memory_eps)
        if not 0.0 < self.memory_eps < 1.0:
            raise ValueError(f"`memory_eps` must be in (0, 1), got {self.memory_eps!r}.")
        integer("memory_min_observations", self.memory_min_observations)

    def _check_speculative(self) -> None:
        if self.speculative_method is not None:
            DRAFTERS.check(self.speculative_method)
        integer("num_speculative_tokens", self.num_speculative_tokens)
        integer("speculative_ngram_min_n", self.speculative_ngram_min_n)
        integer("speculative_ngram_max_n", self.speculative_ngram_max_n, minimum=self.speculative_ngram_min_n)
        integer("speculative_suffix_max_depth", self.speculative_suffix_max_depth)
        integer("speculative_suffix_min_match", self.speculative_suffix_min_match)
        number("speculative_suffix_min_confidence", self.speculative_suffix_min_confidence)
        if not 0.0 <= self.speculative_suffix_min_confidence <= 1.0:
            raise ValueError(f"`speculative_suffix_min_confidence` must be in [0, 1], got "
                             f"{self.speculative_suffix_min_confidence!r}.")
        integer("speculative_best_of_n_tail_batch", self.speculative_best_of_n_tail_batch, minimum=0)
        choice("speculative_suffix_sources", self.speculative_suffix_sources, SUFFIX_SOURCES)
        if not isinstance(self.speculative_adaptive, bool):
            raise ValueError(f"`speculative_adaptive` must be True or False, got {self.speculative_adaptive!r}.")
        if self.speculative_method == "draft_model" and self.speculative_draft_model is None:
            raise ValueError("`speculative_method='draft_model'` needs `speculative_draft_model` (a path or module).")

    @property
    def slot_limit(self) -> int | None:
        """Most sequences decoding at once (None = bounded by memory only)."""
        if self.sampling_mode in ("full_group", "dynamic_slot"):
            return None
        return self.max_active_sequences
