"""Where the offline GSM8K / MATH copies live: `$TRL_INFINITE_DATA`, else `../shared/data` beside the checkout.

The datasets are read by path and never copied into the repository; callers raise or skip when a file is absent.
"""

from __future__ import annotations

import os
from pathlib import Path


def data_root() -> Path:
    """The folder holding `gsm8k/` and `math/` (each with `train.jsonl` and `test.jsonl`)."""
    env = os.environ.get("TRL_INFINITE_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


def dataset_file(dataset: str, split: str = "test") -> Path:
    """`data_root() / dataset / f"{split}.jsonl"` (it may not exist)."""
    return data_root() / dataset / f"{split}.jsonl"
