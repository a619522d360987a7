"""The host tensor cache (`engine/runner/host_memory.py`): large CPU tensors from their own mappings, reused by size class,
at most `limit` bytes kept, everything given back by `trim`, small tensors untouched, values unchanged."""

import sys

import pytest
import torch

from trl_infinite.engine.runner import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cache maps memory with mmap (Linux)")

MB = 1 << 20


@pytest.fixture
def cache():
    was = host_memory.installed()
    before = host_memory.stats().limit_bytes
    if not host_memory.install(8 * MB):
        pytest.skip("the host tensor cache could not be built here (no C++ compiler / ninja)")
    host_memory.trim()
    yield host_memory
    host_memory.trim()
    if was:
        host_memory.install(before)
    else:
        host_memory.uninstall()


def test_size_classes_reuse_limit_and_trim(cache):
    start = cache.stats()
    a = torch.arange(3 * MB // 4, dtype=torch.float32)  # 3 MiB: its own mapping
    s = cache.stats()
    assert s.misses == start.misses + 1 and s.mapped_bytes - start.mapped_bytes == 3 * MB
    assert a[-1].item() == 3 * MB // 4 - 1  # the values are the tensor's
    small = torch.ones(1000)  # below MIN_BYTES: the default allocator
    assert cache.stats().misses == s.misses and small.sum().item() == 1000
    del a
    assert cache.stats().cached_bytes == 3 * MB  # kept for the next tensor of its class
    b = torch.empty(3 * MB // 4 - 1000)  # same size class (3 MiB - 4 kB rounds up to 3 MiB)
    s2 = cache.stats()
    assert s2.hits == s.hits + 1 and s2.cached_bytes == 0 and s2.mapped_bytes == s.mapped_bytes
    b.fill_(2.0)
    assert b.sum().item() == 2.0 * b.numel()
    del b
    tensors = [torch.empty(MB + i * 300_000) for i in range(8)]  # eight classes, 4 to 13 MiB
    live = cache.stats().mapped_bytes
    del tensors
    s3 = cache.stats()
    assert s3.cached_bytes <= 8 * MB < live - start.mapped_bytes  # the oldest were given back beyond the limit
    assert s3.mapped_bytes == start.mapped_bytes + s3.cached_bytes
    assert cache.trim() == s3.cached_bytes and cache.stats().cached_bytes == 0
    assert cache.stats().mapped_bytes == start.mapped_bytes


def test_uninstall_restores_the_default_allocator(cache):
    cache.uninstall()
    assert not cache.installed()
    misses = cache.stats().misses
    x = torch.empty(4 * MB)
    assert cache.stats().misses == misses and x.numel() == 4 * MB
    cache.install(8 * MB)
    assert cache.installed()


def test_install_rejects_a_negative_limit():
    with pytest.raises(ValueError, match="limit_bytes"):
        host_memory.install(-1)
