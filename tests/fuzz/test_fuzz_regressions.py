"""Failures the differential fuzzer found, shrunk by hypothesis, kept as ordinary tests (each failed before its fix).

1. Speculation changed the samples (on `main` before issue 24: the first example of the `fuzz-ci` profile):
   `best_of_n`, one prompt `[0]`, T=0.7, seed 0, 3 tokens: rejection sampling drew other tokens than plain sampling.
2. Divided rollout gave wrong greedy tokens (found with speculation switched off in the fuzzer, long profile): a
   minimal pool with the `prefix` probe parking every sample after its first token; when the next pass evicted the
   idle prompts, the first re-admitted sample prefilled its prompt again into other blocks, and it *and its siblings
   re-admitted after it in that pass* (whose prompt was resident again by then) kept decode rows pointing at the old
   prompt blocks.
3. The same bug with `chunk_tokens=1` (speculation off, `fuzz-ci` profile): first as log-probs that differ while the
   tokens still agree (the rows attended to stale prompt blocks), then as different sampled tokens.
4. An interrupted call (an exception from its first decode step) left its KV blocks held until the next call
   (speculation off, `fuzz-ci` profile).
5. The prefix cache ran the pool out (issue 28, whole suite): in a minimal pool a prompt pinned a cached completion
   block as the source of a partial hit, taking the block its sample's first own block needed.
6. The same (issue 28, `fuzz-ci`): a parked sample's prompt counted its cache hits as shared blocks before the idle
   prompts holding them were evicted, which left them unreferenced: the admission needed more blocks than counted.
7. The compiled step crashed with the `prefix` length predictor (`fuzz-long`, `compile=True`): its first forward
   asking for hidden states was the compiled one, where transformers installs its output-capturing hooks lazily
   under a `threading.Lock` Dynamo cannot trace (a graph break under `fullgraph=True`).
8. Sampled rows differed with the prefix cache, a tight pool and ngram speculation (`fuzz-long`; the speculation
   and the pool only shape the schedule): a re-prefilled prompt took a partial hit from a block whose first slot
   was itself a partial-hit copy target in the same prefill forward, which makes all copies at once (sources read
   before targets are written), so it copied the block's stale first slot.
9. A decode-step capture beside the decoupled drafter's forward (`fuzz-ci`, once the fuzzer drew captured decode
   steps): the draft model's host read on the drafter thread ran inside the verifier's capture (the emulator refused
   it; a CUDA capture in torch's global mode forbids other threads' allocations and synchronising copies). Captures
   and the drafter's forward now exclude each other (`cuda_graphs.capture_lock`).
10. A captured compiled step called Dynamo inside the capture (`fuzz-long`, `compile=True` with captured steps: the
   emulator refused it): the engine's first step matched an entry an earlier engine had compiled, so no bytecode was
   kept for the direct dispatch. The entry that served the call is now kept (`CompiledStep`).
11. A step compiled by inductor on the CPU could not be captured and the engine crashed instead of running it
   uncaptured (`fuzz-long`): inductor's C++ wrapper reads the step's size arguments on the host, and reported the
   emulator's refusal as `RuntimeError: aoti_torch_item_int64(...) API call failed`. The emulator now raises such a
   refusal again as itself (`cpu_graphs.GraphEmulator.capture`), as a CUDA capture's error stays one.
12. A sampled draw under bf16 autocast failed the check though it was a tie (`fuzz-long`, a LoRA model after a
   `p.data.copy_` change; the check's gap, not the engine's): the uniform fell where a rare token's narrow CDF
   interval lies for logits between the admissible extremes, so the engine drew one neighbour and the canonical
   engine the other, while neither extreme row drew both. The check now also accepts a token whose interval sweeps
   past the uniform between the extremes (`_drawn_somewhere`).

Not a failure but the check's own teeth: the bf16 autocast draw (the only one on the engine's 16-bit weight copy)
fails on a mutant whose held copy goes stale after a weight change (`test_the_autocast_draw_sees_a_stale_weight_copy`).
"""

