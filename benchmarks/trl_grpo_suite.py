"""TRL's own GRPO test suite, run offline on CPU once with `GRPOTrainer` and once with `InfiniteGRPOTrainer`.

    python benchmarks/trl_grpo_suite.py /path/to/trl/tests [--out DIR] [-k EXPR]

The argument is TRL's `tests/` folder (or its `test_grpo_trainer.py`) from a TRL checkout; nothing of it is copied
into this repository. The Hub is offline, so the harness builds tiny stand-ins under `DIR/standins` (default
`/tmp/trl_grpo_suite`) with the ids the tests load: random-weight models of the same architectures
(`trl-internal-testing/tiny-<Class>`), each with a byte-level tokenizer (a 32k vocabulary, so a random model rarely
samples EOS) carrying the real chat template TRL ships for that family, and the `trl-internal-testing/zen` dataset
(the Zen of Python as prompts). pytest runs from that folder,
so `from_pretrained("trl-internal-testing/...")` / `load_dataset(...)` read the local folders.

Both runs are the same pytest invocation (same stand-ins, same skips); the second one has this module as a plugin
(`-p trl_grpo_suite`) that replaces `GRPOTrainer` / `GRPOConfig` in TRL's test module by `InfiniteGRPOTrainer` /
`InfiniteGRPOConfig` (the two-name swap a user makes). The report lists both pass counts and every test that passes
with TRL's trainer and not with ours, with its error; tests that patch `GenerationMixin.generate` / `model.generate`
are marked (the engine never calls `generate`). Not part of the CI suite (minutes of CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SWAP_ENV = "TRL_GRPO_SUITE_SWAP"
PATCHES_GENERATE = re.compile(r'patch\("transformers\.generation\.utils\.GenerationMixin\.generate"\)|'
                              r'patch\.object\([^)]*"generate"')

# ----------------------------------------------------------------------------------------------------- plugin side


def pytest_configure(config):
    """TRL's `testing_utils.py` may import `is_<pkg>_available` helpers the installed TRL release lacks (the test
    files come from a TRL checkout, not from the release): add those helpers (package importable or not), so the
    module imports and the tests needing that package skip or run as the package's presence says. Both runs alike."""
    import importlib
    import importlib.util

    import_utils = importlib.import_module("trl.import_utils")
    for arg in config.args:
        utils = Path(arg).resolve().parent / "testing_utils.py"
        if not utils.exists():
            continue
        block = re.search(r"from trl\.import_utils import \((.*?)\)", utils.read_text(), re.S)
        for name in re.findall(r"is_(\w+)_available", block.group(1) if block else ""):
            helper = f"is_{name}_available"
            if not hasattr(import_utils, helper):
                setattr(import_utils, helper, lambda pkg=name: importlib.util.find_spec(pkg) is not None)


def pytest_collection_modifyitems(session, config, items):
    """With `TRL_GRPO_SUITE_SWAP=1`: the two-name swap in every collected TRL test module."""
    if os.environ.get(SWAP_ENV) != "1":
        return
    from trl_infinite.trainer import InfiniteGRPOConfig, InfiniteGRPOTrainer

    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        if hasattr(module, "GRPOTrainer"):
            module.GRPOTrainer = InfiniteGRPOTrainer
        if hasattr(module, "GRPOConfig"):
            module.GRPOConfig = InfiniteGRPOConfig


# ------------------------------------------------------------------------------------------------------- stand-ins

