"""Worker of `test_trainer_fsdp.py`, run as two processes by `accelerate launch` on CPU (gloo): two GRPO steps of
`InfiniteGRPOTrainer` under the accelerate setup given as the second argument (`ddp`, `fsdp1`, `fsdp2`; `+lora`
adds a LoRA adapter, `+unsupported` makes the engine refuse the model at its first call); writes what it saw to
`<out>/rank<i>.pt`.

accelerate runs FSDP on accelerators only: on CPU its state is `MULTI_CPU` and the FSDP plugin built from the launch
flags (`--use_fsdp --fsdp_version N ...`) is dropped. `cpu_fsdp` puts it back (the state's distributed type and
plugin, as `AcceleratorState` sets them on a GPU), so `accelerator.prepare` wraps the model with accelerate's own
FSDP code (`fully_shard` / `FullyShardedDataParallel`) over the gloo process group."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (for _models)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _models import tiny_model, tiny_tokenizer  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_infinite.engine import SamplingParams  # noqa: E402
from trl_infinite.trainer import InfiniteGRPOConfig, InfiniteGRPOTrainer  # noqa: E402
from trl_infinite.trainer.recompute import no_recompute  # noqa: E402

PROMPTS = [f"what is {i} plus {i + 1} ?" for i in range(16)]


def cpu_fsdp() -> None:
    """accelerate's FSDP on CPU processes (module docstring)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    init = AcceleratorState.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.fsdp_plugin = kwargs.get("fsdp_plugin") or getattr(self, "fsdp_plugin", None) or \
                FullyShardedDataParallelPlugin()
            self.distributed_type = DistributedType.FSDP

    AcceleratorState.__init__ = patched
    # FSDP1's compute device on CPU: `cpu:0` from the device handle against accelerate's `device_id=cpu`
    import torch.distributed.fsdp._init_utils as fsdp1_init

    fsdp1_init._get_compute_device = lambda *args, **kwargs: torch.device("cpu")


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def full_state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (FSDP2 DTensors gathered, FSDP1 flat parameters summoned), by its name in
    the unwrapped model."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    with trainer._dist.summon_full_params(trainer.model_wrapped, recurse=True, writeback=False):
        out = {}
        for name, p in model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
    return out


COLLECTIVES = ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_reduce", "broadcast",
               "_all_gather_base", "_reduce_scatter_base")


class CollectiveCounter:
    """Counts the calls of torch.distributed's collectives while installed."""

    def __init__(self):
        self.calls = 0
        self._saved = {}

    def __enter__(self):
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def counted(*args, _fn=fn, **kwargs):
                self.calls += 1
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def sharded_storage(trainer) -> dict:
    """How the parameters are held now: every parameter's (class, local shape), and the bytes of every gathered
    (unsharded) buffer FSDP keeps allocated (0 once resharded)."""
    model = trainer.model_wrapped
    params = {n: (type(p).__name__, tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape))
              for n, p in model.named_parameters()}
    gathered, reshard = 0, []
    if trainer._dist.fsdp_version == 2:
        from trl_infinite.trainer.full_weights import fsdp2_modules

        for m in fsdp2_modules(model):
            reshard.append([g.post_forward_mesh_info is not None for g in m._get_fsdp_state()._fsdp_param_groups])
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if unsharded is not None:
                        gathered += unsharded.untyped_storage().nbytes()
    elif trainer._dist.fsdp_version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for m in FSDP.fsdp_modules(model):
            reshard.append(str(m._handle._sharding_strategy) if m._handle else None)
            padded = getattr(m._handle.flat_param, "_full_param_padded", None) if m._handle else None
            if padded is not None:
                gathered += padded.untyped_storage().nbytes()
    return {"params": params, "gathered_bytes": gathered, "reshard_after_forward": reshard}


class RecordingTrainer(InfiniteGRPOTrainer):
    """Records, for each rollout: the collectives its engine calls ran, the parameters as the engine saw them,
    greedy engine output against `model.generate` on the gathered model, and the parameters' storage after it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = {"rollout_collectives": [], "during": [], "after": [], "greedy": [], "order": []}
        self.unsupported = False

    def _generate(self, prompts):
        self.record.setdefault("before", []).append(sharded_storage(self))
        out = super()._generate(prompts)
        self.record["after"].append(sharded_storage(self))
        return out

    def _get_engine(self, model):
        if self.unsupported:  # the engine's full support contract failing at its first call
            from trl_infinite.engine.model.support import UnsupportedModelError

            raise UnsupportedModelError("the test's model fails the engine's support contract")
        engine = super()._get_engine(model)
        # the order of a rollout: engine (and its pool) inside the gathered window, pool released before the reshard
        self.record["order"].append(("engine", sharded_storage(self)["gathered_bytes"]))
        if not hasattr(engine, "_recorded_release"):
            release = engine.release_pool

            def recorded_release():
                self.record["order"].append(("release_pool", sharded_storage(self)["gathered_bytes"]))
                release()

            engine.release_pool = recorded_release
            engine._recorded_release = True
        return engine

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        if self.unsupported:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        with CollectiveCounter() as counter:
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            self.record["during"].append(sharded_storage(self))
            model = self.accelerator.unwrap_model(self.model_wrapped)
            prompt = list(prompt_ids[0])
            engine = self._engine.generate([prompt], 1, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                       eos_token_ids=[]))
            # without checkpointing, as TRL generates (`unwrap_model_for_generation`): transformers 5.0's `generate`
            # on a train-mode model that checkpoints drops the KV cache and decodes wrong tokens after the first
            with torch.no_grad(), no_recompute(model):
                ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                     pad_token_id=0, synced_gpus=False)[0, len(prompt):].tolist()
            self.record["greedy"].append((list(engine.completion_ids[0]), ref))
        self.record["rollout_collectives"].append(counter.calls)
        return out


class StepSnapshots(TrainerCallback):
    """Every parameter, gathered, at the end of each optimizer step."""

    def __init__(self):
        self.trainer = None
        self.steps: list[dict[str, torch.Tensor]] = []
        self.stale: list[bool | None] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(full_state(self.trainer))
        engine = self.trainer._engine  # the optimizer step was reported to it: nothing it cached is reused
        self.stale.append(None if engine is None else engine.weights.stale)


def main(out_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    if mode.startswith("fsdp"):
        cpu_fsdp()
    args = InfiniteGRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", beta=0.0, learning_rate=0.1,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=2, logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0, rollout_max_active_sequences=2, rollout_kv_cache_tokens=512,
    )
    peft_config = None
    if "+lora" in mode:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    snapshots = StepSnapshots()
    trainer = RecordingTrainer(
        model=tiny_model("qwen3").train(), reward_funcs=token_sum_reward, args=args, peft_config=peft_config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tiny_tokenizer(), callbacks=[snapshots],
    )
    snapshots.trainer = trainer
    trainer.unsupported = mode.endswith("+unsupported")
    trainer.train()
    torch.save(
        {
            **trainer.record,
            "steps": snapshots.steps,
            "stale_after_step": snapshots.stale,
            "uses_engine": trainer.uses_engine,
            "fallback": trainer.engine_fallback_reasons,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "fsdp_version": trainer._dist.fsdp_version,
            "engine_steps": [h.get("rollout/decode_steps") for h in trainer.state.log_history if "loss" in h],
        },
        os.path.join(out_dir, f"rank{trainer.accelerator.process_index}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
