"""Where the offline GSM8K / MATH copies live: `$TRL_INFINITE_DATA`, else `../shared/data` beside the checkout.

The datasets are read by path and never copied into the repository; callers raise or skip when a file is absent.
"""

from __future__ import annotations

import os
from pathlib import Path


def data_root() -> Path:
    """The folder holding `gsm8k/` and `math/` (each with `train.jsonl` and `test.jsonl`): `$TRL_INFINITE_DATA`,
    else the first existing of `shared/data` beside the package's checkout and beside the working directory."""
    env = os.environ.get("TRL_INFINITE_DATA")
    if env:
        return Path(env)
    candidates = [Path(__file__).resolve().parents[3] / "shared" / "data", Path.cwd().resolve().parent / "shared" / "data"]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def dataset_file(dataset: str, split: str = "test") -> Path:
    """`data_root() / dataset / f"{split}.jsonl"` (it may not exist)."""
    return data_root() / dataset / f"{split}.jsonl"
