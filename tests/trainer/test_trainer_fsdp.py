"""The engine under FSDP2 (`fully_shard`) and FSDP1, two processes on CPU over gloo, two GRPO steps each: the rollout
runs on the engine (with and without a LoRA adapter) over full weights gathered once (`trainer/full_weights.py`), with no collective in it, the
weights are resharded after it, and training matches the same run under DDP.

accelerate runs FSDP on accelerators only; the worker (`fsdp_worker.py`) puts accelerate's FSDP state back on CPU
processes, so the model is wrapped by accelerate's own FSDP code from the usual launch flags.

Tolerance: the parameters after each step equal DDP's within 1e-5 absolute (float32; FSDP reduce-scatters the
gradients where DDP all-reduces them, so the sums may round differently, and AdamW's first steps, `g / (|g| + eps)`,
magnify a rounding difference in a gradient near zero; measured: at most 1.2e-7 on torch 2.13, 1.7e-6 on torch 2.6
(FSDP1), for steps that move parameters by up to 0.05, 5,000 times the tolerance).

FSDP2 needs a torch whose `fully_shard` takes every argument the installed accelerate passes (accelerate 1.11 passes
`ignored_params`, which torch 2.6's lacks: FSDP2 does not start on that pair, whatever the trainer); its cases are
skipped, naming both releases, where it does not.
"""

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("fsdp_worker.py")
REPO = Path(__file__).resolve().parents[2]
WRAP = ["--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap",
        "Qwen3DecoderLayer", "--fsdp_cpu_ram_efficient_loading", "false"]
LAUNCH = {
    "ddp": ["--multi_gpu"],
    "fsdp2": ["--use_fsdp", "--fsdp_version", "2", *WRAP],
    "fsdp1": ["--use_fsdp", "--fsdp_version", "1", *WRAP, "--fsdp_sharding_strategy", "FULL_SHARD",
              "--fsdp_use_orig_params", "true", "--fsdp_sync_module_states", "false"],
}
PORTS = {"ddp": 29611, "fsdp2": 29612, "fsdp1": 29613, "ddp+lora": 29614, "fsdp2+lora": 29615, "fsdp1+lora": 29616,
         "fsdp1+unsupported": 29617}


def launch(mode: str, out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *LAUNCH[mode.split("+")[0]],
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(PORTS[mode]), str(WORKER), str(out), mode]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def fsdp2_unavailable() -> str | None:
    """Why accelerate's FSDP2 cannot start with the installed accelerate and torch, or None: the arguments
    accelerate's `fsdp2_prepare_model` always passes to `fully_shard` (the keys of its `fsdp2_kwargs` literal; later
    accelerate releases add `ignored_params` only on a torch that takes it) that the installed `fully_shard` does not
    take."""
    import accelerate
    from accelerate.utils import fsdp_utils
    from torch.distributed.fsdp import fully_shard

    literal = re.search(r"fsdp2_kwargs = \{(.*?)\n\s*\}", inspect.getsource(fsdp_utils.fsdp2_prepare_model), re.S)
    passed = re.findall(r'^\s*"(\w+)":', literal.group(1), re.M) if literal else []
    takes = inspect.signature(fully_shard).parameters
    missing = [name for name in passed if name not in takes]
    if not missing:
        return None
    return (f"accelerate {accelerate.__version__} passes `fully_shard` {missing}, which torch {torch.__version__}'s "
            f"`fully_shard` does not take: FSDP2 cannot start on this pair")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def get(mode: str) -> list[dict]:
        if mode.startswith("fsdp2") and (why := fsdp2_unavailable()):
            pytest.skip(why)
        if mode not in cache:
            cache[mode] = launch(mode, tmp_path_factory.mktemp(mode.replace("+", "_")))
        return cache[mode]

    return get


SHARDED = ["fsdp2", "fsdp1", "fsdp2+lora", "fsdp1+lora"]