from __future__ import annotations

import pytest
import torch
from _fuzz_engine import Call, Case, run_case
from _models import requires_compile, tiny_model

from trl_infinite.engine import SamplingParams
from trl_infinite.engine.decode.compiled import fast_dispatch_supported

BASE = {
    "sampling_mode": "full_group", "max_active_sequences": 1, "block_size": 1, "max_prefill_tokens": 1,
    "scheduler": "fifo", "length_predictor": "history", "history_fallback": "none", "prefix_predictor_k": 1,
    "prefix_predictor_min_train": 2, "batch_policy": "static", "chunk_tokens": None, "cpu_decode_kernel": False,
    "history_max_prompts": 0, "history_max_visits": 1, "history_max_tokens": 0, "compile": False,
    "speculative_method": None, "speculative_num_tokens": 1,
}


def test_speculation_keeps_the_plain_samples():
    config = {**BASE, "speculative_method": "best_of_n", "speculative_adaptive": False,
              "speculative_suffix_sources": "siblings+history", "speculative_suffix_min_confidence": 0.0,
              "speculative_ngram_min_n": 1, "speculative_ngram_max_n": 1, "speculative_best_of_n_tail_batch": 4}
    sampling = SamplingParams(max_new_tokens=3, temperature=0.7, seed=0)
    run_case(Case("qwen3", config, 0, [Call([[0]], 1, sampling)]))


def test_siblings_readmitted_after_their_prompt_was_prefilled_again():
    config = {**BASE, "block_size": 2, "scheduler": "sjf", "history_fallback": "siblings+prefix"}
    sampling = SamplingParams(max_new_tokens=20, temperature=0.0)
    run_case(Case("qwen3", config, 0, [Call([[0], [0], [0, 0]], 3, sampling)]))


def test_one_token_chunks_keep_log_probs_and_tokens():
    for max_new in (7, 5):
        sampling = SamplingParams(max_new_tokens=max_new, temperature=0.7, seed=0)
        run_case(Case("qwen3", {**BASE, "chunk_tokens": 1}, 0, [Call([[0], [0], [0, 0]], 1, sampling)]))


def test_an_interrupted_call_holds_no_block():
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
    run_case(Case("qwen3", BASE, 0, [Call([[0]], 1, sampling, fault_at=1)]))


def test_a_partial_prefix_hit_never_takes_a_needed_block():
    config = {**BASE, "block_size": 2, "kv_cache_release": False, "prefix_cache": True}
    sampling = SamplingParams(max_new_tokens=2, temperature=0.7, seed=0, generation_kwargs={"no_repeat_ngram_size": 2})
    run_case(Case("qwen3", config, 0, [Call([[0], [0, 0]], 1, sampling)]))


def test_evicting_idle_prompts_recounts_a_prompts_cache_hits():
    config = {**BASE, "scheduler": "sjf", "length_predictor": "prefix", "kv_cache_release": False,
              "prefix_cache": True}
    sampling = SamplingParams(max_new_tokens=3, temperature=0.7, seed=0, generation_kwargs={"no_repeat_ngram_size": 2})
    run_case(Case("qwen3", config, 0, [Call([[0, 0], [0], [0, 0]], 1, sampling)]))


@requires_compile
def test_the_compiled_step_asks_a_fresh_model_for_hidden_states():
    """Found with inductor; the `eager` backend runs the same Dynamo tracing that failed, without the slow C++ build.
    A fresh model: the world's may already carry the hooks from an earlier eager forward that asked for them."""
    config = {**BASE, "max_active_sequences": 5, "scheduler": "lfs", "length_predictor": "prefix",
              "batch_policy": "sla", "sla_decode_ms": 5.0, "sla_window": 1, "chunk_tokens": 8,
              "cpu_decode_kernel": True, "compile": True, "compile_backend": "eager"}
    sampling = SamplingParams(max_new_tokens=19, temperature=0.0)
    model = tiny_model("qwen3")
    run_case(Case("qwen3", config, 0, [Call([[32, 7], [86, 22, 74, 2, 3, 25, 47, 37], [32, 7]], 6, sampling)]),
             model=model)
    assert model.model._output_capturing_hooks_installed  # the step did ask for them