# the prompts of `trl-internal-testing/zen` (`standard_prompt_only`): opening words of the Zen of Python's lines
ZEN_PROMPTS = [
    "Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
    "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats",
    "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse", "There should be one-- and",
    "Although that way may not be obvious at first unless", "Now is", "Although never is often better than",
    "If the implementation is hard to explain,", "If the implementation is easy to explain, it may",
    "Namespaces are one honking great idea --",
]
UNUSED_TOKENS = 32000  # a real-sized vocabulary: a random model then rarely samples EOS, like TRL's tiny models
SMALL = dict(vocab_size=None, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# repo name -> (model_type, head class, chat template name in trl.chat_template_utils, eos, bos, pad, config extras)
STANDINS = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal", "qwen2_5", "<|im_end|>", None, "<|endoftext|>", {}),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "seqcls", "qwen2_5", "<|im_end|>", None, "<|endoftext|>", {}),
    "tiny-Qwen3ForCausalLM": ("qwen3", "causal", "qwen3", "<|im_end|>", None, "<|endoftext|>", {"head_dim": 8}),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "seqcls", "qwen3", "<|im_end|>", None, "<|endoftext|>",
                                            {"head_dim": 8}),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal", "qwen3", "<|im_end|>", None, "<|endoftext|>",
                                 {"head_dim": 8, **MOE}),
    "tiny-LlamaForCausalLM-3.2": ("llama", "causal", "llama3_2", "<|eot_id|>", "<|begin_of_text|>",
                                  "<|finetune_right_pad_id|>", {}),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "seqcls", "llama3_2", "<|eot_id|>", "<|begin_of_text|>",
                                                "<|finetune_right_pad_id|>", {}),
    "tiny-MistralForCausalLM-0.2": ("mistral", "causal", None, "</s>", "<s>", "</s>", {"sliding_window": None}),
    "tiny-Gemma2ForCausalLM": ("gemma2", "causal", "gemma", "<eos>", "<bos>", "<pad>", {"head_dim": 8}),
    "tiny-Cohere2ForCausalLM": ("cohere2", "causal", "cohere2", "<|END_OF_TURN_TOKEN|>", "<BOS_TOKEN>", "<PAD>", {}),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", "causal", "glm4moe", "<|endoftext|>", None, "<|endoftext|>",
                                {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "head_dim": 8}),
    "tiny-GptOssForCausalLM": ("gpt_oss", "causal", "gptoss", "<|return|>", "<|startoftext|>", "<|endoftext|>",
                               {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8,
                                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "causal", "nemotron_3_nano", "<|im_end|>", None,
                                       "<|endoftext|>", {"hybrid_override_pattern": "M*", "head_dim": 8,
                                                         "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8,
                                                         "n_groups": 1, "mamba_n_groups": 1, "expand": 2}),
}
_SPECIAL = re.compile(r"<\|[^<>|\s]{1,40}\|>|</?(?:tool_call|tool_response|think|start_of_turn|end_of_turn|bos|eos|pad|"
                      r"s|BOS_TOKEN|PAD|arg_key|arg_value|tool_calls?)>|<\|?[A-Z_]{3,40}\|?>")


def _tokenizer(template_name: str | None, eos: str, bos: str | None, pad: str):
    import trl.chat_template_utils as ctu

    from trl_infinite.testing.offline_models import byte_tokenizer

    template = getattr(ctu, f"{template_name}_chat_template") if template_name else (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    )
    specials = sorted(set(_SPECIAL.findall(template)) | {eos, pad} | ({bos} if bos else set()))
    tok = byte_tokenizer(template, special_tokens=tuple(specials), eos_token=eos, pad_token=pad,
                         unused_tokens=UNUSED_TOKENS)
    if bos:
        tok.bos_token = bos
    return tok


def build_standins(root: Path) -> dict[str, str]:
    """Writes every stand-in (once) under `root/trl-internal-testing/`; returns {name: 'ok' or the build error}."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    status = {}
    for name, (model_type, head, template, eos, bos, pad, extra) in STANDINS.items():
        target = root / "trl-internal-testing" / name
        if (target / "config.json").exists():
            status[name] = "ok"
            continue
        try:
            tok = _tokenizer(template, eos, bos, pad)
            kw = {**SMALL, **extra, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                  "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id}
            config = AutoConfig.for_model(model_type, **kw)
            torch.manual_seed(0)
            if head == "seqcls":
                config.num_labels = 1
                model = AutoModelForSequenceClassification.from_config(config)
            else:
                model = AutoModelForCausalLM.from_config(config)
                model.generation_config.eos_token_id = tok.eos_token_id
                model.generation_config.pad_token_id = tok.pad_token_id
            config.name_or_path = model.config._name_or_path = f"trl-internal-testing/{name}"
            target.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(target)
            tok.save_pretrained(target)
            status[name] = "ok"
        except Exception as err:  # noqa: BLE001 - reported: the tests needing it fail in both runs alike
            status[name] = f"{type(err).__name__}: {err}"[:300]
    _write_zen(root / "trl-internal-testing" / "zen")
    return status


def _write_zen(folder: Path) -> None:
    """`trl-internal-testing/zen` configs `standard_prompt_only` and `conversational_prompt_only` (train 17, test 2),
    the opening words of the Zen of Python's lines as prompts, like TRL's dataset."""
    if (folder / "README.md").exists():
        return
    splits = {"train": ZEN_PROMPTS[:17], "test": ZEN_PROMPTS[17:]}
    configs = {
        "standard_prompt_only": lambda p: {"prompt": p},
        "conversational_prompt_only": lambda p: {"prompt": [{"role": "user", "content": f"What is better? {p}"}]},
    }
    lines = ["---", "configs:"]
    for config, make in configs.items():
        lines += [f"- config_name: {config}", "  data_files:"]
        for split, prompts in splits.items():
            path = folder / config / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(make(p)) + "\n" for p in prompts))
            lines += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    (folder / "README.md").write_text("\n".join(lines + ["---", ""]))


# ------------------------------------------------------------------------------------------------------ the runs


def run_suite(test_file: Path, standins: Path, junit: Path, swap: bool, select: str | None, log: Path) -> None:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        SWAP_ENV: "1" if swap else "0",
    }
    cmd = [sys.executable, "-m", "pytest", str(test_file), "-p", "trl_grpo_suite", "-p", "no:cacheprovider",
           "--rootdir", str(test_file.parent.parent), "-o", "addopts=", "-q", "-rN", f"--junitxml={junit}"]
    if select:
        cmd += ["-k", select]
    with log.open("w") as out:
        subprocess.run(cmd, cwd=standins, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """{test id: (passed | failed | error | skipped | xfailed | xpassed, first line of the message)}."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = child.tag if child.tag != "error" else "error"
                message = (child.get("message") or "").strip().splitlines()[0][:240] if child.get("message") else ""
                if child.tag == "skipped" and child.get("type") == "pytest.xfail":
                    status = "xfailed"
        out[test_id] = (status, message)
    return out