@pytest.mark.parametrize("mode", SHARDED)
def test_the_engine_generates_with_no_collective_in_the_rollout(runs, mode):
    """Both processes run the engine (no fallback), each rollout's engine calls, plus a greedy engine call and
    `model.generate` (no `synced_gpus`) on the gathered model, run no collective, and the engine's greedy tokens are
    `generate`'s."""
    ranks = runs(mode)
    for r in ranks:
        assert r["distributed_type"] == "DistributedType.FSDP" and r["fsdp_version"] == int(mode[4])
        assert r["uses_engine"] and r["fallback"] == []
        assert len(r["engine_steps"]) == 2 and all(s and s > 0 for s in r["engine_steps"])
        assert r["rollout_collectives"] == [0, 0]
        assert len(r["greedy"]) == 2
        for engine, generate in r["greedy"]:
            assert engine == generate


@pytest.mark.parametrize("mode", SHARDED)
def test_the_gathered_weights_are_freed_after_the_rollout(runs, mode):
    """During the rollout FSDP holds gathered storage (and, FSDP2, every parameter is a full plain tensor); after
    it, none (every gathered buffer's storage resized to 0) and every FSDP2 parameter is a DTensor holding its
    shard (half the rows on two processes)."""
    for r in runs(mode):
        for during, after in zip(r["during"], r["after"]):
            assert during["gathered_bytes"] > 0 and after["gathered_bytes"] == 0
            if mode.startswith("fsdp2"):
                assert all(kind == "Parameter" for kind, _ in during["params"].values())
                for name, (kind, shape) in after["params"].items():
                    full = during["params"][name][1]
                    assert kind == "DTensor" and shape == (-(-full[0] // 2), *full[1:]), name


@pytest.mark.parametrize("mode", SHARDED)
def test_the_rollout_gathers_then_builds_the_pool_then_releases_it_then_reshards(runs, mode):
    """Each rollout: the engine is asked for (and its KV pool opened, so sized from what the gather left) while the
    weights are gathered, its pool released while they still are, and no gathered storage after the rollout."""
    for r in runs(mode):
        assert [event for event, _ in r["order"]] == ["engine", "release_pool"] * 2
        assert all(gathered > 0 for _, gathered in r["order"])
        assert [after["gathered_bytes"] for after in r["after"]] == [0, 0]
        assert r["stale_after_step"] == [True, True]  # each optimizer step reported to the engine
        # FSDP's reshard-after-forward settings (FSDP2 per param group, FSDP1 the handles' strategies) as before
        for before, during, after in zip(r["before"], r["during"], r["after"]):
            assert after["reshard_after_forward"] == before["reshard_after_forward"]
            assert during["reshard_after_forward"] != before["reshard_after_forward"]


@pytest.mark.parametrize("mode", SHARDED)
def test_training_matches_ddp(runs, mode):
    """Every parameter after each of the two steps equals the DDP run's within 1e-5 (module docstring), on both
    processes, and the steps moved them."""
    ddp = runs("ddp+lora" if mode.endswith("+lora") else "ddp")[0]
    for r in runs(mode):
        assert len(r["steps"]) == len(ddp["steps"]) == 2
        for step, (got, want) in enumerate(zip(r["steps"], ddp["steps"])):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=f"step {step}: {name}")
        moved = [name for name in ddp["steps"][0] if not torch.equal(ddp["steps"][0][name], ddp["steps"][1][name])]
        assert moved


def test_an_engine_refusing_the_model_falls_back_inside_the_gathered_window(runs):
    """The engine's support contract failing at its first call (inside the FSDP1 rollout's summoned window): TRL's
    own generation runs there (its `summon_full_params(recurse=False)` would nest in the window's, which FSDP1
    refuses), with the reason recorded, and training goes on on TRL's path."""
    for r in runs("fsdp1+unsupported"):
        assert not r["uses_engine"] and r["fallback"] == ["the test's model fails the engine's support contract"]
        assert len(r["steps"]) == 2 and r["after"][-1]["gathered_bytes"] == 0
