"""Shared pieces of the benchmark scripts: device facts, models, prompts and forced lengths, timing, output tables."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from trl_infinite.sim.traces import TraceRecord, load_trace, lognormal_trace  # noqa: E402
from trl_infinite.testing.shared_data import dataset_file  # noqa: E402

HBM_GBPS = {"H200": 4800.0, "H100": 3350.0}  # peak HBM bandwidth by device-name substring (SXM parts)
GSM8K_TEST = dataset_file("gsm8k")
GB = 1e9
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- device and run facts
def quiet_offline_cpu() -> None:
    """The setting of the CPU support benchmarks: offline, one torch thread, no warnings or transformers logging."""
    import warnings

    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()


def pick_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores visible), torch {torch.__version__}"


def default_hbm_gbps(device: torch.device) -> float | None:
    """Peak HBM bandwidth (GB/s) of a known GPU, None elsewhere (then the roofline column stays empty)."""
    name = device_name(device)
    for key, gbps in HBM_GBPS.items():
        if key in name:
            return gbps
    return None


def git_commit() -> str:
    """Short commit of the checkout (+dirty with uncommitted changes to tracked files). A copy without `.git` (the
    GPU machine) reads `$BENCH_COMMIT`, else `.whl/COMMIT` (written by `prepare_gpu_wheels.sh`), else "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=REPO)
        status = ["git", "status", "--porcelain", "--untracked-files=no"]
        dirty = subprocess.run(status, capture_output=True, text=True, cwd=REPO)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    stamp = REPO / ".whl" / "COMMIT"
    return stamp.read_text().strip() + " (from .whl/COMMIT)" if stamp.exists() else "unknown"


