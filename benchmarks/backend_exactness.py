"""Which attention backend setting reproduces the model, row by row: a diagnostic of the support contract's
exactness check (`trl_infinite.engine.model.exactness`) on one device.

For each tiny random model x weights dtype x backend variant, the contract's probe is run the engine's eager way
(the prompt prefilled into a small pool, `DECODE_TOKENS` tokens decoded one per forward) and the relative logit error
(max |engine - model| / max |model|) of every row against the model's own forward without a cache is printed: row 0
is the prefill's last position, rows 1.. the decoded tokens. The variants of the Triton backend isolate a cause:
`triton` (as the engine runs it: autotuning on where CUDA), `triton-fixed` (the first tile candidate, no autotuning),
`triton-fp32-dots` (the dot products in fp32 'ieee' whatever the pool dtype), `triton-1split` (one KV split in the
prompt and own-token kernels). `own-cache` is the model's own KV-cached decode (what `generate` runs) against the same
forward: its rounding noise; on CUDA, `own-<kernel>` is the model's own forward with `scaled_dot_product_attention`
held to one kernel (math, efficient, cuDNN, flash) against its default forward (how far correct kernels differ on
this model), and `torch-<kernel>` the engine's torch backend held to that kernel. The last rows (16-bit dtypes, CUDA or Triton's interpreter) compare the kernel alone
with the float32 torch reference on random data, one group of 32 samples (rows beyond one tile of the prompt kernel), autotuned
and fixed.

    python benchmarks/backend_exactness.py --models qwen3 llama --dtypes float32 bfloat16 --json OUT/exact.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from common import Table, pick_device, run_header, save_json, write_results

from trl_infinite.engine.attention import LayerAttention, Segment, build_metadata, torch_paged_attention, with_context
from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.config.inputs import model_vocab_size
from trl_infinite.engine.model import exactness as E
from trl_infinite.engine.model.probe import probe_tokens, record_attention_calls
from trl_infinite.engine.model.support import probe_length, verdict
from trl_infinite.engine.runner.kv_pool import KVCachePool
from trl_infinite.engine.runner.model_runner import ModelRunner
from trl_infinite.testing.tiny_configs import build_tiny_model

VARIANTS = ("torch", "torch-math", "torch-efficient", "torch-cudnn", "torch-flash", "triton", "triton-fixed",
            "triton-fp32-dots", "triton-1split")
SDPA = {"math": "MATH", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}


@contextlib.contextmanager
def variant(name: str):
    """Patch the backend's module state for one variant (`torch-<kernel>`: the torch backend with
    `scaled_dot_product_attention` held to that kernel); restore it after."""
    if name == "torch":
        yield "torch"
        return
    if name.startswith("torch-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, SDPA[name.removeprefix("torch-")])):
            yield "torch"
        return
    from trl_infinite.engine.attention import triton_backend as tb
    from trl_infinite.engine.attention import triton_tiles as tiles

    saved = (tb.AUTOTUNE, tiles.dot_mode, tb.prefix_splits, tb.suffix_splits)
    try:
        if name == "triton-fixed":
            tb.AUTOTUNE = False
        elif name == "triton-fp32-dots":
            tiles.dot_mode = lambda *args: (3, "ieee")
        elif name == "triton-1split":
            tb.prefix_splits = lambda *args: 1
            tb.suffix_splits = lambda *args: 1
        yield "triton"
    finally:
        tb.AUTOTUNE, tiles.dot_mode, tb.prefix_splits, tb.suffix_splits = saved


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@torch.no_grad()
def own_kernel_errors(model: torch.nn.Module, ids: torch.Tensor, ref: torch.Tensor, kernel: str) -> list[float]:
    """The model's own forward with `scaled_dot_product_attention` held to `kernel`, against its default forward
    (`ref`): how far two correct attention kernels put this model's logits apart."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = ids.shape[1] - E.DECODE_TOKENS
    with sdpa_kernel(getattr(SDPBackend, SDPA[kernel])):
        out = model(input_ids=ids, use_cache=False).logits[0, p - 1:]
    return [_rel(out[i], ref[i]) for i in range(out.shape[0])]