def patching_tests(test_file: Path) -> set[str]:
    """Names of test functions whose body (or decorators) patch `generate`."""
    names, source = set(), test_file.read_text()
    for match in re.finditer(r"((?:    @[^\n]*\n)*)    def (test_\w+)\(.*?(?=\n    (?:@|def )|\nclass |\Z)", source, re.S):
        if PATCHES_GENERATE.search(match.group(0)):
            names.add(match.group(2))
    return names


def report(trl: dict, ours: dict, patched: set[str], status: dict[str, str], test_file: Path) -> str:
    def count(res, kind):
        return sum(1 for s, _ in res.values() if s == kind)

    lines = [f"TRL test file: {test_file}", "", "| trainer | passed | failed | errors | skipped | xfailed |",
             "|---|---|---|---|---|---|"]
    for label, res in (("GRPOTrainer", trl), ("InfiniteGRPOTrainer", ours)):
        lines.append(f"| {label} | {count(res, 'passed')} | {count(res, 'failure')} | {count(res, 'error')} | "
                     f"{count(res, 'skipped')} | {count(res, 'xfailed')} |")
    regressions = [t for t, (s, _) in trl.items() if s == "passed" and ours.get(t, ("missing", ""))[0] != "passed"]
    lines += ["", f"Pass with GRPOTrainer, not with InfiniteGRPOTrainer: {len(regressions)}"]
    for t in regressions:
        base = t.split("::")[-1].split("[")[0]
        mark = " (patches generate)" if base in patched else ""
        lines.append(f"- `{t}`{mark}: {ours.get(t, ('missing', ''))[0]}: {ours.get(t, ('', ''))[1]}")
    gains = [t for t, (s, _) in ours.items() if s == "passed" and trl.get(t, ("missing", ""))[0] != "passed"]
    lines += ["", f"Pass with InfiniteGRPOTrainer, not with GRPOTrainer: {len(gains)}"]
    lines += [f"- `{t}`: {trl.get(t, ('missing', ''))[0]}: {trl.get(t, ('', ''))[1]}" for t in gains]
    lines += ["", "Stand-ins: " + ", ".join(f"{k}: {v}" for k, v in status.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", type=Path, help="TRL's tests/ folder or its test_grpo_trainer.py")
    parser.add_argument("--out", type=Path, default=Path("/tmp/trl_grpo_suite"))
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression (both runs)")
    parser.add_argument("--only", choices=("trl", "infinite"), default=None, help="run one side (reuses the other)")
    args = parser.parse_args()
    test_file = args.tests / "test_grpo_trainer.py" if args.tests.is_dir() else args.tests
    if not test_file.exists():
        raise SystemExit(f"{test_file} not found: pass TRL's tests/ folder (from a TRL checkout).")
    args.out.mkdir(parents=True, exist_ok=True)
    standins = args.out / "standins"
    status = build_standins(standins)
    for label, swap in (("trl", False), ("infinite", True)):
        if args.only in (None, label):
            run_suite(test_file.resolve(), standins, args.out / f"{label}.xml", swap, args.select,
                      args.out / f"{label}.log")
    text = report(outcomes(args.out / "trl.xml"), outcomes(args.out / "infinite.xml"),
                  patching_tests(test_file), status, test_file)
    (args.out / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
