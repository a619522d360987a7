"""Shared fixtures of the speculative-decoding tests: the tiny target and draft models, one intra-op thread."""

import pytest
import torch
from _models import tiny_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster, and far faster on a shared, oversubscribed CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def draft():
    return tiny_model("llama", seed=3)
