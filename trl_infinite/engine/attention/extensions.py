"""Building the engine's C++ extensions (`torch.utils.cpp_extension.load_inline`) safely across torch releases: the
CPU decode-attention kernel (`cpu_decode.py`) and the host tensor cache (`runner/host_memory.py`).

Two things torch's own loader leaves to its caller:

- **One build per torch release.** The build directory is named after the extension, the Python version and the CUDA
  tag (`py311_cu130/<name>`), and a build is reused while its sources and flags are unchanged: torch 2.11 and 2.14,
  both `cu130`, would share one build, and the later would load a library built against the other's headers. The
  name gets the torch release (`versioned_name`).
- **An interrupted build.** A build holds a lock file in its directory while it runs; a process killed during the
  build (Ctrl-C, a job's time limit) leaves it behind, and every later process waits on it forever, silently.
  `release_stale_lock` says what it waits for, and removes a lock older than `STALE_LOCK_S` (a build takes about
  half a minute).
"""

from __future__ import annotations

import logging
import os
import re
import time

import torch

logger = logging.getLogger(__name__)

STALE_LOCK_S = 900.0  # a build's lock file older than this is left by a build that was interrupted


def versioned_name(name: str, version: str = torch.__version__) -> str:
    """`name` with the torch release it is built against (a valid module name: `x_torch2_14_1_cu130`)."""
    return f"{name}_torch{re.sub(r'[^0-9A-Za-z]+', '_', version).strip('_')}"


def release_stale_lock(build_dir: str, now: float | None = None) -> bool:
    """Before a build in `build_dir`: a lock file there is another build running or an interrupted one. Older than
    `STALE_LOCK_S` it is removed (True), with a warning; younger, a warning says what the build waits for."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = (time.time() if now is None else now) - os.path.getmtime(lock)
    except OSError:  # no lock: nothing waits
        return False
    if age > STALE_LOCK_S:
        logger.warning("Removing %s, left %.0f s ago by an extension build that was interrupted.", lock, age)
        try:
            os.remove(lock)
        except OSError:  # another process removed it first
            pass
        return True
    logger.warning("Waiting for another process's build of this extension (lock file %s, %.0f s old); if no other "
                   "process is building it, delete that file.", lock, age)
    return False


def load_extension(name: str, **kwargs):
    """`load_inline(versioned_name(name), **kwargs)` after `release_stale_lock` on its build directory."""
    from torch.utils import cpp_extension

    name = versioned_name(name)
    build_dir = getattr(cpp_extension, "_get_build_directory", None)  # (torch's own choice of the directory)
    if build_dir is not None and "build_directory" not in kwargs:
        release_stale_lock(build_dir(name, verbose=False))
    return cpp_extension.load_inline(name, **kwargs)
