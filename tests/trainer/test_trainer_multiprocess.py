"""Data parallel on CPU, two processes (gloo), two GRPO steps. Each process runs its own engine on its own prompts;
rewards and advantages are gathered like TRL's; every parameter changes, identically on both ranks.

The launch is `accelerate launch --multi_gpu --num_processes 2` with `use_cpu=True` in the config: accelerate's
`--cpu` flag alone starts a single process unless MPI is set up (`--mpirun_hostfile`); the torchrun launcher behind
`--multi_gpu` starts both, and `use_cpu=True` makes them train on CPU over gloo.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("multiprocess_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517", str(WORKER),
           str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_each_process_runs_its_own_engine_on_its_own_prompts(ranks):
    assert all(r["num_processes"] == 2 and r["backend"] == "gloo" and r["engine_built"] for r in ranks)
    assert all(len(r["engine_steps"]) == 2 and all(s and s > 0 for s in r["engine_steps"]) for r in ranks)
    prompts = [set(r["prompts"]) for r in ranks]
    assert prompts[0] and prompts[1] and not prompts[0] & prompts[1]


def test_rewards_and_advantages_are_gathered_like_trl(ranks):
    """Both ranks see the same gathered reward vector (8 rows = 2 processes x 4); each keeps its own slice of the
    group-normalised advantages (TRL's `scale_rewards="group"`: (r - mean) / (std + 1e-4) per group of G = 4)."""
    a, b = ranks
    assert a["local_rows"] == b["local_rows"] == [4, 4]
    assert a["gathered_rewards"] == b["gathered_rewards"] and all(len(r) == 8 for r in a["gathered_rewards"])
    for step, rewards in enumerate(a["gathered_rewards"]):
        grouped = torch.tensor(rewards).view(-1, 4)
        expected = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        got = torch.tensor(a["advantages"][step] + b["advantages"][step])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_every_parameter_changes_identically_on_both_ranks(ranks):
    a, b = ranks
    for name, before in a["before"].items():
        assert torch.equal(before, b["before"][name]), name
        assert not torch.equal(before, a["after"][name]), f"{name} did not change"
        assert torch.equal(a["after"][name], b["after"][name]), f"{name} differs between ranks"
