"""Fixtures of the trainer tests: a tiny model, a prompt dataset (helpers in `trainer_helpers.py`)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trainer_helpers import PROMPTS


@pytest.fixture
def dataset():
    return Dataset.from_dict({"prompt": PROMPTS})


@pytest.fixture
def tokenizer():
    from _models import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture
def model():
    from _models import tiny_model

    torch.manual_seed(0)
    return tiny_model("qwen3").train()
