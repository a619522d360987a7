"""Building the C++ extensions (`engine/attention/extensions.py`): one build per torch release, and a lock file
left by an interrupted build neither blocks every later process silently nor is taken from a running build."""

from __future__ import annotations

import logging
import os

import torch

from trl_infinite.engine.attention import extensions


def test_the_name_carries_the_torch_release():
    assert extensions.versioned_name("ext", "2.14.1+cu130") == "ext_torch2_14_1_cu130"
    assert extensions.versioned_name("ext", "2.13.0") == "ext_torch2_13_0"
    assert extensions.versioned_name("ext", "2.11.0+cu130") != extensions.versioned_name("ext", "2.14.1+cu130")
    assert extensions.versioned_name("ext").isidentifier() and torch.__version__.split("+")[0].replace(
        ".", "_") in extensions.versioned_name("ext")


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    assert not extensions.release_stale_lock(str(tmp_path))  # no lock: nothing to say
    lock = tmp_path / "lock"
    lock.touch()
    now = os.path.getmtime(lock)
    with caplog.at_level(logging.WARNING, logger=extensions.__name__):
        assert not extensions.release_stale_lock(str(tmp_path), now=now + 5)  # a build running: kept, said
        assert lock.exists() and "Waiting for another process's build" in caplog.text and str(lock) in caplog.text
        assert extensions.release_stale_lock(str(tmp_path), now=now + extensions.STALE_LOCK_S + 1)
    assert not lock.exists() and "interrupted" in caplog.text