def test_a_partial_hit_never_copies_another_copys_target():
    config = {**BASE, "max_active_sequences": 5, "block_size": 2, "max_prefill_tokens": 5, "scheduler": "lrf",
              "prefix_predictor_k": 4, "cpu_decode_kernel": True, "kv_cache_release": True, "prefix_cache": True,
              "speculative_method": "ngram", "speculative_num_tokens": 4, "speculative_adaptive": False,
              "speculative_suffix_sources": "siblings+history", "speculative_suffix_min_confidence": 0.0,
              "speculative_ngram_min_n": 1, "speculative_ngram_max_n": 3, "speculative_best_of_n_tail_batch": 0,
              "speculative_decoupled": False}
    prompts = [[43, 37], [61, 65], [43, 33, 0], [0, 0, 74, 27, 17, 42, 23, 79, 63, 55, 27, 54, 86]]
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=0)
    run_case(Case("qwen3", config, 3, [Call(prompts, 6, sampling)]))


def test_a_capture_never_runs_beside_the_decoupled_drafter():
    config = {**BASE, "sampling_mode": "dynamic_slot", "max_active_sequences": 5, "block_size": 2,
              "max_prefill_tokens": 16, "scheduler": "lrf", "cpu_decode_kernel": True, "kv_cache_release": False,
              "prefix_cache": True, "history_max_prompts": 4096, "history_max_visits": 3,
              "prefix_predictor_min_train": 8, "speculative_method": "draft_model", "speculative_num_tokens": 4,
              "speculative_adaptive": False, "speculative_suffix_sources": "history",
              "speculative_suffix_min_confidence": 0.1, "speculative_ngram_min_n": 1, "speculative_ngram_max_n": 4,
              "speculative_best_of_n_tail_batch": 0, "speculative_decoupled": True, "speculative_draft_window": 1,
              "speculative_reconfigure_every": 1}
    sampling = SamplingParams(max_new_tokens=24, temperature=1.3, repetition_penalty=1.3, eos_token_ids=[53, 59],
                              seed=68_534_899_029, raw_logprobs_temperature=1.0)
    for _ in range(3):  # the drafter thread and the first capture overlap by timing: a few tries
        run_case(Case("llama", config, 0, [Call([[20]], 3, sampling)], graphs=True))


@requires_compile
@pytest.mark.skipif(not fast_dispatch_supported(), reason="without the direct dispatch (torch outside "
                    "decode.compiled.FAST_DISPATCH_TORCH) a capture records the guarded call: the emulator's limit")
def test_a_captured_compiled_step_whose_entry_another_engine_compiled():
    """Found with inductor (`fuzz-long`); the `eager` backend runs the same dispatch. A second engine's first step
    matched the entry the first engine's step had compiled (the same code object), so it compiled nothing; its
    graph capture then called the guarded function (Dynamo, inside the capture) instead of that entry's bytecode."""
    config = {**BASE, "max_active_sequences": 2, "compile": True, "compile_backend": "eager"}
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
    torch._dynamo.reset()
    for _ in range(2):
        run_case(Case("llama", config, 0, [Call([[45, 82, 55], [64, 0, 41]], 2, sampling)], graphs=True))


@requires_compile
@pytest.mark.skipif(not fast_dispatch_supported(), reason="without the direct dispatch (torch outside "
                    "decode.compiled.FAST_DISPATCH_TORCH) a capture records the guarded call: the emulator's limit")
def test_an_uncapturable_inductor_step_runs_uncaptured():
    config = {**BASE, "max_active_sequences": 4, "block_size": 4, "compile": True, "compile_backend": "inductor"}
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    torch._dynamo.reset()
    run_case(Case("llama", config, 0, [Call([[5, 17, 33, 8, 60, 2, 9], [11, 4, 70]], 2, sampling)], graphs=True))


