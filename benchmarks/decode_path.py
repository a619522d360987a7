"""The frames one decode step walks from `RolloutEngine.generate` to the model's forward (issue 41's "fewer frames").

A tiny random Qwen3 on CPU runs `RolloutEngine.generate` once per path: `static` (the default config: the static
decode step), `eager` (a `generation_kwargs` processor: the eager decode forward) and `speculative` (an n-gram drafter:
the verification forward) and `graphs` (`cuda_graphs=True` on the CPU stand-in: the step that captures a bucket's
graph; a replay runs no Python). A forward pre-hook on the model records `inspect.stack()` at every forward; of the
decode forwards (no `_prefill` frame in the stack) the longest path is printed: the frames between
`RolloutEngine.generate` and the model's forward (both excluded; torch's module-call frames excluded), as
(function, file), with the count of frames and of distinct files. `compile=True` is not measured: Dynamo would trace
the hook, and a compiled step calls no Python forward.

    PYTHONPATH=. python benchmarks/decode_path.py [--path static|eager|speculative ...] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import trl_infinite  # noqa: E402
from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from trl_infinite.engine.decode.cpu_graphs import emulate_cuda_graphs  # noqa: E402
from trl_infinite.testing.tiny_configs import build_tiny_model  # noqa: E402

PACKAGE = str(Path(trl_infinite.__file__).parent)
PATHS = {
    "static": ({}, {}),
    "eager": ({}, {"generation_kwargs": {"no_repeat_ngram_size": 3}}),
    "speculative": ({"speculative_method": "ngram"}, {}),
    "graphs": ({"cuda_graphs": True}, {}),
}


def _is_forward_call(frame: inspect.FrameInfo) -> bool:
    """torch's module-call frames (the model is called from the frame just above them)."""
    return "torch/nn/modules/module.py" in frame.filename


def _path(stack: list[inspect.FrameInfo]) -> list[tuple[str, str]] | None:
    """(function, file) of the frames of `stack` (innermost first) below `RolloutEngine.generate` down to the one that
    calls the model, outermost first; None for a forward outside `generate` or of a prefill."""
    stack = stack[::-1]
    top = next((i for i, f in enumerate(stack) if f.function == "generate" and f.filename.startswith(PACKAGE)), None)
    if top is None or any(f.function == "_prefill" for f in stack):
        return None
    bottom = max(i for i in range(len(stack) - 1) if not _is_forward_call(stack[i]) and _is_forward_call(stack[i + 1]))
    return [(f.function, f.filename) for f in stack[top + 1 : bottom + 1]]


def decode_path(name: str) -> list[tuple[str, str]]:
    """The longest frame path (most `trl_infinite` frames) of any decode forward of one `generate` call on `name`'s
    path (see the module docstring)."""
    engine_kw, sampling_kw = PATHS[name]
    model = build_tiny_model("qwen3")
    paths: list[list[tuple[str, str]]] = []

    def hook(module, args, kwargs):
        path = _path(inspect.stack(0)[1:])
        if path is not None:
            paths.append(path)

    with emulate_cuda_graphs() if engine_kw.get("cuda_graphs") else contextlib.nullcontext():
        engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=2048, block_size=8, **engine_kw))
        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 8, 5, 6, 7, 8, 5]]
            engine.generate(prompts, num_generations=2,
                            sampling=SamplingParams(max_new_tokens=12, temperature=0.0, **sampling_kw))
        finally:
            handle.remove()
    if not paths:
        raise RuntimeError(f"no decode forward seen on the {name!r} path")
    return max(paths, key=lambda p: sum(path.startswith(PACKAGE) for _, path in p))


def summary(frames: list[tuple[str, str]]) -> dict:
    own = [(fn, path) for fn, path in frames if path.startswith(PACKAGE)]
    return {"frames": len(own), "files": len({p for _, p in own}), "all_frames": len(frames),
            "path": [f"{fn} ({os.path.relpath(p, Path(PACKAGE).parent)})" for fn, p in frames]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=list(PATHS), action="append", help="paths to measure (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the listing")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = {name: summary(decode_path(name)) for name in args.path or PATHS}
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    for name, s in out.items():
        print(f"{name}: {s['frames']} frames over {s['files']} files between RolloutEngine.generate and the model "
              f"forward ({s['all_frames']} with frames outside trl_infinite/)")
        for line in s["path"]:
            print(f"    {line}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