@torch.no_grad()
def row_errors(model: torch.nn.Module, backend: str, ids: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """The eager path of `exactness_problem`, with each row's error kept (`ref`: the model's own logits of the last
    `DECODE_TOKENS + 1` positions, computed outside the variant's patches)."""
    support = verdict(model, record_attention_calls(model, ids))
    tokens = ids[0].tolist()
    n, p, block = len(tokens), len(tokens) - E.DECODE_TOKENS, 4
    pool = KVCachePool(support.kv, EngineConfig(kv_cache_tokens=2 * n + 12 * block, block_size=block),
                       dtype=support.kv_dtype, device=ids.device)
    runner = ModelRunner(model, pool, backend, support.layers, False)
    prompt_blocks = pool.allocator.allocate(-(-p // block))
    own = pool.allocator.allocate(-(-E.DECODE_TOKENS // block))
    rows = [runner.forward([Segment(p, prompt_blocks, [], 0, tokens[:p])], torch.tensor([p - 1]))[0]]
    for j in range(E.DECODE_TOKENS):
        rows.append(runner.forward([Segment(p, prompt_blocks, own, p + j, [tokens[p + j]])], torch.tensor([0]))[0])
    return [_rel(row, ref[i]) for i, row in enumerate(rows)]


def kernel_errors(device: torch.device, dtype: torch.dtype, samples: int, prompt: int, heads: int, kv_heads: int,
                  head_dim: int, seed: int = 0) -> float:
    """Max abs error of the Triton decode kernel against the float32 torch reference: one group of `samples` rows
    on a `prompt`-token prompt with 1..40 own tokens each (random data, |v| ~ 1)."""
    from trl_infinite.engine.attention import triton_backend as tb

    g = torch.Generator().manual_seed(seed)
    page = 4
    prompt_blocks = list(range(1, 1 + -(-prompt // page)))
    nxt, segs = 1 + len(prompt_blocks), []
    for i in range(samples):
        own = 1 + (i * 7) % 40
        blocks = list(range(nxt, nxt + -(-own // page)))
        nxt += len(blocks)
        segs.append(Segment(prompt, prompt_blocks, blocks, prompt + own - 1, [7], 0))
    k = torch.randn(nxt * page, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(nxt * page, kv_heads, head_dim, generator=g).to(device, dtype)
    q = torch.randn(samples, heads, head_dim, generator=g).to(device, dtype)
    _, _, meta = build_metadata(segs, page, device)
    layer = LayerAttention(scale=head_dim**-0.5)
    got = tb.triton_paged_attention(q, k, v, tb.prepare_cascade(meta, ((0, 0),)), layer)
    ref = torch_paged_attention(q.float(), k.float(), v.float(), with_context(meta, ((0, 0),)), layer)
    return (got.float() - ref).abs().max().item()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3", "llama"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = pick_device(args.device)
    header = run_header(device, "python " + " ".join(sys.argv))
    rowcols = [f"row{i}" for i in range(E.DECODE_TOKENS + 1)]
    table = Table(["part", "model", "dtype", "variant", *rowcols, "max", "note"])

    def add(**row) -> None:
        table.add(**row)
        save_json(args.json, header, table, {})

    for name in args.models:
        for dname in args.dtypes:
            dtype = getattr(torch, dname)
            model = build_tiny_model(name).to(device, dtype).eval()
            ids = probe_tokens(model_vocab_size(model), probe_length(model), device)
            own = E.own_cache_error(model, ids, E.DECODE_TOKENS)
            add(part="engine", model=name, dtype=dname, variant="own-cache", max=own)
            with torch.no_grad():
                ref = model(input_ids=ids, use_cache=False).logits[0, ids.shape[1] - E.DECODE_TOKENS - 1:]
            if device.type == "cuda":
                for kernel in SDPA:
                    try:
                        errs = own_kernel_errors(model, ids, ref, kernel)
                        add(part="model's own", model=name, dtype=dname, variant=f"own-{kernel}", max=max(errs),
                            **{c: e for c, e in zip(rowcols, errs)})
                    except Exception as exc:  # noqa: BLE001 (a kernel that does not take these inputs)
                        add(part="model's own", model=name, dtype=dname, variant=f"own-{kernel}",
                            note=f"{type(exc).__name__}: {exc}"[:160])
            for var in args.variants:
                if var.startswith("torch-") and device.type != "cuda":
                    continue
                try:
                    with variant(var) as backend:
                        errs = row_errors(model, backend, ids, ref)
                    add(part="engine", model=name, dtype=dname, variant=var, max=max(errs),
                        **{c: e for c, e in zip(rowcols, errs)})
                except Exception as exc:  # noqa: BLE001 (a diagnostic: report and go on)
                    add(part="engine", model=name, dtype=dname, variant=var, note=f"{type(exc).__name__}: {exc}"[:160])
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        for dname in [d for d in args.dtypes if d != "float32"]:  # (the kernel's 16-bit path)
            for samples, prompt, heads, kv, hd in ((32, 100, 16, 8, 128),):
                shape = f"{samples}x{prompt} {heads}/{kv}x{hd}"
                for var in [v for v in args.variants if v in ("triton", "triton-fixed")]:
                    try:
                        with variant(var):
                            err = kernel_errors(device, getattr(torch, dname), samples, prompt, heads, kv, hd)
                        add(part="kernel (max abs)", model=shape, dtype=dname, variant=var, max=err)
                    except Exception as exc:  # noqa: BLE001
                        add(part="kernel (max abs)", model=shape, dtype=dname, variant=var,
                            note=f"{type(exc).__name__}: {exc}"[:160])
    write_results(args.json, header, table, {})


if __name__ == "__main__":
    main()