def test_a_draft_on_the_config_of_a_lora_target():
    """Found by the long profile (a harness gap, not the engine's): the `shared_config` draft was built as
    `type(target)(target.config)`, which a LoRA target (a `PeftModel`) cannot be; it is built from the base model's
    class. The engine must then speculate losslessly with a draft on the config of a target whose weights change."""
    config = {**BASE, "max_active_sequences": 2, "speculative_method": "draft_model", "speculative_num_tokens": 2,
              "speculative_adaptive": False}
    sampling = SamplingParams(max_new_tokens=5, temperature=0.7, seed=0)
    run_case(Case("qwen3", config, 0, [Call([[0, 0, 0]], 2, sampling), Call([[4, 9]], 2, sampling)],
                  draft="shared_config", weights="lora"))


def _autocast_case(route: str) -> Case:
    """Two greedy calls under bf16 autocast on the engine's 16-bit weight copy (held between them: the pool is
    kept), the weights changed by `route` before the second."""
    config = {**BASE, "max_active_sequences": 4, "block_size": 4, "max_prefill_tokens": 4096,
              "kv_cache_release": False, "prefix_cache": True, "weight_copy": "auto"}
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    return Case("qwen3", config, 0, [Call(prompts, 2, sampling), Call(prompts, 2, sampling, change=(route, 1))],
                weights="train", autocast=True)


@pytest.mark.parametrize("route", ["sgd", "adamw_fused"])
def test_the_autocast_draw_sees_a_stale_weight_copy(route, monkeypatch):
    """The autocast draw is the only one in which the engine runs on its 16-bit weight copy. Its checks pass on the
    engine as it is, and fail on a mutant whose held copy is never brought up to date after a weight change (one
    the fingerprint sees, SGD, and one it cannot, a fused AdamW step: without `kv_cache_reuse_across_calls` every call
    takes the weights as changed)."""
    from trl_infinite.engine.runner.weight_copy import WeightCopy

    run_case(_autocast_case(route))
    refresh = WeightCopy.refresh

    def stale(copy):
        if not copy.allocated:
            refresh(copy)

    monkeypatch.setattr(WeightCopy, "refresh", stale)
    with pytest.raises(AssertionError, match="without a tie"):
        run_case(_autocast_case(route))


def test_an_optimizer_step_after_the_adapters_were_disabled():
    """Found by the autocast draw's long run (a harness gap, not the engine's): `lora_toggle` disables the adapters,
    whose parameters then stop requiring grad, and the next optimizer route built an optimizer over no parameter
    (`ValueError`); it now steps nothing, as a trainer's step changes nothing then."""
    config = {**BASE, "max_active_sequences": 4, "block_size": 4, "kv_cache_release": False,
              "kv_cache_reuse_across_calls": True}
    prompts = [[45, 47, 11, 47, 2, 81, 27], [45, 47, 11, 47, 2, 81, 33, 89]]
    calls = [Call(prompts, 2, SamplingParams(max_new_tokens=4, temperature=0.0)),
             Call(prompts, 2, SamplingParams(max_new_tokens=5, temperature=0.7, seed=421), change=("lora_toggle", 1)),
             Call(prompts, 1, SamplingParams(max_new_tokens=6, temperature=1.3, seed=9), change=("adamw_fused", 2))]
    run_case(Case("qwen3", config, 0, calls, weights="lora"))


def test_a_draw_between_the_admissible_extremes_is_a_tie():
    """12: row 1's second token was 64 here and 61 in the canonical engine (p = 0.0016 and 0.0002, the uniform
    between their intervals), both within the bf16 bound of the model's own logits."""
    config = {**BASE, "max_active_sequences": 7, "weight_copy": "auto"}
    sampling = SamplingParams(max_new_tokens=2, temperature=0.7, seed=8699)
    prompt = [95, 95, 71, 77, 91, 5, 85, 12, 69, 66, 76, 88, 76, 22]
    run_case(Case("qwen3", config, 0, [Call([prompt], 5, sampling, change=("data_copy", 1652))], weights="lora",
                  autocast=True))
