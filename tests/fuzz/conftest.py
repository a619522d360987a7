"""Fixtures shared by the fuzzers."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One torch thread for the test (the fuzzers' many tiny forwards run faster, and CI's two cores stay shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
