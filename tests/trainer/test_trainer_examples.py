"""`examples/grpo.py` runs end to end from a YAML-style config on a local jsonl dataset (tiny model, CPU)."""

import importlib.util
import json
import sys
from pathlib import Path

from _models import tiny_model, tiny_tokenizer
from trl import ModelConfig, TrlParser

from trl_infinite.trainer import InfiniteGRPOConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"


def load_example():
    sys.path.insert(0, str(EXAMPLE.parent))  # as `python examples/grpo.py` does: its `rewards.py` beside it
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_grpo_script_trains_from_cli_flags(tmp_path):
    model_dir = tmp_path / "model"
    tiny_model("qwen3").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    rows = [{"question": f"what is {i} plus {i} ?", "answer": f"#### {2 * i}"} for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    example = load_example()
    parser = TrlParser((example.GRPOScriptArguments, InfiniteGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(
        args=[
            "--model_name_or_path", str(model_dir), "--dtype", "float32", "--dataset_name", str(data),
            "--reward_funcs", "gsm8k", "format", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true",
            "--bf16", "false", "--report_to", "none", "--max_steps", "1", "--per_device_train_batch_size", "4",
            "--num_generations", "4", "--max_completion_length", "6", "--beta", "0", "--save_strategy", "no",
            "--rollout_max_active_sequences", "2", "--rollout_kv_cache_tokens", "1024", "--disable_tqdm", "true",
        ]
    )
    assert training_args.rollout_max_active_sequences == 2 and training_args.rollout_kv_cache_tokens == 1024
    example.main(script_args, training_args, model_args)
    assert (tmp_path / "out" / "model.safetensors").exists()
