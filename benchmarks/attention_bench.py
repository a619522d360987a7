"""Decode attention alone, one layer: Triton cascade kernel vs the same kernel with no prefix sharing vs the torch
reference, for `prompts` groups of G samples over the paged pool. Prints a markdown table and writes JSON.

Columns: `us` mean time per call; `kv_MB` the KV bytes the variant must read (cascade: each group's prompt once;
others: every sample's whole context); `GB/s` = kv_MB / time; `x_roofline` = time / (kv bytes / HBM bandwidth);
`max_err` against the torch reference in float32.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch
from common import GB, Table, default_hbm_gbps, dtype_for, pick_device, run_header, sync, write_results

from trl_infinite.engine.attention import LayerAttention, Segment, build_metadata, resolve_backend, with_context

MASKS = ((None, None),)  # one full-causal mask pattern (no sliding window, no chunking)
COLUMNS = ["prompts", "G", "prompt_len", "own_len", "variant", "us", "kv_MB", "GB/s", "x_roofline", "max_err"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, nargs="+", default=[1, 8])
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--prompt-len", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--own-len", type=int, nargs="+", default=[256, 1024], help="tokens of each sample's own blocks")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--variants", nargs="+", default=["triton", "triton_no_share", "torch"])
    p.add_argument("--hbm-gbps", type=float, default=None)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def make_case(num_prompts: int, g: int, prompt_len: int, own_len: int, page: int, shared: bool):
    """Decode segments: every sample at position prompt_len + own_len - 1, its own blocks after the prompt's."""
    nb = -(-prompt_len // page)
    ob = -(-own_len // page)
    segs, nxt = [], 0
    for i in range(num_prompts):
        prompt_blocks = list(range(nxt, nxt + nb))
        nxt += nb
        for j in range(g):
            own = list(range(nxt, nxt + ob))
            nxt += ob
            gid = i if shared else i * g + j
            segs.append(Segment(prompt_len, prompt_blocks, own, prompt_len + own_len - 1, [0], gid))
    return segs, nxt


def time_call(fn, device: torch.device, iters: int) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    dtype = dtype_for(args.dtype, device)
    hbm = args.hbm_gbps or default_hbm_gbps(device)
    backends = {v: resolve_backend("torch" if v == "torch" else "triton", device) for v in args.variants}
    reference = resolve_backend("torch", device)
    header = run_header(device, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    table = Table(COLUMNS)
    tok_bytes = 2 * args.kv_heads * args.head_dim * torch.tensor([], dtype=dtype).element_size()
    layer = LayerAttention(scale=args.head_dim**-0.5)
    for n in args.num_prompts:
        for plen in args.prompt_len:
            for own in args.own_len:
                segs, blocks = make_case(n, args.group_size, plen, own, args.block_size, shared=True)
                shape = (blocks * args.block_size, args.kv_heads, args.head_dim)
                k = torch.randn(shape, device=device, dtype=dtype)
                v = torch.randn(shape, device=device, dtype=dtype)
                q = torch.randn(len(segs), args.heads, args.head_dim, device=device, dtype=dtype)
                ref = None
                for variant in args.variants:
                    cases = segs if variant != "triton_no_share" else make_case(
                        n, args.group_size, plen, own, args.block_size, shared=False)[0]
                    _, _, raw = build_metadata(cases, args.block_size, device)
                    fn = backends[variant].attend
                    meta = backends[variant].prepare(raw, MASKS)  # once per forward (cascade plan / context plan)
                    out = fn(q, k, v, meta, layer)
                    if ref is None:  # float32 torch reference (the same attention for every variant)
                        ref = reference.attend(q.float(), k.float(), v.float(), with_context(raw, MASKS), layer)
                    secs = time_call(lambda f=fn, m=meta, q=q, k=k, v=v: f(q, k, v, m, layer), device, args.iters)
                    ctx = n * plen + len(segs) * own if variant == "triton" else len(segs) * (plen + own)
                    kv = ctx * tok_bytes
                    table.add(prompts=n, G=args.group_size, prompt_len=plen, own_len=own, variant=variant,
                              us=secs * 1e6, kv_MB=kv / 1e6, **{"GB/s": kv / secs / GB},
                              x_roofline=secs / (kv / (hbm * 1e9)) if hbm else None,
                              max_err=(out.float() - ref).abs().max().item())
    write_results(args.json, header, table, {"dtype": str(dtype), "hbm_gbps": hbm, "args": vars(args)})


if __name__ == "__main__":
    main()
