import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))

# Tiny models on a 2-core CI machine: intra-op threading only adds overhead.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

# Without a GPU, Triton kernels run under Triton's CPU interpreter; the switch must be set before the first
# `import triton` anywhere in the session (the engine imports it lazily for the "auto" backend).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--fuzz-long", action="store_true", default=False,
                     help="run the differential fuzzer's long profile (tests/fuzz; also TRL_INFINITE_FUZZ=long)")