def run_header(device: torch.device, command: str) -> dict:
    return {
        "device": device_name(device),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "command": command,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbps(device: torch.device, gigabytes: float = 2.0, iters: int = 20) -> float | None:
    """Measured device-to-device copy bandwidth (GB/s, bytes read + bytes written, median of `iters` copies of
    `gigabytes` (source size) timed with CUDA events): the achievable HBM ceiling. None off CUDA."""
    if device.type != "cuda":
        return None
    n = int(gigabytes * GB) // 4  # float32 elements of the source
    src = torch.randn(n, device=device, dtype=torch.float32)  # random data, never zeros
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    seconds = sorted(times)[len(times) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 4 / seconds / GB


# ------------------------------------------------------------------------------------------------------------ models
def dtype_for(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_model(name: str, dtype: torch.dtype, device: torch.device):
    """(model, tokenizer or None). "smollm2-real": SmolLM2-135M-Instruct with its real weights and tokenizer
    (offline); any other name: a random-weight model of that architecture from `trl_infinite.testing.model_zoo`."""
    if name == "smollm2-real":
        from trl_infinite.testing.offline_models import load_smollm2

        model, tok = load_smollm2(dtype=dtype, device=str(device))
        return model.eval(), tok
    from trl_infinite.testing.model_zoo import random_model

    return random_model(name, dtype=dtype, device=device), None


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step must read: every parameter once, except an untied input embedding (only gathered)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or emb.weight.data_ptr() != head.weight.data_ptr():
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


# ------------------------------------------------------------------------------------------ prompts and forced lengths
@dataclass
class Workload:
    """The same prompts and per-sample completion lengths for every path."""

    prompt_ids: list[list[int]]  # one per distinct prompt
    lengths: list[list[int]]  # [num_prompts][G] forced completion lengths (EOS included)
    source: str  # where the lengths come from
    eos_id: int
    pad_id: int

    @property
    def group_size(self) -> int:
        return len(self.lengths[0])

    @property
    def num_tokens(self) -> int:
        return sum(map(sum, self.lengths))


def trace_lengths(num_prompts: int, group_size: int, max_new: int, trace: str | None, mean: float, sigma: float,
                  prompt_len: int, seed: int) -> tuple[list[TraceRecord], str]:
    """`num_prompts` records of `group_size` lengths <= max_new: from a trace file (cycled, lengths cycled/clipped)
    or lognormal with the stated mean and spread."""
    if trace is None:
        recs = lognormal_trace(num_prompts, group_size, mean, sigma, max_new, prompt_len=prompt_len, seed=seed)
        return recs, f"lognormal(mean={mean}, sigma={sigma}, max={max_new}, seed={seed})"
    src = load_trace(trace)
    out = []
    for i in range(num_prompts):
        r = src[i % len(src)]
        lengths = [min(max_new, r.lengths[j % len(r.lengths)]) for j in range(group_size)]
        out.append(TraceRecord(prompt_len=r.prompt_len, lengths=lengths, prompt_index=i, prompt_ids=r.prompt_ids))
    return out, f"trace {trace} (clipped to {max_new})"


def gsm8k_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """Chat-formatted GSM8K test questions (read in place, never copied)."""
    lines = GSM8K_TEST.read_text().splitlines()[:num_prompts]
    msgs = [[{"role": "user", "content": json.loads(line)["question"]}] for line in lines]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def make_workload(model, tokenizer, records: list[TraceRecord], source: str, seed: int) -> Workload:
    """Prompts: the tokenizer's GSM8K prompts when there is a tokenizer, the trace's ids if it has them, else random
    ids of the trace's prompt length (random-weight models: the token values do not change speed or memory)."""
    vocab = model.config.get_text_config().vocab_size
    if tokenizer is not None:
        prompts = gsm8k_prompts(tokenizer, len(records))
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    else:
        g = torch.Generator().manual_seed(seed)
        prompts = [r.prompt_ids or torch.randint(2, vocab, (r.prompt_len,), generator=g).tolist() for r in records]
        eos, pad = 1, 0
    pad = eos if pad is None else pad
    return Workload(prompts, [r.lengths for r in records], source, eos, pad)


# --------------------------------------------------------------------------------------------- measurement and output
@dataclass
class Measured:
    seconds: float
    peak_bytes: int | None  # torch.cuda.max_memory_allocated during the call; None on CPU
    value: object = None


def measure(fn: Callable[[], object], device: torch.device) -> Measured:
    """Wall time and CUDA peak allocated memory of one call."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    value = fn()
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return Measured(seconds, peak, value)


def check_lengths(completions: list[list[int]], workload: Workload, path: str) -> None:
    """Every path must produce exactly the forced lengths (else the comparison is void)."""
    want = [n for group in workload.lengths for n in group]
    got = [len(c) for c in completions]
    if sorted(got) != sorted(want) or sum(got) != workload.num_tokens:
        bad = sum(a != b for a, b in zip(sorted(got), sorted(want)))
        raise RuntimeError(f"{path}: {bad} completions do not have their forced length; results discarded.")


@dataclass
class Table:
    columns: list[str]
    rows: list[dict] = field(default_factory=list)
    echo: bool = True  # print each row as it is added (a table printed whole at the end: False)

    def add(self, **row) -> None:
        if self.echo and not self.rows:
            print(self.markdown().rstrip("\n"), flush=True)
        self.rows.append(row)
        if self.echo:
            print(self.markdown_row(row), flush=True)

    def markdown_row(self, row: dict) -> str:
        return "| " + " | ".join(_fmt(row.get(c)) for c in self.columns) + " |"

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |\n|" + "---|" * len(self.columns) + "\n"
        return head + "\n".join(self.markdown_row(r) for r in self.rows)


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free confidence interval of the median of `xs` (order statistics, the sign test):
    `(x_(k), x_(n+1-k), coverage)` for the largest k whose coverage `1 - 2 P(Bin(n, 1/2) < k)` is still >= `level`;
    with too few values for `level` (n < 6 at 0.95), the range (k = 1) and its lower coverage."""
    xs, n = sorted(xs), len(xs)
    if n == 0:
        raise ValueError("median_ci: no values")

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _markdown(header: dict, table: Table) -> str:
    return "\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + table.markdown() + "\n"


def save_json(path: str | None, header: dict, table: Table, extra: dict) -> None:
    """The JSON of a run (rows so far) and its markdown beside it (*.md): rewritten after every row, so a run cut short
    keeps what it measured."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({**header, **extra, "rows": table.rows}, indent=1))
        Path(path).with_suffix(".md").write_text(_markdown(header, table))


def write_results(path: str | None, header: dict, table: Table, extra: dict) -> None:
    """Print the header and the table; with `path` (*.json) also write the JSON and the same markdown beside it
    (*.md)."""
    text = _markdown(header, table)
    print("\n" + text, flush=True)
    if path:
        save_json(path, header, table, extra)
        print(f"\nwrote {path} and {Path(path).with_suffix('.md')}")
